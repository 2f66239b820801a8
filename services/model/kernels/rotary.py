"""Qwen3's q/k head norms and rotary in Triton: the fused q|k|v projection's output in, q, k, v out.

qkv_norm_rotary: per-head RMSNorm of q and k, rotary on both, v copied out: one
kernel (grid token blocks x heads, one token per program in decode steps, up to
QKV_MAX_TOKENS_PER_PROGRAM in prefill), rounding as qwen3_moe.py's torch code.

Legend as in qwen3_moe.py: T tokens, H heads, G KV heads, K head_dim.
"""

import triton
import triton.language as tl
from torch import Tensor

from services.model.kernels.launch import uses_pdl, wait_for_previous_kernel

# qkv_norm_rotary: steps up to this many tokens run one program per (token, head); bigger ones
# give each program a block of up to QKV_MAX_TOKENS_PER_PROGRAM tokens of one head: far fewer,
# bigger programs, faster for prefill and for big decode steps alike.
QKV_ONE_TOKEN_STEPS = 32
QKV_MAX_TOKENS_PER_PROGRAM = 16


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
                    num_heads: int, num_kv_heads: int, eps: float,
                    out: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """From the fused projection [T, (H + 2G) * K]: q_THK, k_TGK normed per head and rotated, v_TGK
    (into `out`'s contiguous tensors of those shapes if given)."""
    num_tokens, head_dim = qkv_TX.shape[0], q_norm_K.shape[0]
    assert qkv_TX.is_contiguous() and qkv_TX.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
    assert cos_TK.is_contiguous() and sin_TK.is_contiguous()
    if out is None:
        q_THK = qkv_TX.new_empty(num_tokens, num_heads, head_dim)
        k_TGK, v_TGK = (qkv_TX.new_empty(num_tokens, num_kv_heads, head_dim) for _ in range(2))
    else:
        q_THK, k_TGK, v_TGK = out
        assert q_THK.shape == (num_tokens, num_heads, head_dim) and all(
            x.shape == (num_tokens, num_kv_heads, head_dim) for x in (k_TGK, v_TGK))
        assert all(x.is_contiguous() and x.dtype == qkv_TX.dtype for x in out)
    if num_tokens:
        block_t = qkv_tokens_per_program(num_tokens)
        _qkv_norm_rotary_kernel[(triton.cdiv(num_tokens, block_t), num_heads + 2 * num_kv_heads)](
            qkv_TX, q_norm_K, k_norm_K, cos_TK, sin_TK, q_THK, k_TGK, v_TGK, num_tokens, num_heads, num_kv_heads,
            head_dim, eps, BLOCK_T=block_t, BLOCK_K=triton.next_power_of_2(head_dim), PDL=uses_pdl(qkv_TX),
            launch_pdl=uses_pdl(qkv_TX))
    return q_THK, k_TGK, v_TGK
