"""Fused Triton kernels for the CUDA decode step: fewer, bigger kernels per layer (issue 8).

Each function has a torch reference in the model code it replaces and mimics
its bf16 roundings (every intermediate the torch code stores in the model
dtype is rounded the same way here), so outputs match to within fp32
reduction order. Used on CUDA only (qwen3_moe.py and moe.py pick them); the
CPU keeps the torch code. All launch grids come from shapes: capturable in a
CUDA graph, no host reads.

- add_rms_norm_: x += h (in place), then y = rms_norm(x) * w: one kernel.
- qkv_norm_rotary: the fused q|k|v projection's output -> per-head RMSNorm of
  q and k, rotary on both, v copied out: one kernel (grid token blocks x heads,
  one token per block in decode steps, up to 16 in prefill).
- linear: F.linear, by gemv for a single token (batch-1 decode), where cuBLAS
  reads the weight at 2-2.7 TB/s (split-K and its reduce for o_proj): one program
  per few output columns reading its rows once on the CUDA cores, fp32 sums
  rounded once, as F.linear.
- gate_route: one token's MoE gate logits (x @ w_gate.T, rounded to the model
  dtype as F.linear rounds them) and route's routing in one kernel: programs over
  (expert block, split of the hidden dim) write fp32 partial sums, the last to
  finish (an atomic count) adds them in a fixed order and routes the token.
- gate_route_rows: the same for each block of 16 tokens of a bigger step (tl.dot partials
  over hidden-dim splits), which also counts the block's rows per expert for
  triton_moe.align.
- fused_moe: the small-batch MoE of one rank holding every expert, bound by
  reading the weights of the experts the step touches, each once. A routing
  kernel (softmax, top-k, renormalise, ids in increasing order, hit counts,
  and pos_TE: which k, if any, each token gave each expert); a gate_up kernel
  with one program per (touched expert in increasing order, column block)
  computing SiLU(gate) * up for every token routed to it (tl.dot, all tokens'
  rows in one tile; the rows not routed there are dropped; one token's on the
  CUDA cores, a little faster at batch 1), which also writes
  the step's expert list for the next kernel; a down kernel with one program
  per (touched expert, output column block) writing each routed row's weighted
  output, the last of them to finish a column block (an atomic count) summing
  each token's K outputs in increasing expert order, as moe.combine does. No
  sort, no permutation, no capacity padding; the grids are the largest the
  step could need (min(T * K, E) experts), the programs of untouched slots exit.
  For one token, gate_route replaces the gate matmul and the routing kernel.
- One token (ONE_TOKEN_MOE_TILES): gate_route, then two kernels reading the token's
  experts straight from ids_1K (no pos scan, no plan, no atomics), both on the CUDA
  cores: gate_up with one program per (column block, k), and down with one program per
  block of output columns over all K experts, summing the K weighted outputs itself in
  increasing expert order (no y_RD round trip, no second pass).
- Single-token steps launch these kernels as programmatic dependent launches (PDL): each
  kernel's programs start while the previous one ends, load weights, and wait on the GPU
  for it before touching activations.

Legend as in qwen3_moe.py / moe.py: T tokens, D hidden, H heads, G KV heads,
K head_dim (top_k in the MoE functions), E experts, F expert width, R = T * top_k.
"""

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# The switch the model code reads (False: the torch code on CUDA too, e.g. to compare).
ENABLED = True
# Steps of at most this many tokens take fused_moe (one rank, CUDA); bigger ones
# triton_moe.grouped_moe (one rank) or moe.py's general path. All read each touched
# expert's weights once; on an H200 (one Qwen3-30B-A3B layer) fused_moe took 0.04 ms
# at one token and 0.205 at 16 (bench/results/moe_small_batch_h200.md), grouped_moe
# 0.272 at 32 against fused_moe's 0.355, and 0.307 at 64 against 0.400
# (bench/results/moe_large_batch_h200.md). Its kernels hold every token's row in one
# tile, so it is not meant for much bigger steps.
MOE_MAX_TOKENS = 16
# Single-token steps (batch-1 decode) take gemv, gate_route and ONE_TOKEN_MOE_TILES; False
# keeps cuBLAS, route and the tl.dot expert kernels for them too (to compare).
SINGLE_TOKEN_KERNELS = True
# qkv_norm_rotary: steps up to this many tokens run one program per (token, head); bigger ones
# give each program a block of up to QKV_MAX_TOKENS_PER_PROGRAM tokens of one head (a 4,096-token
# prefill: 28 us per layer against 120 with one token per program). 32: at a 256-token decode
# step 8 tokens per program took 3.6 us against 8.9 with one (bench/results/decode_variants_h200.md).
QKV_ONE_TOKEN_STEPS = 32
QKV_MAX_TOKENS_PER_PROGRAM = 16
# Single-token steps launch this module's kernels as programmatic dependent launches (PDL; Hopper
# on): each kernel's programs start while the previous kernel finishes, read only weights until
# a grid-dependency wait (the previous kernel done, its writes visible), then let the next
# kernel launch. Every such program waits before it writes or reads activations, so the order
# of the stream holds; ends of kernels overlap. The batch-1 step on an H200: 3.23 ms as plain
# launches, 3.13 with PDL (bench/results/decode_b1_h200_v2.md). False: plain launches.
PDL = True


@functools.cache
def _has_pdl(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def uses_pdl(x: Tensor) -> bool:
    """Whether a kernel reading x launches as a programmatic dependent launch (see PDL)."""
    return PDL and SINGLE_TOKEN_KERNELS and x.is_cuda and x.shape[0] == 1 and _has_pdl(x.device)


@triton.jit
def wait_for_previous_kernel():
    """PDL: waits until the previous kernel on the stream is done (its writes visible), then
    lets the next one launch (its programs wait the same way before reading ours)."""
    gdc_wait()
    gdc_launch_dependents()


@triton.jit
def _add_rms_norm_kernel(x_ptr, h_ptr, w_ptr, y_ptr, dim, eps, HAS_RESIDUAL: tl.constexpr,
                         BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < dim
    w = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
    if PDL:
        wait_for_previous_kernel()
    x = tl.load(x_ptr + t * dim + d, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = add_residual(x_ptr, t * dim + d, mask, x, tl.load(h_ptr + t * dim + d, mask=mask, other=0.0))
    store_rms_norm(y_ptr, t * dim + d, mask, x, w, dim, eps)


@triton.jit
def add_residual(x_ptr, offsets, mask, x, h):
    """x + h rounded to x's dtype (as the torch add), stored back at x_ptr + offsets and returned."""
    x = (x.to(tl.float32) + h.to(tl.float32)).to(x_ptr.dtype.element_ty)
    tl.store(x_ptr + offsets, x, mask=mask)
    return x


@triton.jit
def store_rms_norm(y_ptr, offsets, mask, x, w, dim, eps):
    """Stores layers.rms_norm of one row x (the model dtype, 0 where masked) times w (fp32) at
    y_ptr + offsets, rounding where it rounds."""
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / dim + eps)
    normed = (x32 * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + offsets, (normed * w).to(y_ptr.dtype.element_ty), mask=mask)


def add_rms_norm_(x_TD: Tensor, h_TD: Tensor | None, weight_D: Tensor, eps: float) -> Tensor:
    """x_TD += h_TD in place (skipped for None), then returns rms_norm(x_TD, weight_D, eps)."""
    assert x_TD.is_contiguous() and (h_TD is None or h_TD.is_contiguous())
    y_TD = torch.empty_like(x_TD)
    if x_TD.shape[0]:
        _add_rms_norm_kernel[(x_TD.shape[0],)](
            x_TD, x_TD if h_TD is None else h_TD, weight_D, y_TD, x_TD.shape[1], eps,
            HAS_RESIDUAL=h_TD is not None, BLOCK_D=triton.next_power_of_2(x_TD.shape[1]), PDL=uses_pdl(x_TD),
            num_warps=8, launch_pdl=uses_pdl(x_TD))
    return y_TD


@triton.jit
def _qkv_norm_rotary_kernel(qkv_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, num_tokens,
                            num_heads, num_kv_heads, head_dim, eps, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                            PDL: tl.constexpr):
    if PDL:
        wait_for_previous_kernel()
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    src = qkv_ptr + (t[:, None] * (num_heads + 2 * num_kv_heads) + head) * head_dim  # [BLOCK_T, 1]
    d = tl.arange(0, BLOCK_K)
    mask = (t < num_tokens)[:, None] & (d < head_dim)[None, :]
    if head >= num_heads + num_kv_heads:  # a v head: copied out
        v_head = head - num_heads - num_kv_heads
        tl.store(v_ptr + (t[:, None] * num_kv_heads + v_head) * head_dim + d[None, :],
                 tl.load(src + d[None, :], mask=mask), mask=mask)
    else:
        half = head_dim // 2
        partner = tl.where(d < half, d + half, d - half)
        x = tl.load(src + d[None, :], mask=mask, other=0.0).to(tl.float32)
        x_partner = tl.load(src + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = (1.0 / tl.sqrt(tl.sum(x * x, 1) / head_dim + eps))[:, None]
        is_q = head < num_heads
        d_mask = d < head_dim
        w = tl.where(is_q, tl.load(q_norm_ptr + d, mask=d_mask, other=0.0),
                     tl.load(k_norm_ptr + d, mask=d_mask, other=0.0)).to(tl.float32)[None, :]
        w_partner = tl.where(is_q, tl.load(q_norm_ptr + partner, mask=d_mask, other=0.0),
                             tl.load(k_norm_ptr + partner, mask=d_mask, other=0.0)).to(tl.float32)[None, :]
        dtype = q_ptr.dtype.element_ty
        normed = ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
        normed_partner = ((x_partner * rstd).to(dtype).to(tl.float32) * w_partner).to(dtype).to(tl.float32)
        rotated = tl.where((d < half)[None, :], -normed_partner, normed_partner)
        rope = t[:, None] * head_dim + d[None, :]
        cos = tl.load(cos_ptr + rope, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + rope, mask=mask, other=0.0).to(tl.float32)
        out = ((normed * cos).to(dtype).to(tl.float32) + (rotated * sin).to(dtype).to(tl.float32)).to(dtype)
        if is_q:
            tl.store(q_ptr + (t[:, None] * num_heads + head) * head_dim + d[None, :], out, mask=mask)
        else:
            tl.store(k_ptr + (t[:, None] * num_kv_heads + head - num_heads) * head_dim + d[None, :], out,
                     mask=mask)


def qkv_tokens_per_program(num_tokens: int) -> int:
    """Tokens per qkv_norm_rotary program: 1 up to QKV_ONE_TOKEN_STEPS tokens, then enough for
    about that many token blocks, at most QKV_MAX_TOKENS_PER_PROGRAM (prefill: far fewer,
    bigger programs)."""
    return min(QKV_MAX_TOKENS_PER_PROGRAM, triton.next_power_of_2(triton.cdiv(num_tokens, QKV_ONE_TOKEN_STEPS)))


def qkv_norm_rotary(qkv_TX: Tensor, q_norm_K: Tensor, k_norm_K: Tensor, cos_TK: Tensor, sin_TK: Tensor,
                    num_heads: int, num_kv_heads: int, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """From the fused projection [T, (H + 2G) * K]: q_THK, k_TGK normed per head and rotated, v_TGK."""
    num_tokens, head_dim = qkv_TX.shape[0], q_norm_K.shape[0]
    assert qkv_TX.is_contiguous() and qkv_TX.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
    assert cos_TK.is_contiguous() and sin_TK.is_contiguous()
    q_THK = qkv_TX.new_empty(num_tokens, num_heads, head_dim)
    k_TGK, v_TGK = (qkv_TX.new_empty(num_tokens, num_kv_heads, head_dim) for _ in range(2))
    if num_tokens:
        block_t = qkv_tokens_per_program(num_tokens)
        _qkv_norm_rotary_kernel[(triton.cdiv(num_tokens, block_t), num_heads + 2 * num_kv_heads)](
            qkv_TX, q_norm_K, k_norm_K, cos_TK, sin_TK, q_THK, k_TGK, v_TGK, num_tokens, num_heads, num_kv_heads,
            head_dim, eps, BLOCK_T=block_t, BLOCK_K=triton.next_power_of_2(head_dim), PDL=uses_pdl(qkv_TX),
            launch_pdl=uses_pdl(qkv_TX))
    return q_THK, k_TGK, v_TGK


@triton.jit
def choose_experts(logits, e, num_experts, NORM: tl.constexpr, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr):
    """Each row's routing from its fp32 logits [rows, BLOCK_E] (-inf past num_experts): whether
    each expert is among the row's TOP_K, the fp32 weights (softmax, renormalised over the
    chosen with NORM) and each chosen expert's place k in increasing expert order."""
    mask = (e < num_experts)[None, :]
    p = tl.exp(logits - tl.max(logits, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    work = tl.where(mask, p, -1.0)
    chosen = work < -2.0  # none yet
    for _ in tl.static_range(TOP_K):  # each row's largest left; ties to the lowest expert
        idx = tl.min(tl.where(work == tl.max(work, 1)[:, None], e[None, :], BLOCK_E), 1)
        hit = e[None, :] == idx[:, None]
        chosen = chosen | hit
        work = tl.where(hit, -1.0, work)
    w = p
    if NORM:
        w = p / tl.sum(tl.where(chosen, p, 0.0), 1)[:, None]
    rank = tl.cumsum(chosen.to(tl.int32), 1) - 1
    return chosen, w, rank


@triton.jit
def _route_rows(logits, t, t_mask, e, ids_ptr, weights_ptr, pos_ptr, hits_ptr, counts_ptr, num_experts,
                NORM: tl.constexpr, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, HAS_POS: tl.constexpr,
                HAS_COUNTS: tl.constexpr):
    """Routes tokens t [rows] (where t_mask) from their fp32 logits [rows, BLOCK_E] (-inf past
    num_experts); adds their experts to the hit counts; with HAS_COUNTS stores how many of
    them each expert got at counts_ptr (triton_moe.align's count of one chunk)."""
    e_mask = e < num_experts
    chosen, w, rank = choose_experts(logits, e, num_experts, NORM, TOP_K, BLOCK_E)
    chosen = chosen & t_mask[:, None]
    routed = t[:, None] * TOP_K + rank
    tl.store(ids_ptr + routed, e[None, :].to(ids_ptr.dtype.element_ty), mask=chosen)
    tl.store(weights_ptr + routed, w.to(weights_ptr.dtype.element_ty), mask=chosen)
    if HAS_POS:
        tl.store(pos_ptr + t[:, None] * num_experts + e[None, :], tl.where(chosen, rank + 1, 0).to(
            pos_ptr.dtype.element_ty), mask=t_mask[:, None] & e_mask[None, :])
    per_expert = tl.sum(chosen.to(tl.int32), 0)
    tl.atomic_add(hits_ptr + e, per_expert.to(hits_ptr.dtype.element_ty), mask=per_expert > 0)
    if HAS_COUNTS:
        tl.store(counts_ptr + e, per_expert, mask=e_mask)


@triton.jit
def _route_kernel(logits_ptr, ids_ptr, weights_ptr, pos_ptr, hits_ptr, num_experts, NORM: tl.constexpr,
                  TOP_K: tl.constexpr, BLOCK_E: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)
    e = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + t[:, None] * num_experts + e[None, :], mask=(e < num_experts)[None, :],
                     other=float("-inf")).to(tl.float32)
    _route_rows(logits, t, t >= 0, e, ids_ptr, weights_ptr, pos_ptr, hits_ptr, hits_ptr, num_experts, NORM, TOP_K,
                BLOCK_E, True, False)


def _routing_outputs(num_tokens: int, num_experts: int, top_k: int, weights_dtype: torch.dtype,
                     device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """route's outputs, unfilled: ids_TK, weights_TK, pos_TE."""
    return (torch.empty(num_tokens, top_k, dtype=torch.int64, device=device),
            torch.empty(num_tokens, top_k, dtype=weights_dtype, device=device),
            torch.empty(num_tokens, num_experts, dtype=torch.int8, device=device))


def route(logits_TE: Tensor, top_k: int, norm_topk_prob: bool, hit_counts_E: Tensor,
          weights_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """moe.gate's routing from the gate logits: (ids_TK in increasing order, weights_TK
    in weights_dtype, int8 pos_TE: k + 1 where ids_TK[t, k] = e, else 0); adds each
    token's experts to hit_counts_E."""
    num_tokens, num_experts = logits_TE.shape
    assert logits_TE.is_contiguous() and hit_counts_E.is_contiguous() and top_k < 128
    ids_TK, weights_TK, pos_TE = _routing_outputs(num_tokens, num_experts, top_k, weights_dtype, logits_TE.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](logits_TE, ids_TK, weights_TK, pos_TE, hit_counts_E, num_experts,
                                     NORM=norm_topk_prob, TOP_K=top_k, BLOCK_E=triton.next_power_of_2(num_experts))
    return ids_TK, weights_TK, pos_TE


@triton.jit
def _gemv_rows(x_ptr, w_ptr, in_features, n, n_mask, k_start, k_end, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               NUM_STAGES: tl.constexpr, PDL: tl.constexpr):
    """fp32 [BLOCK_N]: w[n, k_start:k_end] @ x[k_start:k_end] (w rows of in_features), on the
    CUDA cores: one token has nothing for tensor cores to share. PDL: the first step's weights
    are loaded before waiting for the previous kernel (which writes x)."""
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    loop_start = k_start
    if PDL:
        k = k_start + tl.arange(0, BLOCK_K)
        k_mask = k < k_end
        w = tl.load(w_ptr + n[:, None] * in_features + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        wait_for_previous_kernel()
        x = tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
        loop_start = k_start + BLOCK_K
    for k0 in tl.range(loop_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < k_end
        x = tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + n[:, None] * in_features + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    return tl.sum(acc, 1)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, in_features, out_features, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NUM_STAGES: tl.constexpr, PDL: tl.constexpr):
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < out_features
    y = _gemv_rows(x_ptr, w_ptr, in_features, n, n_mask, 0, in_features, BLOCK_N, BLOCK_K, NUM_STAGES, PDL)
    tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


@dataclasses.dataclass(frozen=True, slots=True)
class GemvTiles:
    """Launch shape of gemv."""

    block_n: int  # output columns per program
    block_k: int  # reduction elements per step of its loop
    stages: int
    warps: int


# bench/decode_b1.py's picks on an H200 (bench/results/decode_b1_h200_v2.md; plain launches, us per
# call): GEMV_TILES the least q|k|v + o + gate time, GEMV_TILES_BY_SHAPE each of Qwen3-30B-A3B's
# [N, D] weights' fastest: q|k|v 6.8 against cuBLAS's 7.7, o 6.3 against 8.5 (split-K + reduce), the
# gate logits 2.0 against 4.7 (as PDL launches: 6.4, 5.9, 1.2).
GEMV_TILES = GemvTiles(block_n=4, block_k=512, stages=3, warps=4)
GEMV_TILES_BY_SHAPE = {(5120, 2048): GemvTiles(block_n=8, block_k=512, stages=3, warps=4),
                       (2048, 4096): GemvTiles(block_n=8, block_k=512, stages=5, warps=4),
                       (128, 2048): GemvTiles(block_n=4, block_k=1024, stages=2, warps=4)}


def linear(x_TD: Tensor, w_ND: Tensor) -> Tensor:
    """F.linear(x_TD, w_ND); gemv for single-token steps."""
    if SINGLE_TOKEN_KERNELS and x_TD.shape[0] == 1:
        return gemv(x_TD, w_ND, GEMV_TILES_BY_SHAPE.get(tuple(w_ND.shape), GEMV_TILES))
    return torch.nn.functional.linear(x_TD, w_ND)


def gemv(x_1D: Tensor, w_ND: Tensor, tiles: GemvTiles) -> Tensor:
    """x_1D @ w_ND.T for one token, fp32 sums rounded once to x's dtype as F.linear rounds
    them; one program per tiles.block_n output columns, each reading its rows once."""
    assert x_1D.shape[0] == 1 and x_1D.is_contiguous() and w_ND.is_contiguous() and w_ND.shape[1] == x_1D.shape[1]
    y_1N = x_1D.new_empty(1, w_ND.shape[0])
    _gemv_kernel[(triton.cdiv(w_ND.shape[0], tiles.block_n),)](
        x_1D, w_ND, y_1N, w_ND.shape[1], w_ND.shape[0], BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        NUM_STAGES=tiles.stages, PDL=uses_pdl(x_1D), num_warps=tiles.warps, launch_pdl=uses_pdl(x_1D))
    return y_1N


@triton.jit
def _gate_route_kernel(x_ptr, w_ptr, partial_ptr, count_ptr, ids_ptr, weights_ptr, pos_ptr, hits_ptr, hidden,
                       num_experts, NORM: tl.constexpr, TOP_K: tl.constexpr, NUM_SPLITS: tl.constexpr,
                       SPLIT_K: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                       PDL: tl.constexpr):
    g_block, split = tl.program_id(0), tl.program_id(1)
    g = g_block * BLOCK_G + tl.arange(0, BLOCK_G)
    g_mask = g < num_experts
    k_start = split * SPLIT_K
    partial = _gemv_rows(x_ptr, w_ptr, hidden, g, g_mask, k_start, tl.minimum(k_start + SPLIT_K, hidden), BLOCK_G,
                         BLOCK_K, 1, PDL)
    tl.store(partial_ptr + split * BLOCK_E + g, partial, mask=g_mask)
    # The last program to finish routes: the barrier puts every thread's stores before the
    # (acq_rel, device-scope) count, which the last one sets back to 0 for the next step.
    tl.debug_barrier()
    if tl.atomic_add(count_ptr, 1) == tl.num_programs(0) * NUM_SPLITS - 1:
        tl.store(count_ptr, 0)
        e = tl.arange(0, BLOCK_E)
        e_mask = e < num_experts
        s = tl.arange(0, NUM_SPLITS)
        partial_SE = tl.load(partial_ptr + s[:, None] * BLOCK_E + e[None, :], mask=e_mask[None, :], other=0.0,
                             cache_modifier=".cg")
        logits = tl.sum(partial_SE, 0).to(x_ptr.dtype.element_ty).to(tl.float32)  # rounded as F.linear's
        logits = tl.where(e_mask, logits, float("-inf"))[None, :]
        t = tl.arange(0, 1)
        _route_rows(logits, t, t >= 0, e, ids_ptr, weights_ptr, pos_ptr, hits_ptr, hits_ptr, num_experts, NORM,
                    TOP_K, BLOCK_E, True, False)


# Zeroed int32 counters per device: the programs of gate_route (counter 0) and gate_route_rows
# (one per block of rows) that have finished, which the last of them sets back to 0 (so
# launches on one stream may share them, as in a CUDA graph).
_GATE_ROUTE_COUNTS: dict[torch.device, Tensor] = {}
_GATE_ROUTE_NUM_COUNTS = 4096
# bench/decode_b1.py's pick (H200): 5.0 us against 6.1 for gemv + route, 8.8 for F.linear + route
# (16 splits: 5.0 too; as a PDL launch 4.2). 1 or 2 warps were slower (6.7, 5.9 us).
GATE_ROUTE_SPLITS = 8  # splits of the hidden dim: more programs to read w_gate
GATE_ROUTE_EXPERTS = 8  # experts per program
GATE_ROUTE_WARPS = 4  # per program
# Steps of 2 up to this many tokens (the grouped MoE's decode sizes) take gate_route_rows: the
# gate logits and the routing of each block of GATE_ROUTE_ROWS tokens in one kernel, which also
# counts the block's rows per expert for triton_moe.align (whose count kernel it replaces). 0:
# F.linear, route and align's own count (3 kernels), e.g. to compare.
GATE_ROUTE_ROWS_MAX_TOKENS = 512
GATE_ROUTE_ROWS = 16  # tokens per block: triton_moe.ALIGN_TOKENS, so that the counts are align's
GATE_ROUTE_ROWS_SPLITS = 8  # splits of the hidden dim per block of rows
GATE_ROUTE_ROWS_BLOCK_K = 64
GATE_ROUTE_ROWS_WARPS = 4


def _gate_route_counts(device: torch.device, num_counts: int) -> Tensor:
    """The device's zeroed finish counters (made outside a CUDA graph capture: the first,
    eager, step makes them)."""
    if device not in _GATE_ROUTE_COUNTS:
        _GATE_ROUTE_COUNTS[device] = torch.zeros(_GATE_ROUTE_NUM_COUNTS, dtype=torch.int32, device=device)
    if num_counts > _GATE_ROUTE_NUM_COUNTS:
        raise ValueError(f"gate_route needs {num_counts} counters, has {_GATE_ROUTE_NUM_COUNTS}")
    return _GATE_ROUTE_COUNTS[device]


def gate_route(x_1D: Tensor, w_gate_ED: Tensor, top_k: int, norm_topk_prob: bool,
               hit_counts_E: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """route(F.linear(x_1D, w_gate_ED), ...) for one token in one kernel; the same outputs
    (weights in x's dtype)."""
    hidden, num_experts = x_1D.shape[1], w_gate_ED.shape[0]
    assert x_1D.shape[0] == 1 and x_1D.is_contiguous() and w_gate_ED.is_contiguous() and top_k < 128
    assert hit_counts_E.is_contiguous() and GATE_ROUTE_SPLITS == triton.next_power_of_2(GATE_ROUTE_SPLITS)
    ids_1K, weights_1K, pos_1E = _routing_outputs(1, num_experts, top_k, x_1D.dtype, x_1D.device)
    block_e, split_k = triton.next_power_of_2(num_experts), triton.cdiv(hidden, GATE_ROUTE_SPLITS)
    partial_SE = torch.empty(GATE_ROUTE_SPLITS, block_e, dtype=torch.float32, device=x_1D.device)
    _gate_route_kernel[(triton.cdiv(num_experts, GATE_ROUTE_EXPERTS), GATE_ROUTE_SPLITS)](
        x_1D, w_gate_ED, partial_SE, _gate_route_counts(x_1D.device, 1), ids_1K, weights_1K, pos_1E, hit_counts_E,
        hidden, num_experts, NORM=norm_topk_prob, TOP_K=top_k, NUM_SPLITS=GATE_ROUTE_SPLITS, SPLIT_K=split_k,
        BLOCK_G=GATE_ROUTE_EXPERTS, BLOCK_K=min(512, triton.next_power_of_2(split_k)), BLOCK_E=block_e,
        PDL=uses_pdl(x_1D), num_warps=GATE_ROUTE_WARPS, launch_pdl=uses_pdl(x_1D))
    return ids_1K, weights_1K, pos_1E


@triton.jit
def _gate_route_rows_kernel(x_ptr, w_ptr, partial_ptr, count_ptr, ids_ptr, weights_ptr, hits_ptr, counts_ptr,
                            num_tokens, hidden, num_experts, x_stride, NORM: tl.constexpr, TOP_K: tl.constexpr,
                            NUM_SPLITS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_T: tl.constexpr,
                            BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr):
    block, split = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_T)
    t = block.to(tl.int64) * BLOCK_T + rows
    t_mask = t < num_tokens
    e = tl.arange(0, BLOCK_E)
    e_mask = e < num_experts
    acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    for k0 in range(split * SPLIT_K, (split + 1) * SPLIT_K, BLOCK_K):  # SPLIT_K: a multiple of BLOCK_K
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < hidden
        x = tl.load(x_ptr + t[:, None] * x_stride + k[None, :], mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + e[None, :] * hidden + k[:, None], mask=k_mask[:, None] & e_mask[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision="ieee")
    partial_SRE = partial_ptr + (block * NUM_SPLITS * BLOCK_T + rows[:, None]) * BLOCK_E + e[None, :]
    tl.store(partial_SRE + split * BLOCK_T * BLOCK_E, acc)
    # As in _gate_route_kernel: the last program of the block to finish sums the splits in
    # order and routes the block's rows.
    tl.debug_barrier()
    if tl.atomic_add(count_ptr + block, 1) == NUM_SPLITS - 1:
        tl.store(count_ptr + block, 0)
        logits = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
        for s in tl.static_range(NUM_SPLITS):
            logits += tl.load(partial_SRE + s * BLOCK_T * BLOCK_E, cache_modifier=".cg")
        logits = tl.where(e_mask[None, :], logits.to(x_ptr.dtype.element_ty).to(tl.float32), float("-inf"))
        _route_rows(logits, t, t_mask, e, ids_ptr, weights_ptr, ids_ptr, hits_ptr, counts_ptr + block * num_experts,
                    num_experts, NORM, TOP_K, BLOCK_E, False, True)


def gate_route_rows(x_TD: Tensor, w_gate_ED: Tensor, top_k: int, norm_topk_prob: bool,
                    hit_counts_E: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """route(F.linear(x_TD, w_gate_ED), ...)'s ids_TK and weights_TK (x's dtype) in one kernel,
    and counts_CE: int32 rows of each block of GATE_ROUTE_ROWS tokens routed to each expert.
    Programs over (block of rows, split of the hidden dim) write fp32 partial logits; the last
    of a block to finish adds them in a fixed order, rounds them as F.linear does and routes.
    x_TD's rows may have any stride (its columns contiguous)."""
    (num_tokens, hidden), num_experts = x_TD.shape, w_gate_ED.shape[0]
    assert x_TD.stride(1) == 1 and w_gate_ED.is_contiguous() and hit_counts_E.is_contiguous() and top_k < 128
    ids_TK, weights_TK, _ = _routing_outputs(num_tokens, num_experts, top_k, x_TD.dtype, x_TD.device)
    num_blocks = triton.cdiv(num_tokens, GATE_ROUTE_ROWS)
    counts_CE = torch.empty(num_blocks, num_experts, dtype=torch.int32, device=x_TD.device)
    if num_tokens:
        block_e = max(16, triton.next_power_of_2(num_experts))  # tl.dot's least
        block_k = GATE_ROUTE_ROWS_BLOCK_K
        split_k = triton.cdiv(triton.cdiv(hidden, GATE_ROUTE_ROWS_SPLITS), block_k) * block_k
        partial = torch.empty(num_blocks, GATE_ROUTE_ROWS_SPLITS, GATE_ROUTE_ROWS, block_e, dtype=torch.float32,
                              device=x_TD.device)
        _gate_route_rows_kernel[(num_blocks, GATE_ROUTE_ROWS_SPLITS)](
            x_TD, w_gate_ED, partial, _gate_route_counts(x_TD.device, num_blocks), ids_TK, weights_TK, hit_counts_E,
            counts_CE, num_tokens, hidden, num_experts, x_TD.stride(0), NORM=norm_topk_prob, TOP_K=top_k,
            NUM_SPLITS=GATE_ROUTE_ROWS_SPLITS, SPLIT_K=split_k, BLOCK_T=GATE_ROUTE_ROWS, BLOCK_K=block_k,
            BLOCK_E=block_e, num_warps=GATE_ROUTE_ROWS_WARPS)
    return ids_TK, weights_TK, counts_CE


@triton.jit
def _expert_gate_up_kernel(x_ptr, pos_ptr, w_ptr, act_ptr, experts_ptr, num_used_ptr, done_ptr, num_done,
                           num_tokens, num_experts, HIDDEN: tl.constexpr, WIDTH: tl.constexpr,
                           TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                           BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DONE: tl.constexpr,
                           NUM_STAGES: tl.constexpr, FMA: tl.constexpr):
    f_block, slot = tl.program_id(0), tl.program_id(1)
    t = tl.arange(0, BLOCK_T)
    t_mask = t < num_tokens
    # The step's experts in increasing order: this program's is the slot-th.
    e = tl.arange(0, BLOCK_E)
    pos_TE = tl.load(pos_ptr + t[:, None] * num_experts + e[None, :],
                     mask=t_mask[:, None] & (e < num_experts)[None, :], other=0).to(tl.int32)
    used_E = tl.max(pos_TE, 0) > 0
    num_used = tl.sum(used_E.to(tl.int32), 0)
    expert = tl.sum(tl.where(used_E & (tl.cumsum(used_E.to(tl.int32), 0) == slot + 1), e, 0), 0)
    if slot < num_used:
        if f_block == 0:  # the step's plan for the down kernel: its experts, their count, zeroed counters
            tl.store(experts_ptr + slot, expert)
            if slot == 0:
                tl.store(num_used_ptr, num_used)
                done = tl.arange(0, BLOCK_DONE)
                tl.store(done_ptr + done, tl.zeros([BLOCK_DONE], tl.int32), mask=done < num_done)
        pos_T = tl.load(pos_ptr + t * num_experts + expert, mask=t_mask, other=0).to(tl.int32)
        f = f_block * BLOCK_F + tl.arange(0, BLOCK_F)
        f_mask = f < WIDTH
        w_expert = w_ptr + expert.to(tl.int64) * 2 * WIDTH * HIDDEN
        if FMA:  # one token (BLOCK_T 1): its row of each product on the CUDA cores
            acc_gate = _gemv_rows(x_ptr, w_expert, HIDDEN, f, f_mask, 0, HIDDEN, BLOCK_F, BLOCK_D, NUM_STAGES, False)
            acc_up = _gemv_rows(x_ptr, w_expert + WIDTH * HIDDEN, HIDDEN, f, f_mask, 0, HIDDEN, BLOCK_F, BLOCK_D,
                                NUM_STAGES, False)
            acc_gate, acc_up = acc_gate[None, :], acc_up[None, :]
        else:
            w_gate = w_expert + f[:, None] * HIDDEN
            w_up = w_gate + WIDTH * HIDDEN
            acc_gate = tl.zeros([BLOCK_T, BLOCK_F], tl.float32)
            acc_up = tl.zeros([BLOCK_T, BLOCK_F], tl.float32)
            for d0 in tl.range(0, HIDDEN, BLOCK_D, num_stages=NUM_STAGES):
                d = d0 + tl.arange(0, BLOCK_D)
                d_mask = d < HIDDEN
                # Every token's row: the rows not routed here are computed and dropped.
                x = tl.load(x_ptr + t[:, None] * HIDDEN + d[None, :], mask=t_mask[:, None] & d_mask[None, :],
                            other=0.0)
                m = f_mask[:, None] & d_mask[None, :]
                acc_gate = tl.dot(x, tl.trans(tl.load(w_gate + d[None, :], mask=m, other=0.0)), acc_gate,
                                  input_precision="ieee")
                acc_up = tl.dot(x, tl.trans(tl.load(w_up + d[None, :], mask=m, other=0.0)), acc_up,
                                input_precision="ieee")
        dtype = act_ptr.dtype.element_ty
        gate = acc_gate.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
        row_T = t * TOP_K + pos_T - 1
        tl.store(act_ptr + row_T[:, None] * WIDTH + f[None, :], act.to(dtype),
                 mask=(pos_T > 0)[:, None] & f_mask[None, :])


@triton.jit
def _expert_down_kernel(act_ptr, pos_ptr, weights_ptr, w_ptr, experts_ptr, num_used_ptr, done_ptr, y_ptr, out_ptr,
                        num_tokens, num_experts, HIDDEN: tl.constexpr, WIDTH: tl.constexpr, TOP_K: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_F: tl.constexpr):
    o_block, slot = tl.program_id(0), tl.program_id(1)
    num_used = tl.load(num_used_ptr)
    if slot < num_used:
        expert = tl.load(experts_ptr + slot).to(tl.int64)
        o = o_block * BLOCK_O + tl.arange(0, BLOCK_O)
        o_mask = o < HIDDEN
        t = tl.arange(0, BLOCK_T)
        t_mask = t < num_tokens
        pos_T = tl.load(pos_ptr + t * num_experts + expert, mask=t_mask, other=0).to(tl.int32)
        routed_T = pos_T > 0
        row_T = t * TOP_K + pos_T - 1
        w_down = w_ptr + expert * HIDDEN * WIDTH + o[:, None] * WIDTH
        acc = tl.zeros([BLOCK_T, BLOCK_O], tl.float32)
        for f0 in tl.static_range(0, WIDTH, BLOCK_F):
            f = f0 + tl.arange(0, BLOCK_F)
            f_mask = f < WIDTH
            act = tl.load(act_ptr + row_T[:, None] * WIDTH + f[None, :], mask=routed_T[:, None] & f_mask[None, :],
                          other=0.0)
            w = tl.load(w_down + f[None, :], mask=o_mask[:, None] & f_mask[None, :], other=0.0)
            acc = tl.dot(act, tl.trans(w), acc, input_precision="ieee")
        dtype = out_ptr.dtype.element_ty
        weight_T = tl.load(weights_ptr + row_T, mask=routed_T, other=0.0).to(tl.float32)
        y = (acc.to(dtype).to(tl.float32) * weight_T[:, None]).to(dtype)
        tl.store(y_ptr + row_T[:, None] * HIDDEN + o[None, :], y, mask=routed_T[:, None] & o_mask[None, :])
        # The last of the step's experts to finish this block of columns sums each token's K
        # weighted outputs, in increasing expert order as moe.combine does. The barrier puts
        # every thread's stores before the (acq_rel, device-scope) count.
        tl.debug_barrier()
        if tl.atomic_add(done_ptr + o_block, 1) == num_used - 1:
            total = tl.zeros([BLOCK_T, BLOCK_O], tl.float32)
            for k in tl.static_range(TOP_K):
                total += tl.load(y_ptr + (t * TOP_K + k)[:, None] * HIDDEN + o[None, :],
                                 mask=t_mask[:, None] & o_mask[None, :], other=0.0, cache_modifier=".cg").to(tl.float32)
            tl.store(out_ptr + t[:, None] * HIDDEN + o[None, :], total.to(dtype),
                     mask=t_mask[:, None] & o_mask[None, :])


@triton.jit
def _one_token_gate_up_kernel(x_ptr, ids_ptr, w_ptr, act_ptr, HIDDEN: tl.constexpr, WIDTH: tl.constexpr,
                              BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr, NUM_STAGES: tl.constexpr,
                              PDL: tl.constexpr):
    """act[k, f] = SiLU(gate) * up of the token's k-th expert: gate and up rows f of it in one
    [BLOCK_F, 2, BLOCK_D] tile per step, so both are in flight together. PDL (a programmatic
    dependent launch): waits for gate_route, then lets the down kernel start."""
    f_block, k = tl.program_id(0), tl.program_id(1)
    if PDL:  # gate_route's ids; then the down kernel may launch (ids and weights are final)
        wait_for_previous_kernel()
    expert = tl.load(ids_ptr + k).to(tl.int64)
    f = f_block * BLOCK_F + tl.arange(0, BLOCK_F)
    f_mask = (f < WIDTH)[:, None, None]
    rows = f[:, None] + tl.arange(0, 2)[None, :] * WIDTH  # [BLOCK_F, 2]: the gate row, the up row
    w_rows = w_ptr + expert * 2 * WIDTH * HIDDEN + rows.to(tl.int64)[:, :, None] * HIDDEN
    acc = tl.zeros([BLOCK_F, 2, BLOCK_D], tl.float32)
    for d0 in tl.range(0, HIDDEN, BLOCK_D, num_stages=NUM_STAGES):
        d = d0 + tl.arange(0, BLOCK_D)
        d_mask = d < HIDDEN
        x = tl.load(x_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
        w = tl.load(w_rows + d[None, None, :], mask=f_mask & d_mask[None, None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, None, :]
    dtype = act_ptr.dtype.element_ty
    gate, up = tl.split(tl.sum(acc, 2).to(dtype).to(tl.float32))
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    tl.store(act_ptr + k * WIDTH + f, act.to(dtype), mask=f < WIDTH)


@triton.jit
def _one_token_down_kernel(act_ptr, ids_ptr, weights_ptr, w_ptr, out_ptr, HIDDEN: tl.constexpr,
                           WIDTH: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_O: tl.constexpr,
                           BLOCK_F: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr):
    """out[o] = sum over k of weight_k * (act[k] @ w_down[ids[k], o]) for a block of output
    columns: every expert's rows in one [BLOCK_K, BLOCK_O, BLOCK_F] tile per step, then the
    K outputs rounded, weighted, rounded and summed in fp32 in order k (increasing expert).
    PDL: starts during gate_up (ids are final once it runs) and waits for it before act."""
    o = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)
    o_mask = o < HIDDEN
    k = tl.arange(0, BLOCK_K)
    k_mask = k < TOP_K
    experts = tl.load(ids_ptr + k, mask=k_mask, other=0).to(tl.int64)
    w_rows = w_ptr + (experts[:, None] * HIDDEN + o[None, :]) * WIDTH  # [BLOCK_K, BLOCK_O]
    ko_mask = (k_mask[:, None] & o_mask[None, :])[:, :, None]
    f = tl.arange(0, BLOCK_F)
    w = tl.load(w_rows[:, :, None] + f[None, None, :], mask=ko_mask & (f < WIDTH)[None, None, :], other=0.0)
    if PDL:  # the first step's weights are on their way: now wait for gate_up's act
        wait_for_previous_kernel()
    act = tl.load(act_ptr + k[:, None] * WIDTH + f[None, :], mask=k_mask[:, None] & (f < WIDTH)[None, :], other=0.0)
    acc = w.to(tl.float32) * act.to(tl.float32)[:, None, :]
    for f0 in tl.range(BLOCK_F, WIDTH, BLOCK_F, num_stages=NUM_STAGES):
        f = f0 + tl.arange(0, BLOCK_F)
        f_mask = f < WIDTH
        act = tl.load(act_ptr + k[:, None] * WIDTH + f[None, :], mask=k_mask[:, None] & f_mask[None, :], other=0.0)
        w = tl.load(w_rows[:, :, None] + f[None, None, :], mask=ko_mask & f_mask[None, None, :], other=0.0)
        acc += w.to(tl.float32) * act.to(tl.float32)[:, None, :]
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
    y = (tl.sum(acc, 2).to(dtype).to(tl.float32) * weight[:, None]).to(dtype).to(tl.float32)  # [BLOCK_K, BLOCK_O]
    total = tl.zeros([BLOCK_O], tl.float32)
    for kk in tl.static_range(TOP_K):  # in order, as moe.combine sums (picking row kk adds only zeros)
        total += tl.sum(tl.where(k[:, None] == kk, y, 0.0), 0)
    tl.store(out_ptr + o, total.to(dtype), mask=o_mask)


@dataclasses.dataclass(frozen=True, slots=True)
class MoeTiles:
    """Launch shape of the two expert kernels (see fused_moe)."""

    gate_up_f: int  # gate|up columns per program (BLOCK_F)
    gate_up_d: int  # hidden elements per step of its reduction loop (BLOCK_D)
    gate_up_stages: int
    gate_up_warps: int
    down_o: int  # output columns per program (BLOCK_O)
    down_f: int  # width elements per unrolled step of its reduction (BLOCK_F)
    down_warps: int
    gate_up_fma: bool = False  # one token only: its products on the CUDA cores (no tl.dot)
    # One token only: the ids-indexed kernels (_one_token_*: no pos scan, no atomics, down
    # summing its K outputs itself), down_stages their reduction's pipeline depth.
    one_token: bool = False
    down_stages: int = 1


# The first one-token tiles (FMA gate_up, tl.dot down): 32.8 us a layer on an H200 against 33.1
# with the tl.dot gate_up (bench/results/decode_b1_h200.md); bench/decode_b1.py's "before".
FMA_MOE_TILES = MoeTiles(gate_up_f=4, gate_up_d=1024, gate_up_stages=1, gate_up_warps=4, down_o=32, down_f=128,
                         down_warps=4, gate_up_fma=True)
# One token's tiles: the _one_token_* kernels, bench/decode_b1.py's pick on an H200 (device time per
# layer: gate_up 13.7 us against the FMA one's 15.3, down 9.0 against 11.0; fused_moe 29.2 us a
# layer against 32.8 in a CUDA graph, plain launches; bench/results/decode_b1_h200_v2.md).
ONE_TOKEN_MOE_TILES = MoeTiles(gate_up_f=2, gate_up_d=2048, gate_up_stages=1, gate_up_warps=4, down_o=4, down_f=64,
                               down_warps=4, one_token=True, down_stages=4)


def moe_tiles(num_tokens: int) -> MoeTiles:
    """The tiles fused_moe launches for a step of num_tokens tokens: the fastest of
    bench/moe_small_batch.py's sweep on an H200 at 1, 4, 16 and 64 tokens (Qwen3-30B-A3B
    shape; bench/results/moe_small_batch_h200.md), each used from its token count up."""
    if num_tokens == 1 and SINGLE_TOKEN_KERNELS:
        return ONE_TOKEN_MOE_TILES
    if num_tokens < 16:
        return MoeTiles(gate_up_f=32, gate_up_d=256, gate_up_stages=4, gate_up_warps=4,
                        down_o=32, down_f=128, down_warps=4)
    if num_tokens < 64:
        return MoeTiles(gate_up_f=64, gate_up_d=128, gate_up_stages=3, gate_up_warps=4,
                        down_o=32, down_f=128, down_warps=4)
    return MoeTiles(gate_up_f=32, gate_up_d=128, gate_up_stages=4, gate_up_warps=4,
                    down_o=64, down_f=128, down_warps=4)


def fused_moe(x_TD: Tensor, w_gate_ED: Tensor, w_gate_up_EGD: Tensor, w_down_EDF: Tensor, top_k: int,
              norm_topk_prob: bool, hit_counts_E: Tensor) -> Tensor:
    """MoELayer on one rank holding every expert (expert e in slot e) for steps of up to
    MOE_MAX_TOKENS tokens: gate, experts and combine in a matmul and three kernels (one
    token: gate_route and two); adds the routed experts to hit_counts_E."""
    return fused_moe_tiled(x_TD, w_gate_ED, w_gate_up_EGD, w_down_EDF, top_k, norm_topk_prob, hit_counts_E,
                           moe_tiles(x_TD.shape[0]))


def fused_moe_tiled(x_TD: Tensor, w_gate_ED: Tensor, w_gate_up_EGD: Tensor, w_down_EDF: Tensor, top_k: int,
                    norm_topk_prob: bool, hit_counts_E: Tensor, tiles: MoeTiles) -> Tensor:
    """fused_moe with the given tiles (for the benchmark's sweep)."""
    assert x_TD.is_contiguous() and w_gate_up_EGD.is_contiguous() and w_down_EDF.is_contiguous()
    assert x_TD.shape[0] <= 128, "every token's row sits in one tile: fused_moe is for small steps"
    assert x_TD.shape[0] == 1 or not (tiles.gate_up_fma or tiles.one_token), "these tiles take one token"
    num_tokens, hidden = x_TD.shape
    num_experts, width = w_gate_ED.shape[0], w_down_EDF.shape[2]
    if SINGLE_TOKEN_KERNELS and num_tokens == 1:
        ids_TK, weights_TK, pos_TE = gate_route(x_TD, w_gate_ED, top_k, norm_topk_prob, hit_counts_E)
    else:
        logits_TE = torch.nn.functional.linear(x_TD, w_gate_ED)
        ids_TK, weights_TK, pos_TE = route(logits_TE, top_k, norm_topk_prob, hit_counts_E, x_TD.dtype)
    if tiles.one_token:
        return one_token_experts(x_TD, ids_TK, weights_TK, w_gate_up_EGD, w_down_EDF, tiles)
    out_TD = torch.empty_like(x_TD)
    if not num_tokens:
        return out_TD
    num_slots = min(num_tokens * top_k, num_experts)  # the most experts a step can touch
    num_o_blocks = triton.cdiv(hidden, tiles.down_o)
    experts_S = torch.empty(num_slots, dtype=torch.int32, device=x_TD.device)
    num_used_1 = torch.empty(1, dtype=torch.int32, device=x_TD.device)
    done_O = torch.empty(num_o_blocks, dtype=torch.int32, device=x_TD.device)
    act_RF = x_TD.new_empty(num_tokens * top_k, width)
    y_RD = x_TD.new_empty(num_tokens * top_k, hidden)
    shapes = dict(HIDDEN=hidden, WIDTH=width, TOP_K=top_k, BLOCK_T=triton.next_power_of_2(num_tokens))
    _expert_gate_up_kernel[(triton.cdiv(width, tiles.gate_up_f), num_slots)](
        x_TD, pos_TE, w_gate_up_EGD, act_RF, experts_S, num_used_1, done_O, num_o_blocks, num_tokens, num_experts,
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_F=tiles.gate_up_f, BLOCK_D=tiles.gate_up_d,
        BLOCK_DONE=triton.next_power_of_2(num_o_blocks), NUM_STAGES=tiles.gate_up_stages, FMA=tiles.gate_up_fma,
        num_warps=tiles.gate_up_warps, **shapes)
    _expert_down_kernel[(num_o_blocks, num_slots)](
        act_RF, pos_TE, weights_TK, w_down_EDF, experts_S, num_used_1, done_O, y_RD, out_TD, num_tokens,
        num_experts, BLOCK_O=tiles.down_o, BLOCK_F=tiles.down_f, num_warps=tiles.down_warps, **shapes)
    return out_TD


def one_token_experts(x_1D: Tensor, ids_1K: Tensor, weights_1K: Tensor, w_gate_up_EGD: Tensor, w_down_EDF: Tensor,
                      tiles: MoeTiles) -> Tensor:
    """One token's MoE output from its routing (ids_1K in increasing expert order, as
    route gives them, weights_1K): the two _one_token_* kernels with tiles."""
    return one_token_down(one_token_gate_up(x_1D, ids_1K, w_gate_up_EGD, tiles), ids_1K, weights_1K, w_down_EDF,
                          tiles)


def one_token_gate_up(x_1D: Tensor, ids_1K: Tensor, w_gate_up_EGD: Tensor, tiles: MoeTiles) -> Tensor:
    """act_KF: SiLU(gate) * up of x_1D through each of its K experts, rounded as moe.experts rounds."""
    hidden, (top_k, width) = x_1D.shape[1], (ids_1K.shape[1], w_gate_up_EGD.shape[1] // 2)
    assert x_1D.shape[0] == 1 and x_1D.is_contiguous() and ids_1K.is_contiguous() and w_gate_up_EGD.is_contiguous()
    act_KF = x_1D.new_empty(top_k, width)
    _one_token_gate_up_kernel[(triton.cdiv(width, tiles.gate_up_f), top_k)](
        x_1D, ids_1K, w_gate_up_EGD, act_KF, HIDDEN=hidden, WIDTH=width, BLOCK_F=tiles.gate_up_f,
        BLOCK_D=tiles.gate_up_d, NUM_STAGES=tiles.gate_up_stages, PDL=uses_pdl(x_1D), num_warps=tiles.gate_up_warps,
        launch_pdl=uses_pdl(x_1D))
    return act_KF


def one_token_down(act_KF: Tensor, ids_1K: Tensor, weights_1K: Tensor, w_down_EDF: Tensor, tiles: MoeTiles) -> Tensor:
    """out_1D: the K experts' down projections of act_KF, weighted and summed as moe.combine does."""
    (top_k, width), hidden = act_KF.shape, w_down_EDF.shape[1]
    assert act_KF.is_contiguous() and weights_1K.is_contiguous() and w_down_EDF.is_contiguous()
    out_1D = act_KF.new_empty(1, hidden)
    _one_token_down_kernel[(triton.cdiv(hidden, tiles.down_o),)](
        act_KF, ids_1K, weights_1K, w_down_EDF, out_1D, HIDDEN=hidden, WIDTH=width, TOP_K=top_k,
        BLOCK_K=triton.next_power_of_2(top_k), BLOCK_O=tiles.down_o, BLOCK_F=tiles.down_f,
        NUM_STAGES=tiles.down_stages, PDL=uses_pdl(ids_1K), num_warps=tiles.down_warps, launch_pdl=uses_pdl(ids_1K))
    return out_1D
