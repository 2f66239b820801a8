"""F.linear for one token in Triton (gemv), for batch-1 decode.

One program per few output columns reads its weight rows once on the CUDA
cores (one token has nothing for tensor cores to share), fp32 sums rounded once
as F.linear rounds them; cuBLAS is slower at this shape (split-K and its reduce
for o_proj). gemv_rows is the same dot product inside other kernels (routing's
gate_route, moe_small's FMA gate_up).

Legend: N output columns, D input features.
"""

import dataclasses

import torch
import triton
import triton.language as tl
from torch import Tensor

from services.model.kernels import launch
from services.model.kernels.launch import uses_pdl, wait_for_previous_kernel


@triton.jit
def gemv_rows(x_ptr, w_ptr, in_features, n, n_mask, k_start, k_end, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              NUM_STAGES: tl.constexpr, PDL: tl.constexpr):
    """fp32 [BLOCK_N]: w[n, k_start:k_end] @ x[k_start:k_end] (w rows of in_features), on the
    CUDA cores: one token has nothing for tensor cores to share. PDL: the first step's weights
    are loaded before waiting for the previous kernel (which writes x)."""
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    loop_start = k_start
    if PDL:
        k = k_start + tl.arange(0, BLOCK_K)
        k_mask = k < k_end
        w = tl.load(w_ptr + n[:, None] * in_features + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        wait_for_previous_kernel()
        x = tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
        loop_start = k_start + BLOCK_K
    for k0 in tl.range(loop_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < k_end
        x = tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + n[:, None] * in_features + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    return tl.sum(acc, 1)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, in_features, out_features, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NUM_STAGES: tl.constexpr, PDL: tl.constexpr):
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < out_features
    y = gemv_rows(x_ptr, w_ptr, in_features, n, n_mask, 0, in_features, BLOCK_N, BLOCK_K, NUM_STAGES, PDL)
    tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


@dataclasses.dataclass(frozen=True, slots=True)
class GemvTiles:
    """Launch shape of gemv."""

    block_n: int  # output columns per program
    block_k: int  # reduction elements per step of its loop
    stages: int
    warps: int


# Picked on an H200 (docs/performance.md): GEMV_TILES the least q|k|v + o + gate time,
# GEMV_TILES_BY_SHAPE the fastest for each of Qwen3-30B-A3B's [N, D] weights.
GEMV_TILES = GemvTiles(block_n=4, block_k=512, stages=3, warps=4)
GEMV_TILES_BY_SHAPE = {(5120, 2048): GemvTiles(block_n=8, block_k=512, stages=3, warps=4),
                       (2048, 4096): GemvTiles(block_n=8, block_k=512, stages=5, warps=4),
                       (128, 2048): GemvTiles(block_n=4, block_k=1024, stages=2, warps=4)}


def linear(x_TD: Tensor, w_ND: Tensor) -> Tensor:
    """F.linear(x_TD, w_ND); gemv for single-token steps."""
    if launch.SINGLE_TOKEN_KERNELS and x_TD.shape[0] == 1:
        return gemv(x_TD, w_ND, GEMV_TILES_BY_SHAPE.get(tuple(w_ND.shape), GEMV_TILES))
    return torch.nn.functional.linear(x_TD, w_ND)


def gemv(x_1D: Tensor, w_ND: Tensor, tiles: GemvTiles) -> Tensor:
    """x_1D @ w_ND.T for one token, fp32 sums rounded once to x's dtype as F.linear rounds
    them; one program per tiles.block_n output columns, each reading its rows once."""
    assert x_1D.shape[0] == 1 and x_1D.is_contiguous() and w_ND.is_contiguous() and w_ND.shape[1] == x_1D.shape[1]
    y_1N = x_1D.new_empty(1, w_ND.shape[0])
    _gemv_kernel[(triton.cdiv(w_ND.shape[0], tiles.block_n),)](
        x_1D, w_ND, y_1N, w_ND.shape[1], w_ND.shape[0], BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        NUM_STAGES=tiles.stages, PDL=uses_pdl(x_1D), num_warps=tiles.warps, launch_pdl=uses_pdl(x_1D))
    return y_1N

