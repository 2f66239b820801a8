"""Fused Triton kernels for the CUDA decode step: fewer, bigger kernels per layer (issue 8).

Each function has a torch reference in the model code it replaces and mimics
its bf16 roundings (every intermediate the torch code stores in the model
dtype is rounded the same way here), so outputs match to within fp32
reduction order. Used on CUDA only (qwen3_moe.py and moe.py pick them); the
CPU keeps the torch code. All launch grids come from shapes: capturable in a
CUDA graph, no host reads.

- add_rms_norm_: x += h (in place), then y = rms_norm(x) * w: one kernel.
- qkv_norm_rotary: the fused q|k|v projection's output -> per-head RMSNorm of
  q and k, rotary on both, v copied out: one kernel (grid tokens x heads).
- fused_moe: the small-batch MoE of one rank holding every expert. A routing
  kernel (softmax, top-k, renormalise, ids in increasing order, hit counts),
  a gate_up kernel (SiLU(gate) * up) reading each routed row's expert weights
  directly (no sort, no permutation, no capacity padding), and a down kernel
  summing each token's K weighted outputs in increasing expert order, as
  moe.combine does. Each routed row reads its own expert's weights, so it
  only pays off while T * K is small (MOE_MAX_TOKENS).

Legend as in qwen3_moe.py / moe.py: T tokens, D hidden, H heads, G KV heads,
K head_dim (top_k in the MoE functions), E experts, F expert width, R = T * top_k.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

# The switch the model code reads (False: the torch code on CUDA too, e.g. to compare).
ENABLED = True
# Steps of at most this many tokens take fused_moe (one rank, CUDA); bigger ones the
# grouped GEMMs, which read each expert's weights once however many rows it has. On an
# H200 (Qwen3-30B-A3B, bench/results/decode_fused_h200.md) fused_moe won up to 16
# tokens, tied at 32 and lost at 64.
MOE_MAX_TOKENS = 16


@triton.jit
def _add_rms_norm_kernel(x_ptr, h_ptr, w_ptr, y_ptr, dim, eps, HAS_RESIDUAL: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < dim
    x = tl.load(x_ptr + t * dim + d, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        h = tl.load(h_ptr + t * dim + d, mask=mask, other=0.0)
        x = (x.to(tl.float32) + h.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + t * dim + d, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / dim + eps)
    normed = (x32 * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * dim + d, (normed * w).to(y_ptr.dtype.element_ty), mask=mask)


def add_rms_norm_(x_TD: Tensor, h_TD: Tensor | None, weight_D: Tensor, eps: float) -> Tensor:
    """x_TD += h_TD in place (skipped for None), then returns rms_norm(x_TD, weight_D, eps)."""
    assert x_TD.is_contiguous() and (h_TD is None or h_TD.is_contiguous())
    y_TD = torch.empty_like(x_TD)
    if x_TD.shape[0]:
        _add_rms_norm_kernel[(x_TD.shape[0],)](
            x_TD, x_TD if h_TD is None else h_TD, weight_D, y_TD, x_TD.shape[1], eps,
            HAS_RESIDUAL=h_TD is not None, BLOCK_D=triton.next_power_of_2(x_TD.shape[1]), num_warps=8)
    return y_TD


@triton.jit
def _qkv_norm_rotary_kernel(qkv_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr,
                            num_heads, num_kv_heads, head_dim, eps, BLOCK_K: tl.constexpr):
    t, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    src = qkv_ptr + (t * (num_heads + 2 * num_kv_heads) + head) * head_dim
    d = tl.arange(0, BLOCK_K)
    mask = d < head_dim
    if head >= num_heads + num_kv_heads:  # a v head: copied out
        v_head = head - num_heads - num_kv_heads
        tl.store(v_ptr + (t * num_kv_heads + v_head) * head_dim + d, tl.load(src + d, mask=mask), mask=mask)
    else:
        half = head_dim // 2
        partner = tl.where(d < half, d + half, d - half)
        x = tl.load(src + d, mask=mask, other=0.0).to(tl.float32)
        x_partner = tl.load(src + partner, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / head_dim + eps)
        is_q = head < num_heads
        w = tl.where(is_q, tl.load(q_norm_ptr + d, mask=mask, other=0.0),
                     tl.load(k_norm_ptr + d, mask=mask, other=0.0)).to(tl.float32)
        w_partner = tl.where(is_q, tl.load(q_norm_ptr + partner, mask=mask, other=0.0),
                             tl.load(k_norm_ptr + partner, mask=mask, other=0.0)).to(tl.float32)
        dtype = q_ptr.dtype.element_ty
        normed = ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
        normed_partner = ((x_partner * rstd).to(dtype).to(tl.float32) * w_partner).to(dtype).to(tl.float32)
        rotated = tl.where(d < half, -normed_partner, normed_partner)
        cos = tl.load(cos_ptr + t * head_dim + d, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + t * head_dim + d, mask=mask, other=0.0).to(tl.float32)
        out = ((normed * cos).to(dtype).to(tl.float32) + (rotated * sin).to(dtype).to(tl.float32)).to(dtype)
        if is_q:
            tl.store(q_ptr + (t * num_heads + head) * head_dim + d, out, mask=mask)
        else:
            tl.store(k_ptr + (t * num_kv_heads + head - num_heads) * head_dim + d, out, mask=mask)


def qkv_norm_rotary(qkv_TX: Tensor, q_norm_K: Tensor, k_norm_K: Tensor, cos_TK: Tensor, sin_TK: Tensor,
                    num_heads: int, num_kv_heads: int, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """From the fused projection [T, (H + 2G) * K]: q_THK, k_TGK normed per head and rotated, v_TGK."""
    num_tokens, head_dim = qkv_TX.shape[0], q_norm_K.shape[0]
    assert qkv_TX.is_contiguous() and qkv_TX.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
    assert cos_TK.is_contiguous() and sin_TK.is_contiguous()
    q_THK = qkv_TX.new_empty(num_tokens, num_heads, head_dim)
    k_TGK, v_TGK = (qkv_TX.new_empty(num_tokens, num_kv_heads, head_dim) for _ in range(2))
    if num_tokens:
        _qkv_norm_rotary_kernel[(num_tokens, num_heads + 2 * num_kv_heads)](
            qkv_TX, q_norm_K, k_norm_K, cos_TK, sin_TK, q_THK, k_TGK, v_TGK, num_heads, num_kv_heads,
            head_dim, eps, BLOCK_K=triton.next_power_of_2(head_dim))
    return q_THK, k_TGK, v_TGK


@triton.jit
def _route_kernel(logits_ptr, ids_ptr, weights_ptr, hits_ptr, num_experts, NORM: tl.constexpr,
                  TOP_K: tl.constexpr, BLOCK_E: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    mask = e < num_experts
    logits = tl.load(logits_ptr + t * num_experts + e, mask=mask, other=float("-inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, 0))
    p = p / tl.sum(p, 0)
    work = tl.where(mask, p, -1.0)
    chosen = e < 0
    for _ in tl.static_range(TOP_K):  # the largest left; ties to the lowest expert
        idx = tl.min(tl.where(work == tl.max(work, 0), e, BLOCK_E), 0)
        chosen = chosen | (e == idx)
        work = tl.where(e == idx, -1.0, work)
    w = p
    if NORM:
        w = p / tl.sum(tl.where(chosen, p, 0.0), 0)
    rank = tl.cumsum(chosen.to(tl.int32), 0) - 1  # the chosen experts in increasing order
    tl.store(ids_ptr + t * TOP_K + rank, e.to(ids_ptr.dtype.element_ty), mask=chosen)
    tl.store(weights_ptr + t * TOP_K + rank, w.to(weights_ptr.dtype.element_ty), mask=chosen)
    tl.atomic_add(hits_ptr + e, chosen.to(hits_ptr.dtype.element_ty), mask=chosen)


def route(logits_TE: Tensor, top_k: int, norm_topk_prob: bool, hit_counts_E: Tensor,
          weights_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """moe.gate's routing from the gate logits: (ids_TK in increasing order, weights_TK
    in weights_dtype); adds each token's experts to hit_counts_E."""
    num_tokens, num_experts = logits_TE.shape
    assert logits_TE.is_contiguous() and hit_counts_E.is_contiguous()
    ids_TK = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits_TE.device)
    weights_TK = torch.empty(num_tokens, top_k, dtype=weights_dtype, device=logits_TE.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](logits_TE, ids_TK, weights_TK, hit_counts_E, num_experts,
                                     NORM=norm_topk_prob, TOP_K=top_k, BLOCK_E=triton.next_power_of_2(num_experts))
    return ids_TK, weights_TK


@triton.jit
def _expert_gate_up_kernel(x_ptr, ids_ptr, w_ptr, act_ptr, hidden, width, TOP_K: tl.constexpr,
                           BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr):
    r, f_block = tl.program_id(0).to(tl.int64), tl.program_id(1)
    expert = tl.load(ids_ptr + r).to(tl.int64)
    f = f_block * BLOCK_F + tl.arange(0, BLOCK_F)
    f_mask = f < width
    w_gate = w_ptr + expert * 2 * width * hidden + f[:, None] * hidden
    w_up = w_gate + width * hidden
    acc_gate = tl.zeros([BLOCK_F, BLOCK_D], tl.float32)
    acc_up = tl.zeros([BLOCK_F, BLOCK_D], tl.float32)
    for d0 in range(0, hidden, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_mask = d < hidden
        x = tl.load(x_ptr + (r // TOP_K) * hidden + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        m = f_mask[:, None] & d_mask[None, :]
        acc_gate += tl.load(w_gate + d[None, :], mask=m, other=0.0).to(tl.float32) * x
        acc_up += tl.load(w_up + d[None, :], mask=m, other=0.0).to(tl.float32) * x
    dtype = act_ptr.dtype.element_ty
    gate = tl.sum(acc_gate, 1).to(dtype).to(tl.float32)
    up = tl.sum(acc_up, 1).to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    tl.store(act_ptr + r * width + f, act.to(dtype), mask=f_mask)


@triton.jit
def _expert_down_kernel(act_ptr, ids_ptr, weights_ptr, w_ptr, out_ptr, hidden, width, TOP_K: tl.constexpr,
                        BLOCK_O: tl.constexpr, BLOCK_F: tl.constexpr):
    t, o_block = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o = o_block * BLOCK_O + tl.arange(0, BLOCK_O)
    o_mask = o < hidden
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_O], tl.float32)
    for k in tl.static_range(TOP_K):  # increasing expert order, as moe.combine sums
        r = t * TOP_K + k
        expert = tl.load(ids_ptr + r).to(tl.int64)
        w_down = w_ptr + expert * hidden * width + o[:, None] * width
        acc = tl.zeros([BLOCK_O, BLOCK_F], tl.float32)
        for f0 in range(0, width, BLOCK_F):
            f = f0 + tl.arange(0, BLOCK_F)
            f_mask = f < width
            act = tl.load(act_ptr + r * width + f, mask=f_mask, other=0.0).to(tl.float32)[None, :]
            acc += tl.load(w_down + f[None, :], mask=o_mask[:, None] & f_mask[None, :], other=0.0).to(tl.float32) * act
        y = tl.sum(acc, 1).to(dtype).to(tl.float32)
        total += (y * tl.load(weights_ptr + r).to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(out_ptr + t * hidden + o, total.to(dtype), mask=o_mask)


def fused_moe(x_TD: Tensor, w_gate_ED: Tensor, w_gate_up_EGD: Tensor, w_down_EDF: Tensor, top_k: int,
              norm_topk_prob: bool, hit_counts_E: Tensor) -> Tensor:
    """MoELayer on one rank holding every expert (expert e in slot e): gate, experts
    and combine in one matmul and three kernels; adds the routed experts to hit_counts_E."""
    assert x_TD.is_contiguous() and w_gate_up_EGD.is_contiguous() and w_down_EDF.is_contiguous()
    num_tokens, hidden = x_TD.shape
    width = w_down_EDF.shape[2]
    logits_TE = torch.nn.functional.linear(x_TD, w_gate_ED)
    ids_TK, weights_TK = route(logits_TE, top_k, norm_topk_prob, hit_counts_E, x_TD.dtype)
    out_TD = torch.empty_like(x_TD)
    if not num_tokens:
        return out_TD
    act_RF = x_TD.new_empty(num_tokens * top_k, width)
    block_f, block_d = 16, 128
    _expert_gate_up_kernel[(num_tokens * top_k, triton.cdiv(width, block_f))](
        x_TD, ids_TK, w_gate_up_EGD, act_RF, hidden, width, TOP_K=top_k, BLOCK_F=block_f, BLOCK_D=block_d)
    block_o, block_w = 16, 128
    _expert_down_kernel[(num_tokens, triton.cdiv(hidden, block_o))](
        act_RF, ids_TK, weights_TK, w_down_EDF, out_TD, hidden, width, TOP_K=top_k,
        BLOCK_O=block_o, BLOCK_F=block_w)
    return out_TD
