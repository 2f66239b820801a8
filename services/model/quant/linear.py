"""What a model keeps of a quantized projection: its stored layout (formats.py), nothing converted.

QuantWeight is one linear's weight, or a stack of them with a leading slot
dimension (one MoE layer's local experts, spares included). Its tensors are
exactly the checkpoint's (FP8: weight [.., N, K] float8_e4m3fn and
weight_scale_inv [.., ceil(N/128), ceil(K/128)] fp32; AWQ: qweight [.., K, N/8],
qzeros [.., K/G, N/8], scales [.., K/G, N]), so a kernel reads them as they
are. `dense` is the reference path's weight, dequantized: cached when
`cache_dense` (the CPU), else computed on every call (CUDA without a kernel:
the weights stay at their quantized size).
Legend: Q slots, N out-features, K in-features.
"""

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch import Tensor

from services.model.quant.formats import (FP8_BLOCK, QuantConfig, awq_dequantize, awq_quantize, fp8_dequantize,
                                          fp8_quantize)

# The stored tensors of each format, under their checkpoint suffixes.
LAYOUT_KEYS = {"fp8": ("weight", "weight_scale_inv"), "awq": ("qweight", "qzeros", "scales")}


def is_projection(name: str) -> bool:
    """Whether hub weight `name` is a projection a quantized checkpoint quantizes (attention's
    q/k/v/o and the MLPs' and experts' gate/up/down; never the router gate, the embeddings,
    the norms or the LM head)."""
    return name.endswith("_proj.weight")


@dataclasses.dataclass(slots=True, eq=False)
class QuantWeight:
    """A quantized linear weight (or a stack of them) in its checkpoint layout."""

    method: str  # "fp8" or "awq"
    tensors: dict[str, Tensor]  # LAYOUT_KEYS[method] -> stored tensor
    out_features: int  # N of one linear
    in_features: int  # K of one linear
    group_size: int = 0  # AWQ's G
    # The compute path's kernel, (x_TK, self) -> y_TN, or None: F.linear on `dense` (dispatch.py).
    kernel: Callable[[Tensor, "QuantWeight"], Tensor] | None = None
    # The compute path (dispatch.QuantPath.path): "fp8", "weight-only" or "reference"; the expert
    # kernels read it to pick their GEMMs.
    path: str = "reference"
    cache_dense: bool = False
    _dense: Tensor | None = None

    def __post_init__(self) -> None:
        assert set(self.tensors) == set(LAYOUT_KEYS[self.method]), (self.method, sorted(self.tensors))

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors.values())).device

    @property
    def lead_shape(self) -> tuple[int, ...]:
        """The stack's leading dimensions (() for one linear)."""
        first = self.tensors[LAYOUT_KEYS[self.method][0]]
        return tuple(first.shape[:-2])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight(s), [..., N, K], computed now."""
        t = self.tensors
        if self.method == "fp8":
            return fp8_dequantize(t["weight"], t["weight_scale_inv"], dtype)
        return awq_dequantize(t["qweight"], t["qzeros"], t["scales"], self.group_size, dtype)

    def dense(self, dtype: torch.dtype) -> Tensor:
        """The reference path's weight: dequantized, cached if cache_dense."""
        if not self.cache_dense:
            return self.dequantize(dtype)
        if self._dense is None or self._dense.dtype != dtype:
            self._dense = self.dequantize(dtype)
        return self._dense

    def to(self, device: torch.device | str) -> "QuantWeight":
        """The same layout on `device` (self if already there)."""
        if self.device == torch.device(device):
            return self
        return dataclasses.replace(self, tensors={k: v.to(device) for k, v in self.tensors.items()}, _dense=None)

    def copy_slot_(self, slot: int, one: "QuantWeight") -> None:
        """Copies one linear's layout into slot `slot` of this stack, in place (shapes never
        change, so captured CUDA graphs stay valid); the cached dense slot too."""
        assert (one.method, one.out_features, one.in_features) == (self.method, self.out_features, self.in_features)
        for key, tensor in self.tensors.items():
            tensor[slot].copy_(one.tensors[key])
        if self._dense is not None:
            self._dense[slot].copy_(one.dequantize(self._dense.dtype))

    @classmethod
    def stack(cls, weights: Sequence["QuantWeight"], num_spare: int = 0) -> "QuantWeight":
        """One stack [len(weights) + num_spare, ...] of linears of one shape, spares zero."""
        first = weights[0]
        assert all((w.method, w.out_features, w.in_features, w.group_size)
                   == (first.method, first.out_features, first.in_features, first.group_size) for w in weights)
        tensors = {}
        for key in LAYOUT_KEYS[first.method]:
            stacked = torch.stack([w.tensors[key] for w in weights])
            if num_spare:
                stacked = torch.cat((stacked, stacked.new_zeros(num_spare, *stacked.shape[1:])))
            tensors[key] = stacked
        return dataclasses.replace(first, tensors=tensors, _dense=None)

    @classmethod
    def quantize(cls, w_NK: Tensor, quant: QuantConfig) -> "QuantWeight":
        """A [N, K] weight quantized into `quant`'s layout (on w's device)."""
        n, k = w_NK.shape
        if quant.method == "fp8":
            weight, scale_inv = fp8_quantize(w_NK)
            return cls("fp8", {"weight": weight, "weight_scale_inv": scale_inv}, n, k)
        qweight, qzeros, scales = awq_quantize(w_NK, quant.group_size)
        return cls("awq", {"qweight": qweight, "qzeros": qzeros, "scales": scales}, n, k,
                   group_size=quant.group_size)

    @classmethod
    def concat_outputs(cls, parts: Sequence["QuantWeight"]) -> "QuantWeight | None":
        """One linear computing the parts' outputs side by side (q|k|v: one kernel launch
        instead of three), or None where the layouts do not allow it: FP8 needs every part
        but the last to end on a 128-row block boundary (a partial block's scale covers
        only its own rows); AWQ always concatenates along the output columns (each part's
        width is a multiple of 8). Exactly the parts' weights: the stored tensors side by side."""
        first = parts[0]
        if any(p.lead_shape or (p.method, p.in_features, p.group_size) != (first.method, first.in_features,
                                                                           first.group_size) for p in parts):
            return None
        if first.method == "fp8":
            if any(p.out_features % FP8_BLOCK for p in parts[:-1]):
                return None
            tensors = {key: torch.cat([p.tensors[key] for p in parts], dim=-2) for key in LAYOUT_KEYS["fp8"]}
        else:
            tensors = {key: torch.cat([p.tensors[key] for p in parts], dim=-1) for key in LAYOUT_KEYS["awq"]}
        return dataclasses.replace(first, tensors=tensors, out_features=sum(p.out_features for p in parts),
                                   _dense=None)

    def hub_tensors(self, name: str) -> dict[str, Tensor]:
        """The checkpoint's tensors of linear weight `name` (`X.weight`): X.weight and
        X.weight_scale_inv (FP8), or X.qweight, X.qzeros, X.scales (AWQ)."""
        module = name[: -len(".weight")]
        return {f"{module}.{key}": tensor for key, tensor in self.tensors.items()}

    def num_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


class Dequantized(Mapping):
    """A weights mapping (hub name -> Tensor | QuantWeight) with each QuantWeight read as its
    dequantized weight (fp32): the dense twin of a quantized model, e.g. of random weights that
    have no checkpoint to dequantize (routing.py's agreement, bench/accuracy/hf_parity.py)."""

    def __init__(self, weights: Mapping[str, Tensor | QuantWeight]):
        self._weights = weights

    def __getitem__(self, name: str) -> Tensor:
        weight = self._weights[name]
        return weight.dequantize(torch.float32) if isinstance(weight, QuantWeight) else weight

    def __iter__(self) -> Iterator[str]:
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)
