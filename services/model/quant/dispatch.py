"""Which path computes with quantized weights: the kernel registry and `--quantized-kernel`.

Paths: "fp8" (FP8 tensor-core GEMMs: activations quantized on the fly; FP8
checkpoints on GPUs of compute capability 8.9 and above), "weight-only"
(weights dequantized in registers, activations in the compute dtype: AWQ
always, FP8 on older GPUs) and "reference" (the CPU: F.linear on weights
dequantized by formats.py). `auto` picks by format and device. A kernel module
registers its functions with `register_kernel(method, path, fn)`:
kernels/quant_linear.py, imported by `choose_path` the first time it picks a
path on CUDA (it needs triton, which CPU installs lack). A path with no kernel
registered dequantizes on the device instead (slow, but the same results), and
the log line of `choose_path` says so.
"""

import dataclasses
import importlib
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from services.model.quant.linear import QuantWeight

logger = logging.getLogger(__name__)

QUANTIZED_KERNELS = ("auto", "fp8", "weight-only")
FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper have FP8 tensor cores; A100 (8.0) does not

# (method, path) -> fn(x_TK, weight) -> y_TN, added by the kernel modules.
_KERNELS: dict[tuple[str, str], Callable[[Tensor, QuantWeight], Tensor]] = {}
# The module registering the Triton kernels, imported on CUDA only.
KERNEL_MODULE = "services.model.kernels.quant_linear"


def load_kernels() -> str | None:
    """Imports KERNEL_MODULE (registering its kernels); the reason it cannot be, or None."""
    try:
        importlib.import_module(KERNEL_MODULE)
    except ImportError as error:
        return f"{KERNEL_MODULE} cannot be loaded ({error})"
    return None


def register_kernel(method: str, path: str, fn: Callable[[Tensor, QuantWeight], Tensor]) -> None:
    """Makes `fn` compute `method`'s weights on `path` ("fp8" or "weight-only")."""
    if path not in QUANTIZED_KERNELS[1:]:
        raise ValueError(f"quantized kernel path must be one of {list(QUANTIZED_KERNELS[1:])}, got {path!r}")
    _KERNELS[(method, path)] = fn


@dataclasses.dataclass(frozen=True, slots=True)
class QuantPath:
    """The chosen path for one checkpoint format on one device."""

    path: str  # "fp8", "weight-only" or "reference"
    reason: str
    kernel: Callable[[Tensor, QuantWeight], Tensor] | None  # None: F.linear on the dequantized weight
    cache_dense: bool  # keep the dequantized weights (the CPU) or dequantize per call


def choose_path(requested: str, method: str, device: torch.device | str) -> QuantPath:
    """The path for `method` ("fp8"/"awq") weights on `device`; ValueError for a request the
    format or the GPU cannot run (fp8 with AWQ, fp8 below compute capability 8.9)."""
    if requested not in QUANTIZED_KERNELS:
        raise ValueError(f"--quantized-kernel must be one of {list(QUANTIZED_KERNELS)}, got {requested!r}")
    if method == "awq" and requested == "fp8":
        raise ValueError("--quantized-kernel fp8 needs an FP8 checkpoint; this one is AWQ 4-bit (weight-only)")
    device = torch.device(device)
    if device.type != "cuda":
        return QuantPath("reference", f"{device.type}: F.linear on weights dequantized once", None, True)
    capability = torch.cuda.get_device_capability(device)
    has_fp8 = capability >= FP8_MIN_CAPABILITY
    if requested == "fp8" and not has_fp8:
        raise ValueError(f"--quantized-kernel fp8 needs FP8 tensor cores (compute capability >= 8.9), "
                         f"this GPU has {capability[0]}.{capability[1]}: use weight-only")
    if requested != "auto":
        path, reason = requested, "--quantized-kernel " + requested
    elif method == "awq":
        path, reason = "weight-only", "AWQ 4-bit weights are dequantized in the kernel"
    elif has_fp8:
        path, reason = "fp8", (f"compute capability {capability[0]}.{capability[1]} has FP8 tensor cores: FP8 "
                               f"GEMMs for big steps, weight-only GEMVs for small ones")
    else:
        path, reason = "weight-only", (f"compute capability {capability[0]}.{capability[1]} has no FP8 "
                                       f"tensor cores (needs 8.9)")
    missing = load_kernels()
    kernel = _KERNELS.get((method, path))
    if kernel is None:
        reason += f"; no kernel registered{f' ({missing})' if missing else ''}: dequantizing on the GPU per call"
    else:
        reason += f"; kernel {kernel.__module__}.{kernel.__qualname__}"
    return QuantPath(path, reason, kernel, False)


def linear(x: Tensor, weight: Tensor | QuantWeight) -> Tensor:
    """F.linear for a dense or quantized weight: the quantized one's kernel, or F.linear on
    its dequantized weight in x's dtype."""
    if isinstance(weight, Tensor):
        return F.linear(x, weight)
    if weight.kernel is not None:
        return weight.kernel(x, weight)
    return F.linear(x, weight.dense(x.dtype))
