"""The kernels of qwen3_moe's fused layer loop on CUDA, handed to it as one object per step.

The loop fuses each residual add with the next RMSNorm (norm.add_rms_norm_),
runs one q|k|v matmul and its head norms and rotary (rotary.qkv_norm_rotary),
and the projections through gemv.linear (a GEMV kernel for one token). The
object is made for each step from the modules' attributes, so a kernel swapped
on its module (a benchmark's variant) takes effect at the next step.

Legend as in qwen3_moe.py: T tokens, D hidden, X = (H + 2G) * K fused q|k|v columns.
"""

import dataclasses
from collections.abc import Callable

from torch import Tensor

from services.model.kernels import gemv, launch, norm, rotary


@dataclasses.dataclass(frozen=True, slots=True)
class FusedLayerKernels:
    """add_rms_norm_(x_TD, h_TD, weight_D, eps), qkv_norm_rotary(qkv_TX, q_norm_K, k_norm_K, cos_TK,
    sin_TK, num_heads, num_kv_heads, eps) and linear(x_TD, w_ND), as the kernel modules define them."""

    add_rms_norm_: Callable[[Tensor, Tensor | None, Tensor, float], Tensor]
    qkv_norm_rotary: Callable[..., tuple[Tensor, Tensor, Tensor]]
    linear: Callable[[Tensor, Tensor], Tensor]


def fused_layer_kernels() -> FusedLayerKernels | None:
    """The loop's kernels as the modules hold them now, or None while launch.ENABLED is off
    (the torch code on CUDA too)."""
    if not launch.ENABLED:
        return None
    return FusedLayerKernels(norm.add_rms_norm_, rotary.qkv_norm_rotary, gemv.linear)
