"""The small building blocks of a Qwen3-MoE layer: RMSNorm, rotary, the SwiGLU MLP.

Legend: T tokens, D hidden, H heads, K head_dim, F MLP width.
"""

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from services.model.quant.dispatch import linear
from services.model.quant.linear import QuantWeight


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension, computed in fp32 and scaled in x's dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    # Cast back before scaling, as the reference does: matters in bf16.
    return weight * normed.to(x.dtype)


@dataclasses.dataclass(frozen=True, slots=True)
class AddNorm:
    """A residual add and the RMSNorm after it, handed to a feed-forward by the fused layer
    loop (CUDA), which may fuse them into its last kernel: add_norm(out_TD) adds out_TD into
    x_TD in place and returns rms_norm(x_TD, weight_D, eps), the next layer's input, by
    add_rms_norm_ (kernels/norm.py's add_rms_norm_: one kernel)."""

    x_TD: Tensor
    weight_D: Tensor
    eps: float
    add_rms_norm_: Callable[[Tensor, Tensor, Tensor, float], Tensor]

    def __call__(self, out_TD: Tensor) -> Tensor:
        return self.add_rms_norm_(self.x_TD, out_TD, self.weight_D, self.eps)


def swiglu_mlp(x_TD: Tensor, w_gate_FD: Tensor | QuantWeight, w_up_FD: Tensor | QuantWeight,
               w_down_DF: Tensor | QuantWeight) -> Tensor:
    """The dense feed-forward: down(silu(gate(x)) * up(x)); quantized weights through quant.dispatch."""
    return linear(F.silu(linear(x_TD, w_gate_FD)) * linear(x_TD, w_up_FD), w_down_DF)


class RotaryEmbedding:
    """Default RoPE (no scaling) over the whole head_dim, rotating its two halves."""

    def __init__(self, head_dim: int, theta: float, device):
        if head_dim % 2:
            raise ValueError(f"rotary needs an even head_dim, got {head_dim}")
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
        self.inv_freq = 1.0 / (theta ** exponents)

    def cos_sin(self, positions_T: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin for each position, [T, K], in the model dtype."""
        # Angles in fp32: positions reach tens of thousands, beyond bf16's precision.
        freqs = positions_T.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x_THK: Tensor, cos_TK: Tensor, sin_TK: Tensor) -> Tensor:
    """Rotates each head of x by its token's angles."""
    cos, sin = cos_TK[:, None, :], sin_TK[:, None, :]
    half = x_THK.shape[-1] // 2
    rotated = torch.cat((-x_THK[..., half:], x_THK[..., :half]), dim=-1)
    return x_THK * cos + rotated * sin
