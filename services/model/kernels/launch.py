"""What every Triton kernel family of the model shares: the master switch, and programmatic
dependent launches (PDL) for single-token steps.

The model code (qwen3_moe.py's layer loop, the MoE backends) reads ENABLED at
call time; single-token steps (batch-1 decode) launch the kernels of norm.py,
rotary.py, gemv.py, routing.py, moe_small.py and the attention decode as PDL
launches where the GPU has them (uses_pdl): each kernel's programs start while
the previous kernel finishes, load only weights until wait_for_previous_kernel,
then let the next kernel launch.
"""

import functools

import torch
import triton
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# The switch the model code reads (False: the torch code on CUDA too, e.g. to compare).
ENABLED = True
# Single-token steps (batch-1 decode) take gemv, gate_route and moe_small.ONE_TOKEN_MOE_TILES;
# False keeps cuBLAS, route and the tl.dot expert kernels for them too (to compare).
SINGLE_TOKEN_KERNELS = True
# Single-token steps launch the kernels as programmatic dependent launches (PDL; Hopper on):
# each kernel's programs start while the previous kernel finishes, read only weights until a
# grid-dependency wait (the previous kernel done, its writes visible), then let the next kernel
# launch. Every such program waits before it writes or reads activations, so the order of the
# stream holds; ends of kernels overlap, which shortens the batch-1 step. False: plain launches.
PDL = True


@functools.cache
def _has_pdl(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def uses_pdl(x: Tensor) -> bool:
    """Whether a kernel reading x launches as a programmatic dependent launch (see PDL)."""
    return PDL and SINGLE_TOKEN_KERNELS and x.is_cuda and x.shape[0] == 1 and _has_pdl(x.device)


@triton.jit
def wait_for_previous_kernel():
    """PDL: waits until the previous kernel on the stream is done (its writes visible), then
    lets the next one launch (its programs wait the same way before reading ours)."""
    gdc_wait()
    gdc_launch_dependents()
