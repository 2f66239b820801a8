"""The quantized kernels' batch-1 GEMV variants, turned on for a whole process (issue 29).

Each variant replaces a default kernel of one format at one row (quant_select.GEMV_VARIANTS):
- "awq-groups": quant_awq_gemv.awq_gemv_groups for AWQ's one-token experts (quant_awq_moe's
  ONE_TOKEN_TILES = GROUPED_TILES) and its one-row linears (quant_awq.ONE_ROW_GEMV = "groups");
- "fp8-pipelined": FP8's one-row GEMVs and one-token experts as cp.async pipelines
  (quant_fp8.GEMV_PIPELINED).
Static estimates favour both (bench/kernels/sass_stats.py); the defaults stay until a GPU measures
them. The knobs are module globals read when a step's kernels launch, so the expert service sets
them once, before the model is built and any CUDA graph is captured.
"""

from services.model.kernels import quant_awq, quant_awq_moe, quant_fp8
from services.model.kernels.quant_select import check_gemv_variants


def use_gemv_variants(names) -> tuple[str, ...]:
    """Turns the named variants on and every other one off; returns the names (ValueError for an unknown one)."""
    names = check_gemv_variants(names)
    awq_groups = "awq-groups" in names
    quant_awq.ONE_ROW_GEMV = "groups" if awq_groups else "nibbles"
    quant_awq_moe.ONE_TOKEN_TILES = quant_awq_moe.GROUPED_TILES if awq_groups else quant_awq_moe.NIBBLE_TILES
    quant_fp8.GEMV_PIPELINED = "fp8-pipelined" in names
    return names
