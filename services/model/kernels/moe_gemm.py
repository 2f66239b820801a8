"""Grouped expert GEMMs in Triton over aligned segments (moe_align): gate_up and down (issue 8).

- gate_up: a grouped GEMM over the segments that gathers x rows by index
  (vLLM's fused_moe layout, one expert per block of rows) with SiLU(gate) * up
  in its epilogue: act_PF.
- down: the grouped GEMM on act_PF, storing each output row at its routed row r: y_RD.
- sorted_experts: both over rows the dispatch path already sorted by local
  expert (moe_align.segments pads their segments), with K = 1: the Triton form
  of moe_experts.experts.

Each intermediate the torch code stores in the model dtype is rounded the
same way here (gate and up, SiLU, its product, the down output).

Legend as in moe_dispatch.py: T tokens, D hidden, F expert width, G = 2F, E experts,
K experts per token, L local experts, P padded positions.
"""

import dataclasses

import triton
import triton.language as tl
from torch import Tensor

from services.model.kernels.moe_align import Alignment, segments

# The switch the Triton MoE backend reads on CUDA (expert-parallel ranks): sorted_experts'
# Triton GEMMs on dispatch's rows (False: torch._grouped_mm and SiLU * up in torch, e.g. to compare).
EP_EXPERTS = True
# Shared memory a block may use on an H100/H200 (227 KB).
SHARED_MEMORY_BYTES = 232448


@dataclasses.dataclass(frozen=True, slots=True)
class GemmBlocks:
    """Tile of one grouped GEMM: output columns, reduction step, warps, pipeline stages."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True, slots=True)
class MoEConfig:
    """Rows per block (both GEMMs: the segments are padded to it) and each GEMM's tile.
    gate_up's block_n counts columns of gate and of up each. tiles_first: the GEMMs launch
    each block's column tiles in turn (else each column tile over every block): neighbouring
    programs share a block's rows and an expert's weights, so each is read from HBM about once.
    Over the blocks, a column tile's pass streams every block's rows, which fall out of L2
    before the next tile's pass reads them again: down, whose rows are the routed pairs' act
    (top_k a token), then reads them once per column tile (docs/performance.md)."""

    block_m: int
    gate_up: GemmBlocks
    down: GemmBlocks
    tiles_first: bool = True


def default_config(num_tokens: int) -> MoEConfig:
    """The tiles for a step of num_tokens: within 2% of the fastest of a sweep on an H200
    (Qwen3-30B-A3B's shape; docs/performance.md)."""
    if num_tokens <= 128:
        return MoEConfig(16, GemmBlocks(128, 128, 4, 3), GemmBlocks(128, 128, 4, 4))
    if num_tokens <= 256:
        return MoEConfig(32, GemmBlocks(128, 128, 4, 3), GemmBlocks(64, 128, 4, 4))
    if num_tokens <= 512:
        return MoEConfig(64, GemmBlocks(128, 64, 4, 4), GemmBlocks(128, 64, 4, 4))
    return MoEConfig(128, GemmBlocks(128, 64, 8, 4), GemmBlocks(256, 64, 8, 4))



@triton.jit
def _block_rows(sorted_ids_ptr, starts_ptr, counts_ptr, ends_ptr, num_experts, BLOCK_M: tl.constexpr,
                BLOCK_E: tl.constexpr, TILES_FIRST: tl.constexpr):
    """This block's expert (num_experts: past the last segment), positions, valid rows, routed rows."""
    block = tl.program_id(1) if TILES_FIRST else tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    ends = tl.load(ends_ptr + e, mask=e < num_experts, other=2**30)
    expert = tl.sum((ends <= block * BLOCK_M).to(tl.int32), 0)
    p = block * BLOCK_M + tl.arange(0, BLOCK_M)
    seg_end = tl.load(starts_ptr + expert, mask=expert < num_experts, other=0) + tl.load(
        counts_ptr + expert, mask=expert < num_experts, other=0)
    row_mask = p < seg_end
    r = tl.load(sorted_ids_ptr + p, mask=row_mask, other=0)
    return expert, p, row_mask, r


@triton.jit
def _gate_up_kernel(x_ptr, sorted_ids_ptr, starts_ptr, counts_ptr, ends_ptr, w_ptr, act_ptr, num_experts,
                    hidden, width, x_stride, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, EVEN_K: tl.constexpr, TILES_FIRST: tl.constexpr):
    expert, p, row_mask, r = _block_rows(sorted_ids_ptr, starts_ptr, counts_ptr, ends_ptr, num_experts,
                                         BLOCK_M, BLOCK_E, TILES_FIRST)
    if expert >= num_experts:
        return
    f = (tl.program_id(0) if TILES_FIRST else tl.program_id(1)) * BLOCK_N + tl.arange(0, BLOCK_N)
    f_mask = f < width
    d = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + (r // TOP_K).to(tl.int64)[:, None] * x_stride
    w_gate = w_ptr + expert.to(tl.int64) * 2 * width * hidden + f[None, :] * hidden  # [K, N] tiles
    w_up = w_gate + width * hidden
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for d0 in range(0, hidden, BLOCK_K):
        dd = d0 + d
        if EVEN_K:
            x = tl.load(x_rows + dd[None, :], mask=row_mask[:, None], other=0.0)
            wg = tl.load(w_gate + dd[:, None], mask=f_mask[None, :], other=0.0)
            wu = tl.load(w_up + dd[:, None], mask=f_mask[None, :], other=0.0)
        else:
            d_mask = dd < hidden
            x = tl.load(x_rows + dd[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)
            wg = tl.load(w_gate + dd[:, None], mask=d_mask[:, None] & f_mask[None, :], other=0.0)
            wu = tl.load(w_up + dd[:, None], mask=d_mask[:, None] & f_mask[None, :], other=0.0)
        acc_gate = tl.dot(x, wg, acc_gate, input_precision="ieee")
        acc_up = tl.dot(x, wu, acc_up, input_precision="ieee")
    dtype = act_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    tl.store(act_ptr + p.to(tl.int64)[:, None] * width + f[None, :], act.to(dtype), mask=f_mask[None, :])


@triton.jit
def _down_kernel(act_ptr, sorted_ids_ptr, starts_ptr, counts_ptr, ends_ptr, w_ptr, y_ptr, num_experts, hidden,
                 width, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_E: tl.constexpr, EVEN_K: tl.constexpr, TILES_FIRST: tl.constexpr):
    expert, p, row_mask, r = _block_rows(sorted_ids_ptr, starts_ptr, counts_ptr, ends_ptr, num_experts,
                                         BLOCK_M, BLOCK_E, TILES_FIRST)
    if expert >= num_experts:
        return
    o = (tl.program_id(0) if TILES_FIRST else tl.program_id(1)) * BLOCK_N + tl.arange(0, BLOCK_N)
    o_mask = o < hidden
    f = tl.arange(0, BLOCK_K)
    act_rows = act_ptr + p.to(tl.int64)[:, None] * width
    w_down = w_ptr + expert.to(tl.int64) * hidden * width + o[None, :] * width  # [K, N] tiles
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for f0 in range(0, width, BLOCK_K):
        ff = f0 + f
        if EVEN_K:
            act = tl.load(act_rows + ff[None, :])
            w = tl.load(w_down + ff[:, None], mask=o_mask[None, :], other=0.0)
        else:
            f_mask = ff < width
            act = tl.load(act_rows + ff[None, :], mask=f_mask[None, :], other=0.0)
            w = tl.load(w_down + ff[:, None], mask=f_mask[:, None] & o_mask[None, :], other=0.0)
        acc = tl.dot(act, w, acc, input_precision="ieee")
    tl.store(y_ptr + r.to(tl.int64)[:, None] * hidden + o[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_mask[:, None] & o_mask[None, :])



def _grid(num_blocks: int, num_tiles: int, tiles_first: bool) -> tuple[int, int]:
    """A GEMM's grid: blocks of rows by column tiles, the faster-launched axis first."""
    return (num_tiles, num_blocks) if tiles_first else (num_blocks, num_tiles)


def _stages(tile: GemmBlocks, block_m: int, element_size: int, num_weights: int) -> int:
    """tile.num_stages, fewer where its buffers (one fewer than the stages) would not fit an H100/H200
    block's shared memory: 4-byte operands (an fp32 model) double a stage's bytes, and the bf16
    tiles were sized to fit once, not twice."""
    stage_bytes = tile.block_k * (block_m + num_weights * tile.block_n) * element_size
    return max(1, min(tile.num_stages, SHARED_MEMORY_BYTES // stage_bytes + 1))


def gate_up(x_TD: Tensor, a: Alignment, w_gate_up_EGD: Tensor, top_k: int, tile: GemmBlocks,
            tiles_first: bool = True) -> Tensor:
    """act_PF = SiLU(x W_gate^T) * (x W_up^T) for each position's routed row, by expert
    (x_TD's rows may have any stride; its columns are contiguous)."""
    num_experts, double_width, hidden = w_gate_up_EGD.shape
    assert x_TD.stride(1) == 1
    width = double_width // 2
    act_PF = x_TD.new_empty(a.sorted_ids_P.shape[0], width)
    num_blocks = a.sorted_ids_P.shape[0] // a.block_m
    if num_blocks:
        _gate_up_kernel[_grid(num_blocks, triton.cdiv(width, tile.block_n), tiles_first)](
            x_TD, a.sorted_ids_P, a.starts_E, a.counts_E, a.ends_E, w_gate_up_EGD, act_PF, num_experts, hidden,
            width, x_TD.stride(0), TOP_K=top_k, BLOCK_M=a.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            BLOCK_E=triton.next_power_of_2(num_experts), EVEN_K=hidden % tile.block_k == 0,
            TILES_FIRST=tiles_first, num_warps=tile.num_warps,
            num_stages=_stages(tile, a.block_m, x_TD.element_size(), 2))
    return act_PF


def down(act_PF: Tensor, a: Alignment, w_down_EDF: Tensor, num_routed: int, tile: GemmBlocks,
         tiles_first: bool = True) -> Tensor:
    """y_RD: each position's act times its expert's W_down^T, stored at its routed row."""
    num_experts, hidden, width = w_down_EDF.shape
    y_RD = act_PF.new_empty(num_routed, hidden)
    num_blocks = a.sorted_ids_P.shape[0] // a.block_m
    if num_blocks:
        _down_kernel[_grid(num_blocks, triton.cdiv(hidden, tile.block_n), tiles_first)](
            act_PF, a.sorted_ids_P, a.starts_E, a.counts_E, a.ends_E, w_down_EDF, y_RD, num_experts, hidden,
            width, BLOCK_M=a.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            BLOCK_E=triton.next_power_of_2(num_experts), EVEN_K=width % tile.block_k == 0,
            TILES_FIRST=tiles_first, num_warps=tile.num_warps,
            num_stages=_stages(tile, a.block_m, act_PF.element_size(), 1))
    return y_RD


def sorted_experts(x_PD: Tensor, offsets_L: Tensor, w_gate_up_LGD: Tensor, w_down_LDF: Tensor,
                   config: MoEConfig | None = None) -> Tensor:
    """moe_experts.experts (row_block 0) by the Triton GEMMs, for rows dispatch already sorted by
    local expert: y_PD (P: moe_dispatch's pairs), rows past offsets_L[-1] (fixed-capacity padding) neither
    read nor written.
    The segments are padded on the device (no row moves: each position names its row), so
    it is capturable, the grids sized from P. The default tiles are default_config's for the
    same rows per expert: its T tokens route K = 8 of E = 128 experts, T / 16 rows each."""
    num_rows, num_local = x_PD.shape[0], offsets_L.shape[0]
    assert w_gate_up_LGD.shape[0] == w_down_LDF.shape[0] == num_local
    assert x_PD.is_contiguous() and w_gate_up_LGD.is_contiguous() and w_down_LDF.is_contiguous()
    config = config or default_config(16 * num_rows // num_local)
    a = segments(offsets_L, num_rows, config.block_m)
    act_PF = gate_up(x_PD, a, w_gate_up_LGD, 1, config.gate_up, config.tiles_first)
    return down(act_PF, a, w_down_LDF, num_rows, config.down, config.tiles_first)

