"""The quantized kernels' batch-1 GEMV variants, turned on for a whole process (issue 29).

Each variant replaces a default kernel of one format at one row (quant_select.GEMV_VARIANTS):
- "awq-nibbles": quant_awq_gemv.awq_gemv_cols for AWQ's one-token experts (quant_awq_moe's
  ONE_TOKEN_TILES = NIBBLE_TILES) and the nibble tiles for its one-row linears
  (quant_awq.ONE_ROW_GEMV = "nibbles"), instead of the grouped GEMV;
- "fp8-pipelined": FP8's one-row GEMVs and one-token experts as cp.async pipelines
  (quant_fp8.GEMV_PIPELINED).
Both were slower than the defaults on an H200 (FP8 pipelined in serving, the nibble GEMV kernel by
kernel; docs/performance.md); they stay for A/B measurements on other GPUs. The knobs are module globals read when a step's kernels launch, so the expert
service sets them once, before the model is built and any CUDA graph is captured.
"""

from services.model.kernels import quant_awq, quant_awq_moe, quant_fp8
from services.model.kernels.quant_select import check_gemv_variants


def use_gemv_variants(names) -> tuple[str, ...]:
    """Turns the named variants on and every other one off; returns the names (ValueError for an unknown one)."""
    names = check_gemv_variants(names)
    awq_nibbles = "awq-nibbles" in names
    quant_awq.ONE_ROW_GEMV = "nibbles" if awq_nibbles else "groups"
    quant_awq_moe.ONE_TOKEN_TILES = quant_awq_moe.NIBBLE_TILES if awq_nibbles else quant_awq_moe.GROUPED_TILES
    quant_fp8.GEMV_PIPELINED = "fp8-pipelined" in names
    return names
