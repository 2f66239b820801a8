"""The quantized linear kernels, registered with quant/dispatch.py's registry (issue 29).

quant/dispatch.choose_path imports this module on CUDA only (it needs triton);
importing it registers:

- ("fp8", "fp8"): quant_fp8.linear's "fp8" kernel: FP8 tensor-core GEMMs with the
  activations quantized per token and 128-channel group for steps of more than
  quant_fp8.WEIGHT_ONLY_MAX_ROWS rows, the weight-only GEMV/GEMM for smaller
  ones (decode reads the weights once; quantizing so few rows costs more than it saves).
- ("fp8", "weight-only"): quant_fp8.linear's weight-only kernels at every size
  (GPUs without FP8 tensor cores read the weights as raw bytes).
- ("awq", "weight-only"): quant_awq.linear, dequantizing in registers.

Each takes x_TK in the compute dtype (rows of any stride, columns contiguous)
and a QuantWeight of one linear; no host reads, shapes alone pick the tiles,
so the calls capture in CUDA graphs.
Legend: T tokens, K in-features, N out-features.
"""

import dataclasses

from torch import Tensor

from services.model.kernels import quant_awq, quant_fp8
from services.model.quant.dispatch import register_kernel
from services.model.quant.linear import QuantWeight


def _rows(x_TK: Tensor) -> Tensor:
    return x_TK if x_TK.stride(-1) == 1 else x_TK.contiguous()


def fp8_tensor_cores(x_TK: Tensor, weight: QuantWeight) -> Tensor:
    """y_TN: FP8 tensor cores above WEIGHT_ONLY_MAX_ROWS rows, weight-only at or below."""
    return quant_fp8.linear(_rows(x_TK), weight.tensors["weight"], weight.tensors["weight_scale_inv"], "fp8")


def fp8_weight_only(x_TK: Tensor, weight: QuantWeight) -> Tensor:
    """y_TN: the float8 weights widened in registers, x as it is."""
    return quant_fp8.linear(_rows(x_TK), weight.tensors["weight"], weight.tensors["weight_scale_inv"],
                            "weight-only")


def awq_weight_only(x_TK: Tensor, weight: QuantWeight) -> Tensor:
    """y_TN: the 4-bit weights dequantized in registers (K steps of at most one group: tiny
    test models have groups below 128)."""
    t = weight.tensors
    tiles = quant_awq.default_tiles(x_TK.shape[0], weight.out_features, weight.in_features)
    tiles = dataclasses.replace(tiles, block_k=min(tiles.block_k, weight.group_size))
    return quant_awq.linear(_rows(x_TK), t["qweight"], t["qzeros"], t["scales"], weight.group_size, tiles)


register_kernel("fp8", "fp8", fp8_tensor_cores)
register_kernel("fp8", "weight-only", fp8_weight_only)
register_kernel("awq", "weight-only", awq_weight_only)
