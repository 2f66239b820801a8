"""Which kernels run an FP8 checkpoint on a GPU: `--quantized-kernel auto|fp8|weight-only` (issue 29).

FP8 tensor cores (tl.dot on float8 operands) need compute capability 8.9 or
higher (Ada, Hopper). Older GPUs (A100: 8.0) run FP8 checkpoints through the
weight-only kernels instead: the float8 weights are widened in registers and
the products run on bf16 (or the CUDA cores), the activations unquantized.
Triton refuses the float8e4nv type itself below 8.9 (even a pointer to it),
so there the weight-only kernels read the weights as raw bytes (a uint8 view)
and decode them (quant_fp8.native_fp8). AWQ checkpoints always run weight-only.

Free of triton and torch, so the configuration and its log can use it anywhere.
"""

QUANTIZED_KERNELS = ("auto", "fp8", "weight-only")
# Batch-1 GEMV variants an expert service may run instead of the default kernels (--quant-gemv-variants;
# quant_variants.use_gemv_variants): "awq-nibbles", AWQ's nibble GEMV (quant_awq_gemv.awq_gemv_cols, the
# default before the grouped one) for the one-token experts and the one-row linears; "fp8-pipelined", FP8's
# one-row GEMVs as cp.async pipelines.
GEMV_VARIANTS = ("awq-nibbles", "fp8-pipelined")
FP8_TENSOR_CORES = (8, 9)  # the first compute capability with float8 tensor-core products


def select_quant_kernel(capability: tuple[int, int] | None, requested: str) -> tuple[str, str]:
    """("fp8" or "weight-only", the reason for the log) for a GPU of `capability` (None: no GPU,
    where the CPU's dequantizing reference path runs the weight-only way)."""
    if requested not in QUANTIZED_KERNELS:
        raise ValueError(f"--quantized-kernel must be one of {', '.join(QUANTIZED_KERNELS)}, not {requested!r}")
    if capability is None:
        if requested == "fp8":
            raise ValueError("--quantized-kernel fp8 needs a CUDA GPU with FP8 tensor cores; there is none here")
        return "weight-only", "no CUDA device: the dequantizing reference path"
    has_fp8 = tuple(capability) >= FP8_TENSOR_CORES
    name = f"{capability[0]}.{capability[1]}"
    if requested == "weight-only":
        return "weight-only", f"--quantized-kernel weight-only (compute capability {name})"
    if requested == "fp8":
        if not has_fp8:
            raise ValueError(f"--quantized-kernel fp8 needs FP8 tensor cores (compute capability 8.9 or higher); "
                             f"this GPU is {name}: use auto or weight-only")
        return "fp8", f"--quantized-kernel fp8 (compute capability {name} has FP8 tensor cores)"
    if has_fp8:
        return "fp8", (f"auto: compute capability {name} has FP8 tensor cores (FP8 GEMMs for big steps, "
                       "weight-only GEMVs for small ones)")
    return "weight-only", (f"auto: compute capability {name} has no FP8 tensor cores (8.9 or higher): "
                           "FP8 weights are widened in registers")


def check_gemv_variants(names) -> tuple[str, ...]:
    """names as a tuple, if each is one of GEMV_VARIANTS (ValueError naming the others if not)."""
    names = tuple(names)
    unknown = [n for n in names if n not in GEMV_VARIANTS]
    if unknown:
        raise ValueError(f"--quant-gemv-variants takes {', '.join(GEMV_VARIANTS)}; not {', '.join(unknown)}")
    return names
