"""Reading quantized linears from safetensors for checkpoint.py: which stored tensors a
linear has, and the checks that refuse a broken one with an error naming the tensor.

A linear is FP8 exactly when `weight_scale_inv` is beside its `weight`; it is
AWQ when its `qweight` is there (and it is not in modules_to_not_convert,
which must be stored unquantized). Checks beyond the shapes and dtypes:
scales must be finite and positive (both formats' scales are magnitudes), and
a weight or qweight must not be all zeros (AWQ loaders that silently read
nothing produce exactly that, and the model then writes nonsense).
"""

from collections.abc import Container

import torch

from services.model.quant.formats import AWQ_PACK, QuantConfig, fp8_scale_shape
from services.model.quant.linear import QuantWeight

# Stored layout of one quantized linear: tensor name -> (shape, accepted safetensors dtypes).
Layout = dict[str, tuple[tuple[int, ...], tuple[str, ...]]]
_FP8_DTYPES = ("F8_E4M3",)


def stored_layout(name: str, shape: tuple[int, ...], present: Container[str],
                  quant: QuantConfig | None) -> Layout | None:
    """The stored tensors of linear weight `name` ([N, K], ending in `.weight`) if the
    checkpoint quantizes it, else None (read `name` as a plain tensor). CheckpointError-worthy
    problems raise ValueError naming the tensor."""
    if quant is None or len(shape) != 2 or not name.endswith(".weight"):
        return None
    module = name[: -len(".weight")]
    (n, k) = shape
    if module + ".weight_scale_inv" in present:
        return {name: ((n, k), _FP8_DTYPES), module + ".weight_scale_inv": (fp8_scale_shape(n, k), ("F32", "BF16"))}
    if quant.method != "awq" or module + ".qweight" not in present:
        return None
    if not quant.converts(module):
        raise ValueError(f"tensor {module + '.qweight'!r} is quantized, but {module!r} is in the checkpoint's "
                         f"modules_to_not_convert {list(quant.modules_to_not_convert)}")
    missing = [module + s for s in (".qzeros", ".scales") if module + s not in present]
    if missing:
        raise ValueError(f"tensor {module + '.qweight'!r} has no {missing[0]!r} beside it (a missing scale)")
    g = quant.group_size
    if k % g or n % AWQ_PACK:
        raise ValueError(f"tensor {module + '.qweight'!r}: the weight [{n}, {k}] does not fit AWQ groups of {g} "
                         f"in-features and packs of {AWQ_PACK} out-features")
    return {module + ".qweight": ((k, n // AWQ_PACK), ("I32",)),
            module + ".qzeros": ((k // g, n // AWQ_PACK), ("I32",)),
            module + ".scales": ((k // g, n), ("F16",))}


def check_stored(name: str, tensor: torch.Tensor) -> None:
    """ValueError naming the tensor if a stored quantized tensor is broken."""
    if name.endswith((".weight_scale_inv", ".scales")):
        bad = ~torch.isfinite(tensor.float()) | (tensor.float() <= 0)
        if bad.any():
            value = tensor.flatten()[bad.flatten().nonzero()[0, 0]].item()
            raise ValueError(f"tensor {name!r} has {int(bad.sum())} scale(s) that are zero, negative, NaN "
                             f"or Inf (first {value}); a scale must be finite and positive")
    elif name.endswith((".qweight", ".weight")):
        # One byte max pass for both checks: all zeros, and (e4m3fn, which has no Inf) a NaN, whose
        # bytes 0x7F and 0xFF are the largest as int8 and as uint8 (a byte mask is some 40 times slower).
        largest = tensor.view(torch.uint8).max()
        if largest == 0:
            raise ValueError(f"tensor {name!r} is all zeros (a broken quantization or conversion)")
        if tensor.dtype == torch.float8_e4m3fn and (largest == 0xFF or tensor.view(torch.int8).max() == 0x7F):
            nan = (tensor.view(torch.uint8) & 0x7F) == 0x7F
            raise ValueError(f"tensor {name!r} has {int(nan.sum())} NaN value(s) (first at flat index "
                             f"{int(nan.flatten().nonzero()[0, 0])}; a broken quantization or conversion)")


def quant_weight(name: str, layout: Layout, tensors: dict[str, torch.Tensor], quant: QuantConfig,
                 shape: tuple[int, int]) -> QuantWeight:
    """The QuantWeight of linear `name` from its stored tensors (already checked)."""
    module = name[: -len(".weight")]
    if module + ".weight_scale_inv" in layout:
        stored = {"weight": tensors[name], "weight_scale_inv": tensors[module + ".weight_scale_inv"].float()}
        return QuantWeight("fp8", stored, *shape)
    stored = {key: tensors[f"{module}.{key}"] for key in ("qweight", "qzeros", "scales")}
    return QuantWeight("awq", stored, *shape, group_size=quant.group_size)


def is_dense_only(name: str) -> bool:
    """Weights that serving keeps unquantized whatever the checkpoint holds: the gate (a
    quantized router picks other experts), the embeddings and the LM head."""
    return name.endswith(("mlp.gate.weight", "embed_tokens.weight")) or name == "lm_head.weight"
