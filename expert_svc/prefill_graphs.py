"""Steps with prompt tokens as piecewise CUDA graphs: the work between two attentions, captured per token bucket.

A step that carries prompt tokens (prompt chunks, whole prompts, the decodes beside them)
cannot be captured whole: its attention depends on every sequence's lengths and cached
context, which change every step. Run eagerly, its host launches some 25 kernels a layer,
and in serving the device waits for them (docs/performance.md, goodput). The rest of a
layer works row by row on the step's T tokens (norms, projections, routing and experts,
residual adds), so it depends on T alone and can be captured per T. Legend: B rows of a
bucket, T real rows, R rows of the largest bucket, L layers.

- Pieces: piece 0 embeds the tokens, takes their rotary angles and begins layer 0 (its
  input norm and q, k, v: Qwen3MoeModel.begin_layers); piece i + 1 finishes layer i from
  its attention output (output projection, feed-forward) and begins layer i + 1
  (end_layer); the last leaves the final residual stream. Between pieces, layer i's
  attention runs eagerly on the step's real rows and its own batch (lengths, block
  tables, whole prompts), reading q, k, v from and writing o into static buffers. The
  final norm and the LM head of the sampled rows run eagerly after the last piece.
- Buckets: a step of T tokens (more than EAGER_MAX_TOKENS) runs the pieces of the
  smallest bucket B >= T (`prefill_buckets`: `per_octave` lengths to a power of two, at
  least `min_step` apart, so at most 2/per_octave more rows), padded with rows of token
  0 at position 0 whose attention output is zero. Rows never mix in the pieces, so the padding changes
  no real row.
- Static buffers: one set for the largest bucket (token ids, positions, residual stream,
  rotary angles, q, k, v, o); bucket B uses their first B rows, so memory does not grow
  with the number of buckets. The pieces' intermediates share one graph memory pool.
- Captured before serving (`capture_all`, on the model thread): each bucket's pieces run
  once eagerly on padding rows (kernels compiled, the padding row's expert hits probed),
  then are captured, the largest bucket first. The pieces never touch the KV cache (the
  attention between them does), so capturing needs no sequences.
- Hit counts: padding rows are routed like any token and all compute the same, so each
  bucket's padding row's hits, probed once, are taken back out (B - T) times a step.
- One rank only: an expert-parallel group's pieces would hold its collectives.

`capture` is injectable as in graph_runner.py: on the CPU, tests pass a stand-in that returns
the function itself, so the buckets, padding, buffers and hits run without CUDA.
"""

import logging
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from expert_svc.graph_runner import Capture, cuda_capture
from services.kv_pool import KVPool
from services.model.batch import ForwardBatch, length_buckets
from services.model.qwen3_moe import fused_kernels

log = logging.getLogger("expert_svc")

# Steps of up to this many tokens run eagerly: small steps take other kernels than a bucket's rows
# would (one-token GEMVs, the fused small-batch MoE, the quantized weight-only paths of up to 16
# rows, where FP8 weights otherwise go through FP8 tensor cores with quantized activations), and
# their launches are few; most of them replay the decode graphs anyway.
EAGER_MAX_TOKENS = 16


def prefill_buckets(max_tokens: int, per_octave: int = 16, min_step: int = 64) -> tuple[int, ...]:
    """The token buckets up to max_tokens (the last at least max_tokens), ascending: batch.length_bucket's,
    as whole prompts' attention lengths are bucketed."""
    if max_tokens <= 0 or per_octave <= 0 or min_step <= 0:
        raise ValueError(f"max_tokens, per_octave and min_step must be positive, got {max_tokens}, "
                         f"{per_octave}, {min_step}")
    return tuple(length_buckets(1, max_tokens, per_octave, min_step))


def make_prefill_graph_runner(model, max_tokens: int, per_octave: int = 16) -> "PrefillGraphRunner | None":
    """The rank's prefill graph runner with every bucket captured, or None: max_tokens 0, not
    CUDA, the fused layer loop off, more than one rank, spare expert slots (their MoE path
    splits on the host), or a capture that failed (logged; those steps then run eagerly)."""
    if not max_tokens:
        return None
    device = torch.device(model.device)
    fused = fused_kernels(device)
    why = ("not on CUDA" if device.type != "cuda" else "the fused layer loop is off" if fused is None
           else "more than one rank" if model.comm.world_size > 1
           else "spare expert slots" if model.num_spare_expert_slots else None)
    if why:
        log.info("steps with prompt tokens run eagerly (no prefill graphs): %s", why)
        return None
    runner = PrefillGraphRunner(model, fused, prefill_buckets(max_tokens, per_octave),
                                cuda_capture(torch.cuda.graph_pool_handle()))
    start = time.perf_counter()
    try:
        runner.capture_all()
    except (RuntimeError, torch.cuda.OutOfMemoryError) as error:
        log.warning("prefill graphs not captured, steps with prompt tokens run eagerly: %s", error)
        return None
    log.info("prefill graphs captured: %d buckets (%d..%d tokens), %d graphs, in %.1f s", len(runner.buckets),
             runner.buckets[0], runner.buckets[-1], runner.num_captures, time.perf_counter() - start)
    return runner


class PrefillGraphRunner:
    """Runs a rank's steps of up to max(buckets) tokens through captured pieces (module doc)."""

    def __init__(self, model, fused, buckets: Sequence[int], capture: Capture):
        if not buckets or min(buckets) <= 0:
            raise ValueError(f"buckets must be positive token counts, got {list(buckets)}")
        if model.comm.world_size != 1:
            raise ValueError("prefill graphs take one rank only")
        self.model, self.fused = model, fused
        self.buckets = tuple(sorted(set(buckets)))
        self._capture = capture
        c, rows = model.config, self.buckets[-1]
        empty = dict(dtype=model.dtype, device=model.device)
        self._ids_R = torch.zeros(rows, dtype=torch.int64, device=model.device)
        self._positions_R = torch.zeros(rows, dtype=torch.int64, device=model.device)
        self._x_RD = torch.zeros(rows, c.hidden_size, **empty)
        self._cos_RK, self._sin_RK = (torch.zeros(rows, c.head_dim, **empty) for _ in range(2))
        self._q_RHK = torch.zeros(rows, c.num_attention_heads, c.head_dim, **empty)
        self._k_RGK, self._v_RGK = (torch.zeros(rows, c.num_key_value_heads, c.head_dim, **empty) for _ in range(2))
        self._o_RHK = torch.zeros_like(self._q_RHK)
        self._replays: dict[int, list[Callable[[], None]]] = {}
        self._pad_hits: dict[int, Tensor] = {}  # [moe layers, E] hits of one padding row
        self.num_captures = self.num_replays = 0

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest bucket holding num_tokens rows (at least one), None if none does."""
        return next((b for b in self.buckets if b >= max(num_tokens, 1)), None)

    def fits(self, num_tokens: int) -> bool:
        """Whether a step of num_tokens tokens runs here: more than EAGER_MAX_TOKENS, its bucket captured."""
        bucket = self.bucket(num_tokens)
        return num_tokens > EAGER_MAX_TOKENS and bucket is not None and bucket in self._replays

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Every bucket's pieces, largest first: run once eagerly on padding rows (the padding
        row's hits probed, the model's hit counts left as they were), then captured."""
        for bucket in reversed(self.buckets):
            self._set_padding(0, bucket)
            hits_LE = self.model.hit_counts_LE.clone()
            probe_LE = torch.zeros_like(hits_LE)
            for piece in self._pieces(bucket, probe_LE):  # no attention: o as _set_padding left it
                piece()
            self.model.hit_counts_LE.copy_(hits_LE)
            self._pad_hits[bucket] = probe_LE
            self._replays[bucket] = [self._capture(piece) for piece in self._pieces(bucket)]
            self.num_captures += len(self._replays[bucket])

    @torch.inference_mode()
    def run(self, batch: ForwardBatch, kv: KVPool) -> Tensor:
        """One step (fits() must hold): its fp32 logits of the sampled rows, as
        Qwen3MoeModel.forward_at_capacity gives them."""
        model, num_tokens = self.model, batch.num_tokens
        bucket = self.bucket(num_tokens)
        replays = self._replays[bucket]
        self._ids_R[:num_tokens].copy_(batch.input_ids_T)
        self._positions_R[:num_tokens].copy_(batch.positions_T)
        self._set_padding(num_tokens, bucket)
        q_k_v = (self._q_RHK[:num_tokens], self._k_RGK[:num_tokens], self._v_RGK[:num_tokens])
        o_THK, scale = self._o_RHK[:num_tokens], model.config.head_dim ** -0.5
        replays[0]()
        for i, replay in enumerate(replays[1:]):
            model.attention.forward(i, *q_k_v, batch, kv, scale, out=o_THK)
            replay()
        self.num_replays += 1
        if bucket > num_tokens:
            model.hit_counts_LE.sub_(self._pad_hits[bucket], alpha=bucket - num_tokens)
        return model.logits(model.final_norm(self._x_RD[:num_tokens], batch.sample_indices_S))

    def _set_padding(self, num_tokens: int, bucket: int) -> None:
        """Rows num_tokens..bucket: token 0 at position 0, attention output zero."""
        if bucket > num_tokens:
            for buffer in (self._ids_R, self._positions_R, self._o_RHK):
                buffer[num_tokens:bucket].zero_()

    def _pieces(self, bucket: int, last_row_hits_LE: Tensor | None = None) -> list[Callable[[], None]]:
        """The bucket's L + 1 pieces over the static buffers' first `bucket` rows."""
        model, fused = self.model, self.fused
        x_BD, cos_BK, sin_BK, o_BHK = (t[:bucket] for t in (self._x_RD, self._cos_RK, self._sin_RK, self._o_RHK))
        q_k_v = (self._q_RHK[:bucket], self._k_RGK[:bucket], self._v_RGK[:bucket])
        capacity = model.dispatch_capacity(bucket)

        def begin() -> None:
            torch.index_select(model.embed_VD, 0, self._ids_R[:bucket], out=x_BD)
            cos_BK[:], sin_BK[:] = model.rotary.cos_sin(self._positions_R[:bucket], model.dtype)
            model.begin_layers(fused, x_BD, cos_BK, sin_BK, out=q_k_v)

        def end(i: int) -> Callable[[], None]:
            return lambda: model.end_layer(fused, i, o_BHK, x_BD, cos_BK, sin_BK, capacity, last_row_hits_LE,
                                           out=q_k_v)

        return [begin] + [end(i) for i in range(len(model.layers))]
