"""Residual add and RMSNorm in Triton: add_rms_norm_, and the row helpers other kernels fuse.

add_rms_norm_(x, h, w): x += h in place, then rms_norm(x) * w, in one kernel,
rounding where layers.rms_norm rounds (the fused layer loop's residual adds).
add_residual and store_rms_norm are the same steps for one row inside another
kernel (the grouped MoE's combine, the symmetric exchange's sum).

Legend as in qwen3_moe.py: T tokens, D hidden.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from services.model.kernels.launch import uses_pdl, wait_for_previous_kernel


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
