"""Decode steps as CUDA graphs: captured per (batch bucket, dispatch capacity, expanded), then replayed.

A decode step (every sequence of the rank one new token) with a fixed MoE
dispatch capacity has no host sync and no data-dependent shape, so its whole
forward can be captured once and replayed with new inputs: no kernel launch
overhead, which dominates small decode batches. Legend: B rows of a bucket,
n real sequences, r real rows (B - r padding rows), M block-table columns, V vocab.

- Expanded steps: a step whose sequences bring a few new tokens each (a
  jump-forward chunk, a short prompt chunk: at most `max_seq_tokens`, none
  scored for prompt logprobs) runs as r = (their total) decode rows, row j of
  a sequence at position num_computed + j with its own slot, context length
  num_computed + j + 1 and the sequence's block table (services/model/batch.py,
  "expanded"). Every row is then an ordinary decode row for the layer; the
  attention stores all rows' K/V before any row attends (rows of one
  sequence read each other's), so this variant is captured apart (the key's
  flag) and plain decode steps keep the decode kernel's own KV write. The
  output row of sequence i is its last row (sample_indices_S, uploaded with
  the inputs), so callers see one row per sequence either way. Eagerly, such
  a step would cost many graph decodes at a small batch (launch overhead):
  more than the decode steps a jump-forward chunk saves.
- Buckets: a step of r rows runs the graph of the smallest bucket >= r
  (`cuda_graph_buckets`), padded with rows that read and write no KV
  (as services/model/batch.py build_decode_batch: input id 0, position 0, slot
  -1, context length 0, a block table of zeros). An idle rank of a decode
  step (n = 0) runs the smallest bucket, all padding, so it keeps pace with
  its group.
- Key: (B, capacity, expanded); the capacity comes from the group's largest batch, so
  every rank uses the same one. B * min(K, slots) must fit in it (it does
  when the buckets are powers of two, the capacity's rounding). With
  pad_to_capacity (the ranks of kernels/moe_ep.py's expert-parallel MoE on CUDA) B is
  the capacity's own bucket: one key per capacity, whatever the rank's share.
- Static inputs: one batch of the largest bucket; bucket B uses its first B
  rows and all M columns (M from the model's context length). The input ids,
  positions, slots, sample rows and context lengths are views of one device byte buffer
  (graph_inputs.StaticInputs), which each step fills with one non-blocking copy from
  pinned memory, together with its block tables' used columns, packed; one
  copy kernel then puts those columns into the static tables (the kernel
  reads no column past a row's context). Before, each of the five tensors
  travelled on its own: five host-to-device copies, and one more kernel for
  the tables. Outputs: fp32 logits [B, V] and their argmax, in static
  buffers shared by every graph; all graphs share one memory pool.
- Lockstep: every rank of a group runs the same collectives each step. A
  capture runs nothing (its replay runs the step), so a rank may capture
  while its peers replay or run eagerly. A key's first step runs eagerly
  (padded: it warms up exactly the graph's kernels) and it is captured on
  its second; warm-up forwards on the side, which would add collectives,
  never run.
- Hit counts: padding rows are routed like any token, so their expert hits
  are taken back out of the model's hit_counts_LE. Every padding row of a
  key computes the same numbers (same inputs, row-wise kernels), so the
  key's first eager step with padding probes the last row's experts once;
  every later step subtracts (B - r) times that. The real rows of an
  expanded step are real tokens, counted as the eager chunk step counts them.
- Fed tokens: a decode input that is the sequence's token sampled in an
  earlier step comes from the device (a `TokenFeed`, patched into the
  static input ids after the host rows are copied, just before the replay),
  so a step can be launched before the last one's tokens are read. Its rows
  index the step's flattened tokens, which are the expanded rows, in order.
- Sync: nothing here reads the device. The caller's one read of the
  sampled tokens is the step's only host sync.

`capture` is injectable: on the CPU, tests pass a stand-in that returns the
function itself, so the bucket, padding, key and row logic runs without CUDA.
"""

import dataclasses
import logging
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from expert_svc.graph_inputs import StaticInputs
from services.kv_pool import KVPool
from services.model.attention import ATTENTION_BACKENDS, AttentionBackend, AutoAttention
from services.model.batch import ForwardBatch, SeqInput
from services.model.moe_backend import gathers_on

log = logging.getLogger("expert_svc")

# fn -> replay: records fn once, returns what runs it again.
Capture = Callable[[Callable[[], None]], Callable[[], None]]
# (rows of the bucket, dispatch capacity, expanded)
Key = tuple[int, int, bool]
# The most new tokens of one sequence in an expanded step. Each row's attention reads the
# sequence's whole context, so k rows read it k times: fine for a jump's few tokens or a
# short prompt chunk, not for a long chunk, which the prefill kernel tiles (eager).
MAX_SEQ_TOKENS = 16


def captures_decode(backend: AttentionBackend, device: torch.device) -> bool:
    """Whether `backend`'s decode path can be captured in a CUDA graph on `device`.

    A backend may say so with a `cuda_graph_capturable` attribute; otherwise
    only the Triton backend on CUDA (also behind "auto") qualifies: the torch
    reference loops over sequences on the host.
    """
    if device.type != "cuda":
        return False
    if hasattr(backend, "cuda_graph_capturable"):
        return bool(backend.cuda_graph_capturable)
    triton_backend = ATTENTION_BACKENDS.get("triton")
    return isinstance(backend, AutoAttention) or (triton_backend is not None and isinstance(backend, triton_backend))


def make_graph_runner(model, kv_pool: KVPool, block_size: int, buckets: Sequence[int],
                      max_context: int = 0, max_seq_tokens: int = MAX_SEQ_TOKENS) -> "DecodeGraphRunner | None":
    """The rank's graph runner, or None: no buckets, or a device or attention backend
    that cannot capture. max_context (0: the model's) fixes the block-table width;
    max_seq_tokens bounds an expanded step's tokens per sequence (1: decode steps only)."""
    if not buckets:
        return None
    if not captures_decode(model.attention, torch.device(model.device)):
        log.info("decode steps run eagerly: no CUDA graphs for attention %s on %s",
                 type(model.attention).__name__, model.device)
        return None
    max_blocks = -(-(max_context or model.config.max_position_embeddings) // block_size)
    device = torch.device(model.device)
    return DecodeGraphRunner(model, kv_pool, block_size, buckets=buckets, max_blocks=max_blocks,
                             pad_to_capacity=model.comm.world_size > 1 and gathers_on(device),
                             max_seq_tokens=max_seq_tokens)


def cuda_capture(pool) -> Capture:
    """Real capture into the shared memory pool `pool`."""
    def capture(fn: Callable[[], None]) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        # thread_local: the NCCL watchdog's event queries on its own thread do not void the capture.
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            fn()
        return graph.replay
    return capture


@dataclasses.dataclass(frozen=True, slots=True)
class TokenFeed:
    """Input rows whose token ids are on the device (tokens sampled in earlier
    steps, not yet read back) instead of in the host batch. F fed rows."""

    rows_F: Tensor  # int64 rows of the batch's input_ids_T
    token_ids_F: Tensor  # int64

    def apply(self, input_ids_T: Tensor) -> None:
        """Writes the fed token ids into input_ids_T (device order: after its upload)."""
        input_ids_T.index_copy_(0, self.rows_F, self.token_ids_F)


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeOutput:
    """One decode step's results, row i for sequence i (its last row); views of static
    buffers, valid until the next run."""

    logits_SV: Tensor  # fp32
    greedy_S: Tensor  # int64 argmax of logits_SV, on the device


class DecodeGraphRunner:
    """Runs a rank's decode steps through CUDA graphs (see the module doc)."""

    def __init__(self, model, kv_pool: KVPool, block_size: int, *, buckets: Sequence[int],
                 max_blocks: int, capture: Capture | None = None, pad_to_capacity: bool = False,
                 max_seq_tokens: int = MAX_SEQ_TOKENS):
        if not buckets or min(buckets) <= 0:
            raise ValueError(f"buckets must be positive batch sizes, got {list(buckets)}")
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        if max_seq_tokens <= 0:
            raise ValueError(f"max_seq_tokens must be positive, got {max_seq_tokens}")
        self.max_seq_tokens = max_seq_tokens
        self.model, self.kv_pool, self.block_size = model, kv_pool, block_size
        self.buckets = tuple(sorted(set(buckets)))
        self.max_blocks = max_blocks
        self.device = torch.device(model.device)
        self._capture = capture or cuda_capture(torch.cuda.graph_pool_handle())
        # Most rows one peer can get from one token (a token's K experts are distinct).
        self._rows_per_token = min(model.config.num_experts_per_tok, model.num_local_slots)
        # Every step takes the bucket of its capacity (the group's largest rank batch, rounded up)
        # when that is a bucket: one key per capacity, so the ranks of a group never meet a new
        # (bucket, capacity) pair when their batch sizes drift apart (each new key costs an eager
        # step and a capture). For the ranks of moe_ep's MoE, which pads every rank's rows to
        # that count anyway.
        self._pad_to_capacity = pad_to_capacity
        rows = self.buckets[-1]
        self._inputs = StaticInputs(rows, max_blocks, self.device)
        self._input_ids_R = self._inputs.input_ids_R
        self._cu_q_lens_R1 = torch.arange(rows + 1, dtype=torch.int32, device=self.device)
        self._batches: dict[tuple[int, bool], ForwardBatch] = {}
        self._logits_RV = torch.zeros(rows, model.config.vocab_size, dtype=torch.float32, device=self.device)
        self._greedy_R = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self._replays: dict[Key, Callable[[], None]] = {}
        self._warmed: set[Key] = set()
        self._pad_hits: dict[Key, Tensor] = {}  # [moe layers, E] hits of one padding row
        self._replay_bytes: dict[Key, int] = {}  # all-to-all bytes of one replay
        self.num_eager = self.num_captures = self.num_replays = 0

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest bucket holding num_seqs rows (at least one), None if none does."""
        return next((b for b in self.buckets if b >= max(num_seqs, 1)), None)

    def step_bucket(self, num_seqs: int, capacity: int) -> int | None:
        """The bucket a step of num_seqs rows at this capacity runs: bucket(num_seqs), or
        with pad_to_capacity the capacity's rows per rank if that is a bucket holding them."""
        bucket = self.bucket(num_seqs)
        if self._pad_to_capacity and bucket is not None:
            group_rows = capacity // self._rows_per_token
            if group_rows in self.buckets and group_rows >= bucket:
                return group_rows
        return bucket

    def fits(self, seqs: Sequence[SeqInput], capacity: int | None) -> bool:
        """Whether this step can run here: fixed capacity, one new token per sequence or
        (expanded) up to max_seq_tokens and no multi-token chunk scored for prompt
        logprobs (those want a row per token), a bucket of its rows that fits the capacity,
        block tables within max_blocks."""
        if capacity is None:
            return False
        num_rows = 0
        for s in seqs:
            num_tokens = len(s.token_ids)
            if num_tokens > 1 and (num_tokens > self.max_seq_tokens or s.is_scored):
                return False
            num_rows += num_tokens
        bucket = self.step_bucket(num_rows, capacity)
        return (bucket is not None and bucket * self._rows_per_token <= capacity
                and all(len(s.block_table) <= self.max_blocks for s in seqs))

    def run(self, seqs: Sequence[SeqInput], capacity: int, feed: TokenFeed | None = None) -> DecodeOutput:
        """Runs one decode step (fits() must hold): eagerly the first time its key
        is seen, then by capture and replay. `feed` overrides the input ids of its rows
        (indices into the step's flattened tokens: its rows)."""
        num_seqs, num_rows = len(seqs), sum(len(s.token_ids) for s in seqs)
        bucket = self.step_bucket(num_rows, capacity)
        key, num_pad = (bucket, capacity, num_rows > num_seqs), bucket - num_rows
        self._inputs.upload(seqs, self.block_size, bucket)
        if feed is not None:
            feed.apply(self._input_ids_R)
        batch = self._static_batch(bucket, key[2])
        logits_BV, greedy_B = self._logits_RV[:bucket], self._greedy_R[:bucket]
        probe = num_pad > 0 and key not in self._pad_hits
        if key in self._warmed and not probe:
            if key not in self._replays:
                self._capture_key(key, batch, logits_BV, greedy_B)
            self._replays[key]()
            self.num_replays += 1
            self._count_replayed_bytes(key)
        else:
            hits_LE = torch.zeros_like(self.model.hit_counts_LE) if probe else None
            self._step(batch, capacity, logits_BV, greedy_B, hits_LE)
            self._warmed.add(key)
            if probe:
                self._pad_hits[key] = hits_LE
            self.num_eager += 1
        if num_pad:
            self.model.hit_counts_LE.sub_(self._pad_hits[key], alpha=num_pad)
        return DecodeOutput(logits_BV[:num_seqs], greedy_B[:num_seqs])

    def _capture_key(self, key: Key, batch: ForwardBatch, logits_BV: Tensor, greedy_B: Tensor) -> None:
        bucket, capacity, expanded = key
        log.info("capturing the %sdecode graph of %d rows at capacity %d", "expanded " if expanded else "",
                 bucket, capacity)
        # A metered comm counts bytes as its all_to_all is called: at capture, not at replays.
        bytes_before = getattr(self.model.comm, "step_bytes", None)
        self._replays[key] = self._capture(lambda: self._step(batch, capacity, logits_BV, greedy_B))
        self.num_captures += 1
        if bytes_before is not None:
            self._replay_bytes[key] = self.model.comm.step_bytes - bytes_before
            self.model.comm.step_bytes = bytes_before

    def _count_replayed_bytes(self, key: Key) -> None:
        if key in self._replay_bytes:
            self.model.comm.step_bytes += self._replay_bytes[key]

    @torch.inference_mode()
    def _step(self, batch: ForwardBatch, capacity: int, logits_BV: Tensor, greedy_B: Tensor,
              last_row_hits_LE: Tensor | None = None) -> None:
        """The captured work: the forward into the static logits, then their argmax."""
        self.model.forward_at_capacity(batch, self.kv_pool, capacity, logits_SV=logits_BV,
                                       last_row_hits_LE=last_row_hits_LE)
        torch.argmax(logits_BV, dim=-1, out=greedy_B)

    def _static_batch(self, bucket: int, expanded: bool) -> ForwardBatch:
        """The graph inputs of a bucket: views of the static tensors (host fields unused)."""
        if (bucket, expanded) not in self._batches:
            self._batches[(bucket, expanded)] = self._make_static_batch(bucket, expanded)
        return self._batches[(bucket, expanded)]

    def _make_static_batch(self, bucket: int, expanded: bool) -> ForwardBatch:
        inputs = self._inputs
        return ForwardBatch(
            input_ids_T=inputs.input_ids_R[:bucket],
            positions_T=inputs.positions_R[:bucket],
            slot_mapping_T=inputs.slots_R[:bucket],
            q_lens=(1,) * bucket,
            context_lens=(0,) * bucket,
            block_tables_BM=inputs.block_tables_RM[:bucket],
            sample_indices_S=inputs.sample_rows_R[:bucket],
            context_lens_B=inputs.context_lens_R[:bucket],
            cu_q_lens_B1=self._cu_q_lens_R1[:bucket + 1],
            max_q_len=1,
            is_expanded=expanded,
        )
