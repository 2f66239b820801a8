"""The kernels of qwen3_moe's fused layer loop on CUDA, handed to it as one object per step.

The loop fuses each residual add with the next RMSNorm (norm.add_rms_norm_),
runs one q|k|v matmul and its head norms and rotary (rotary.qkv_norm_rotary),
and the projections through gemv.linear (a GEMV kernel for one token), or, for
a quantized projection (quant.linear.QuantWeight), through quant.dispatch.linear
(its registered kernel, kernels/quant_linear.py). The
object is made for each step from the modules' attributes, so a kernel swapped
on its module (a benchmark's variant) takes effect at the next step.

Legend as in qwen3_moe.py: T tokens, D hidden, X = (H + 2G) * K fused q|k|v columns.
"""

import dataclasses
from collections.abc import Callable

from torch import Tensor

from services.model.kernels import gemv, launch, norm, rotary
from services.model.quant import dispatch
from services.model.quant.linear import QuantWeight


@dataclasses.dataclass(frozen=True, slots=True)
class FusedLayerKernels:
    """add_rms_norm_(x_TD, h_TD, weight_D, eps), qkv_norm_rotary(qkv_TX, q_norm_K, k_norm_K, cos_TK,
    sin_TK, num_heads, num_kv_heads, eps, out=None) and linear(x_TD, w_ND), as the kernel modules define them
    (linear's w_ND dense or a QuantWeight)."""

    add_rms_norm_: Callable[[Tensor, Tensor | None, Tensor, float], Tensor]
    qkv_norm_rotary: Callable[..., tuple[Tensor, Tensor, Tensor]]
    linear: Callable[[Tensor, Tensor | QuantWeight], Tensor]


def _linear(dense: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor | QuantWeight], Tensor]:
    """`dense` for dense weights, quant.dispatch.linear (the registered kernel) for quantized ones."""

    def linear(x_TD: Tensor, w_ND: Tensor | QuantWeight) -> Tensor:
        return dispatch.linear(x_TD, w_ND) if isinstance(w_ND, QuantWeight) else dense(x_TD, w_ND)
    return linear


def fused_layer_kernels() -> FusedLayerKernels | None:
    """The loop's kernels as the modules hold them now, or None while launch.ENABLED is off
    (the torch code on CUDA too)."""
    if not launch.ENABLED:
        return None
    return FusedLayerKernels(norm.add_rms_norm_, rotary.qkv_norm_rotary, _linear(gemv.linear))
