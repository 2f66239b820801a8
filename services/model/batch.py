"""One forward step's inputs: the sequences of a step flattened into a varlen batch.

A batch mixes prefill chunks and decode tokens of several sequences. Tokens of
all sequences are concatenated along T; sequence i owns rows
`[cu_q_lens[i], cu_q_lens[i + 1])`. Legend: T tokens of the step, B sequences,
S rows whose logits are returned, M blocks of the longest block table.

The host tuples (q_lens, context_lens) serve loops on the host (the torch
reference attention); GPU kernels read only the device tensors, so a decode
step can be captured in a CUDA graph and replayed with new tensor contents.

An expanded decode batch (`is_expanded`, build_decode_batch with a sequence
of several new tokens) gives each new token of a sequence its own decode row:
row j of a sequence of k tokens has position num_computed + j, its own KV
slot, context length num_computed + j + 1 and the sequence's block table. The
attention of row j then reads rows 0..j-1 of the same sequence from the KV
cache (causal by context length), so the backend stores every row's K/V before
any row attends; everything else in the layer is row-wise already. So a few
new tokens per sequence (a jump-forward chunk, a short prompt chunk) take the
shapes of a decode step, which a CUDA graph can replay.
"""

import dataclasses
import itertools
from collections.abc import Sequence

import torch
from torch import Tensor


@dataclasses.dataclass(slots=True)
class SeqInput:
    """One sequence's share of a step."""

    seq_id: int
    # The new input tokens of this step (at least one).
    token_ids: list[int]
    # Tokens already in the KV cache: this step's positions start here.
    num_computed: int
    # KV block ids covering num_computed + len(token_ids) tokens (a list or an int32 array).
    block_table: Sequence[int]
    # Return logits for the last new token.
    is_sampled: bool
    # Return logits for every new token (a prompt chunk whose log-probabilities are reported).
    is_scored: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class ForwardBatch:
    """The tensors of one step; host-side lengths for the per-sequence loops."""

    input_ids_T: Tensor  # int64
    positions_T: Tensor  # int64, position of each token within its sequence
    # int64, KV slot (block * block_size + offset) each token writes; -1 writes
    # nothing (the padding rows of a CUDA-graph batch).
    slot_mapping_T: Tensor
    q_lens: tuple[int, ...]  # new tokens per sequence (B)
    context_lens: tuple[int, ...]  # num_computed + new tokens per sequence (B)
    block_tables_BM: Tensor  # int32, padded with 0 past each sequence's table
    # Rows of T whose logits forward returns: the last token of each sampled
    # sequence, every token of a scored one (SeqInput.is_scored), in order.
    sample_indices_S: Tensor  # int64
    context_lens_B: Tensor  # int32, context_lens on the device (0: a padding row)
    cu_q_lens_B1: Tensor  # int32, cu_q_lens on the device (B + 1 entries)
    # The most new tokens of any sequence (0 for an empty batch): 1 means a pure
    # decode batch, whose row i is sequence i (or, expanded, one token of one).
    max_q_len: int
    # Rows of one sequence may follow one another (see the module doc): the attention
    # stores every row's K/V before any row attends (rows read their predecessors').
    is_expanded: bool = False

    @property
    def num_tokens(self) -> int:
        """T: the number of new tokens in the step."""
        return self.input_ids_T.shape[0]

    @property
    def is_decode(self) -> bool:
        """True if every sequence has exactly one new token (T == B)."""
        return self.max_q_len == 1

    @property
    def cu_q_lens(self) -> list[int]:
        """Start row of each sequence's tokens, then T (B + 1 entries)."""
        return [0, *itertools.accumulate(self.q_lens)]


def build_forward_batch(seqs: list[SeqInput], block_size: int, device) -> ForwardBatch:
    """Flattens the step's sequences into one batch on `device`.

    An empty list gives an empty batch (an idle step still runs the model so
    the expert collectives of every rank line up).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    max_blocks = max((len(s.block_table) for s in seqs), default=0)
    rows = _Rows(seqs, block_size, max_blocks)
    sample_indices = []
    cu_q_lens = rows.cu_q_lens
    for start, end, seq in zip(cu_q_lens, cu_q_lens[1:], seqs):
        if seq.is_scored:
            sample_indices.extend(range(start, end))
        elif seq.is_sampled:
            sample_indices.append(end - 1)
    return rows.to_batch(sample_indices, device)


def build_decode_batch(seqs: list[SeqInput], block_size: int, device, *,
                       num_rows: int, max_blocks: int, max_seq_tokens: int = 1) -> ForwardBatch:
    """A decode batch padded to exactly `num_rows` rows and `max_blocks` table columns.

    For CUDA graphs, whose tensor shapes are fixed when captured: every batch
    of one bucket has the same shapes, so the runner copies it into the
    graph's static batch (copy_batch_) and replays. Each sequence has one new
    token, or up to max_seq_tokens, each its own row (expanded: see the module
    doc); the rows follow the sequences' tokens in order. Rows past the
    tokens are padding: input id 0, position 0, slot -1 (writes no KV),
    context length 0 (attention writes zeros), a block table of zeros.
    sample_indices_S has num_rows entries: first the last row of each
    sequence, so logits row i belongs to seqs[i] (the caller keeps the rows it
    samples), then rows len(seqs).. (unread). Padding tokens still pass
    through the MLP/MoE layers.
    """
    check_decode_seqs(seqs, block_size, num_rows=num_rows, max_blocks=max_blocks, max_seq_tokens=max_seq_tokens)
    rows = _Rows(seqs, block_size, max_blocks, expand=True)
    num_tokens = len(rows.input_ids)
    for _ in range(num_rows - num_tokens):
        rows.append_padding()
    last_rows = [end - 1 for end in itertools.accumulate(len(s.token_ids) for s in seqs)]
    return dataclasses.replace(rows.to_batch([*last_rows, *range(len(seqs), num_rows)], device),
                               is_expanded=num_tokens > len(seqs))


def check_decode_seqs(seqs: list[SeqInput], block_size: int, *, num_rows: int, max_blocks: int,
                      max_seq_tokens: int = 1) -> None:
    """Raises ValueError unless seqs fit a decode batch of num_rows rows and max_blocks table columns
    (at most max_seq_tokens new tokens each, a row each, tables long enough for them)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_tokens = sum(len(seq.token_ids) for seq in seqs)
    if num_tokens > num_rows:
        raise ValueError(f"{len(seqs)} sequences of {num_tokens} tokens do not fit a decode batch of "
                         f"{num_rows} rows")
    for seq in seqs:
        if len(seq.token_ids) > max_seq_tokens:
            raise ValueError(f"sequence {seq.seq_id} has {len(seq.token_ids)} new tokens; a decode batch "
                             f"takes {max_seq_tokens}")
        if len(seq.block_table) > max_blocks:
            raise ValueError(f"sequence {seq.seq_id} has {len(seq.block_table)} blocks, more than "
                             f"max_blocks {max_blocks}")
        _check_seq(seq, block_size)


def length_bucket(length: int, per_octave: int, min_step: int) -> int:
    """`length` rounded up to a multiple of 1/per_octave of the power of two at or above it (at
    least min_step): a few shapes (graphs, compiled kernels) serve every length, a length padded
    by at most 2/per_octave."""
    step = max(min_step, (1 << (length - 1).bit_length()) // per_octave)
    return -(-length // step) * step


def length_buckets(first: int, last: int, per_octave: int, min_step: int) -> list[int]:
    """Every bucket length_bucket gives to the lengths first..last, in order (the last at least `last`)."""
    buckets, length = [], max(1, first)
    while length <= last:
        buckets.append(length_bucket(length, per_octave, min_step))
        length = buckets[-1] + 1
    return buckets


def to_device(host: Tensor, device) -> Tensor:
    """A host tensor on `device` without a sync: pinned and non-blocking on CUDA (a plain
    copy from pageable memory would wait for the device); the tensor itself on the CPU."""
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def copy_batch_(dst: ForwardBatch, src: ForwardBatch) -> None:
    """Copies src's device tensors into dst's, in place (a CUDA graph's static inputs).

    The shapes must match (two batches of one bucket); the host fields of dst
    (q_lens, context_lens, max_q_len) stay as they are: graph replays read
    only the device tensors.
    """
    for field in ("input_ids_T", "positions_T", "slot_mapping_T", "block_tables_BM",
                  "sample_indices_S", "context_lens_B", "cu_q_lens_B1"):
        dst_tensor, src_tensor = getattr(dst, field), getattr(src, field)
        if dst_tensor.shape != src_tensor.shape:
            raise ValueError(f"{field} has shape {tuple(src_tensor.shape)}, the static batch "
                             f"{tuple(dst_tensor.shape)}")
        dst_tensor.copy_(src_tensor, non_blocking=True)


class _Rows:
    """The host lists of a batch, built sequence by sequence."""

    def __init__(self, seqs: list[SeqInput], block_size: int, max_blocks: int, *, expand: bool = False):
        """expand: each token its own row (a decode row: q_len 1), as an expanded batch."""
        self.max_blocks = max_blocks
        self.input_ids, self.positions, self.slots = [], [], []
        self.q_lens, self.context_lens, self.block_tables = [], [], []
        for seq in seqs:
            _check_seq(seq, block_size)
            for pos in range(seq.num_computed, seq.num_computed + len(seq.token_ids)):
                self.positions.append(pos)
                self.slots.append(seq.block_table[pos // block_size] * block_size + pos % block_size)
            self.input_ids.extend(seq.token_ids)
            table = [*seq.block_table, *itertools.repeat(0, max_blocks - len(seq.block_table))]
            if expand:
                self.q_lens += [1] * len(seq.token_ids)
                self.context_lens += range(seq.num_computed + 1, seq.num_computed + len(seq.token_ids) + 1)
                self.block_tables += [table] * len(seq.token_ids)
            else:
                self.q_lens.append(len(seq.token_ids))
                self.context_lens.append(seq.num_computed + len(seq.token_ids))
                self.block_tables.append(table)

    @property
    def cu_q_lens(self) -> list[int]:
        return [0, *itertools.accumulate(self.q_lens)]

    def append_padding(self) -> None:
        """One decode row that reads and writes no KV."""
        self.input_ids.append(0)
        self.positions.append(0)
        self.slots.append(-1)
        self.q_lens.append(1)
        self.context_lens.append(0)
        self.block_tables.append([0] * self.max_blocks)

    def to_batch(self, sample_indices: list[int], device) -> ForwardBatch:
        def tensor(values: list[int], dtype=torch.int64) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return ForwardBatch(
            input_ids_T=tensor(self.input_ids),
            positions_T=tensor(self.positions),
            slot_mapping_T=tensor(self.slots),
            q_lens=tuple(self.q_lens),
            context_lens=tuple(self.context_lens),
            block_tables_BM=tensor(self.block_tables, torch.int32).view(len(self.q_lens), self.max_blocks),
            sample_indices_S=tensor(sample_indices),
            context_lens_B=tensor(self.context_lens, torch.int32),
            cu_q_lens_B1=tensor(self.cu_q_lens, torch.int32),
            max_q_len=max(self.q_lens, default=0),
        )


def _check_seq(seq: SeqInput, block_size: int) -> None:
    if not seq.token_ids:
        raise ValueError(f"sequence {seq.seq_id} has no new tokens")
    if seq.num_computed < 0:
        raise ValueError(f"sequence {seq.seq_id} has num_computed {seq.num_computed} < 0")
    needed = -(-(seq.num_computed + len(seq.token_ids)) // block_size)
    if len(seq.block_table) < needed:
        raise ValueError(
            f"sequence {seq.seq_id} has {len(seq.block_table)} blocks, needs {needed} "
            f"for {seq.num_computed + len(seq.token_ids)} tokens"
        )
