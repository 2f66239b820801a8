"""MoE gate routing in Triton: softmax top-k from the gate logits, or from x in one kernel.

- route: moe_dispatch.gate's routing from the logits: ids in increasing expert
  order, weights, hit counts, and pos_TE (which k, if any, each token gave each
  expert) for moe_small's kernels.
- gate_route: one token's gate logits (x @ w_gate.T, rounded to the model dtype
  as F.linear rounds them) and route in one kernel: programs over (expert
  block, split of the hidden dim) write fp32 partial sums, the last to finish
  (an atomic count) adds them in a fixed order and routes the token.
- gate_route_rows: the same for each block of GATE_ROUTE_ROWS tokens of a
  bigger step (tl.dot partials over hidden-dim splits), which also counts the
  block's rows per expert for moe_align.align.
- choose_experts: the routing of rows of logits, inside other kernels
  (moe_ep's route_pack).

Legend: T tokens, D hidden, E experts, K experts per token.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from services.model.kernels.gemv import gemv_rows
from services.model.kernels.launch import uses_pdl

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
    them each expert got at counts_ptr (moe_align.align's count of one chunk)."""
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
    """moe_dispatch.gate's routing from the gate logits: (ids_TK in increasing order, weights_TK
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
def _gate_route_kernel(x_ptr, w_ptr, partial_ptr, count_ptr, ids_ptr, weights_ptr, pos_ptr, hits_ptr, hidden,
                       num_experts, NORM: tl.constexpr, TOP_K: tl.constexpr, NUM_SPLITS: tl.constexpr,
                       SPLIT_K: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                       PDL: tl.constexpr):
    g_block, split = tl.program_id(0), tl.program_id(1)
    g = g_block * BLOCK_G + tl.arange(0, BLOCK_G)
    g_mask = g < num_experts
    k_start = split * SPLIT_K
    partial = gemv_rows(x_ptr, w_ptr, hidden, g, g_mask, k_start, tl.minimum(k_start + SPLIT_K, hidden), BLOCK_G,
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
# Picked on an H200 (docs/performance.md): more splits or fewer warps were no faster.
GATE_ROUTE_SPLITS = 8  # splits of the hidden dim: more programs to read w_gate
GATE_ROUTE_EXPERTS = 8  # experts per program
GATE_ROUTE_WARPS = 4  # per program
# Steps of 2 up to this many tokens (the grouped MoE's decode sizes) take gate_route_rows: the
# gate logits and the routing of each block of GATE_ROUTE_ROWS tokens in one kernel, which also
# counts the block's rows per expert for moe_align.align (whose count kernel it replaces). 0:
# F.linear, route and align's own count (3 kernels), e.g. to compare.
GATE_ROUTE_ROWS_MAX_TOKENS = 512
GATE_ROUTE_ROWS = 16  # tokens per block: moe_align.ALIGN_TOKENS, so that the counts are align's
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

