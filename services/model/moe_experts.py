"""The local experts' SwiGLU MLPs over rows grouped by expert, in torch: the dispatch path's
third step (moe_dispatch.py), and the reference the Triton expert GEMMs match.

Legend as in moe_dispatch.py: P rows (pairs), D hidden, F expert width, G = 2F,
L local experts (slots), I and O a matmul's input and output width.
"""

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

# Rows per block of the expert matmuls of a layer with spare slots on the CPU (see experts):
# products of at least this many rows gave each row the same bits whatever the row count,
# for Qwen3-30B-A3B's and -235B-A22B's expert shapes (D 2048/4096, F 768/1536) with torch
# 2.13's CPU BLAS, one thread.
CPU_REPLICA_ROW_BLOCK = 32


def experts(x_PD: Tensor, offsets_L: Tensor, w_gate_up_LGD: Tensor, w_down_LDF: Tensor,
            row_block: int = 0) -> Tensor:
    """The local experts' SwiGLU MLPs over rows grouped by expert: y_PD (rows past
    offsets_L[-1], fixed-capacity padding, hold anything: combine gives them weight 0).

    row_block > 0 multiplies every group in blocks of exactly that many rows
    (zero padded), so that a row's result does not depend on how many rows
    share its expert: CPU BLAS takes other kernels for small matrices (a
    1-row product differs from the same row in a 16-row one in the last bit),
    and with replicas an expert's rows split over slots differently.

    On CUDA the Triton MoE backend takes kernels/moe_gemm.py's sorted_experts instead
    (the same roundings).
    """
    gate_PF, up_PF = grouped_mm(x_PD, w_gate_up_LGD, offsets_L, row_block).chunk(2, dim=-1)
    return grouped_mm(F.silu(gate_PF) * up_PF, w_down_LDF, offsets_L, row_block)


def grouped_mm(x_PI: Tensor, w_LOI: Tensor, offsets_L: Tensor, row_block: int = 0) -> Tensor:
    """Row group l of x (ending at offsets_L[l]) times w_LOI[l].T: [P, O]
    (row_block > 0: in zero-padded blocks of that many rows, see experts)."""
    if row_block:
        return _blocked_grouped_mm(x_PI, w_LOI, offsets_L, row_block)
    if _has_grouped_mm(x_PI.device.type, x_PI.dtype):
        return torch._grouped_mm(x_PI, w_LOI.transpose(-2, -1), offs=offsets_L)
    out_PO = x_PI.new_empty(x_PI.shape[0], w_LOI.shape[1])
    start = 0
    for expert, end in enumerate(offsets_L.tolist()):
        out_PO[start:end] = x_PI[start:end] @ w_LOI[expert].T
        start = end
    return out_PO


def _blocked_grouped_mm(x_PI: Tensor, w_LOI: Tensor, offsets_L: Tensor, row_block: int) -> Tensor:
    out_PO = x_PI.new_zeros(x_PI.shape[0], w_LOI.shape[1])
    start = 0
    for expert, end in enumerate(offsets_L.tolist()):
        for first in range(start, end, row_block):
            rows = min(row_block, end - first)
            block_BI = x_PI.new_zeros(row_block, x_PI.shape[1])
            block_BI[:rows] = x_PI[first:first + rows]
            out_PO[first:first + rows] = (block_BI @ w_LOI[expert].T)[:rows]
        start = end
    return out_PO


@functools.cache
def _has_grouped_mm(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs for this device and dtype (probed once)."""
    try:
        torch._grouped_mm(torch.zeros(16, 16, dtype=dtype, device=device_type),
                          torch.zeros(1, 16, 16, dtype=dtype, device=device_type),
                          offs=torch.tensor([16], dtype=torch.int32, device=device_type))
    except (AttributeError, NotImplementedError, RuntimeError):
        return False
    return True
