"""The experts of the MoE in AWQ 4-bit (issue 29): moe_gemm's grouped GEMMs and moe_small's one-token kernels.

The same layouts, grids and roundings as the bf16 kernels they mirror, with each
expert's weights in AWQ's layout (quant_awq.py, K rows by N columns):

- gate_up: qweight [E, D, 2F/8], qzeros [E, D/G, 2F/8], scales [E, D/G, 2F]: the gate's
  columns, then the up's (F a multiple of 8, so each half packs on its own).
- down: qweight [E, F, D/8], qzeros [E, F/G, D/8], scales [E, F/G, D].

- gate_up / down: moe_gemm's grouped GEMMs over moe_align's segments, weights
  dequantized in registers (tl.dot on q - z, times the group's scales).
- one_token_gate_up / one_token_down: batch-1 decode's per-expert GEMVs on the CUDA
  cores (quant_awq_gemv.py, each split along its reduction and summed in the kernel;
  PDL launches); the last of down's programs for a block of columns rounds each expert's
  output and sums them weighted in expert order, as moe_grouped.combine does (a combine
  kernel after it was a launch that PDL could not overlap). OneTokenTiles.gemv picks
  quant_awq_gemv's GEMV (GROUPED_TILES, the default: awq_gemv_groups; NIBBLE_TILES:
  awq_gemv_cols).
- grouped_moe: moe_grouped.grouped_moe on these; sorted_experts: moe_gemm.sorted_experts
  on these (the dispatch path's rows).

An AwqWeights holds one projection's three tensors.

Legend as in moe_dispatch.py: T tokens, D hidden, F expert width, E experts, K experts per token,
R = T * K routed rows, P padded positions.
"""

import dataclasses

import torch
import triton
import triton.language as tl
from torch import Tensor

from services.model.kernels import moe_align, moe_gemm, moe_grouped
from services.model.kernels.launch import uses_pdl, wait_for_previous_kernel
from services.model.kernels.moe_gemm import GemmBlocks, MoEConfig, _block_rows, _grid
from services.model.kernels.quant_awq import (awq_block_dot, awq_columns, awq_step_acc, awq_step_dot, awq_step_result,
                                              bias_bits_for, check_layout)
from services.model.kernels.quant_awq_gemv import (MAX_SPLIT_TILES, awq_gemv_cols, awq_gemv_groups,
                                                   awq_gemv_one_group, awq_last_split, awq_sum_splits,
                                                   awq_tile_columns, split_counters)
from services.model.kernels.quant_fp8_moe import silu_mul
from services.model.kernels.quant_ref import AWQ_GROUP, AWQ_PACK
from services.model.layers import AddNorm


# The grouped GEMMs' K step at most up to 512 tokens (one group of 128 in two steps: block_k 128 was
# slower there), and both GEMMs' blocks up to 128 tokens.
AWQ_MAX_STEP = 64
AWQ_SMALL_BLOCKS = GemmBlocks(block_n=128, block_k=64, num_warps=4, num_stages=3)
# Above 512 tokens (128-row blocks): a whole group a step, and down's tiles narrower than bf16's 256 columns
# (which spill at 128 rows); the fastest of two sweeps on an H100 at Qwen3-30B-A3B's shape (docs/performance.md).
AWQ_LARGE_GATE_UP = GemmBlocks(block_n=128, block_k=128, num_warps=8, num_stages=3)
AWQ_LARGE_DOWN = GemmBlocks(block_n=128, block_k=128, num_warps=8, num_stages=3)
# Blocks of at most this many rows put the weights first in their dots (quant_awq.awq_step_dot's WEIGHTS_FIRST):
# faster at 16- and 32-row blocks, slower at 128 on an H100 (docs/performance.md).
WEIGHTS_FIRST_MAX_ROWS = 32


@dataclasses.dataclass(frozen=True, slots=True)
class AwqWeights:
    """One projection of every expert in AWQ's layout: qweight [E, K, N/8], qzeros [E, K/G, N/8], scales [E, K/G, N]."""

    qweight: Tensor
    qzeros: Tensor
    scales: Tensor
    group: int = AWQ_GROUP

    def shape(self) -> tuple[int, int, int]:
        """(E, K, N), the layout checked."""
        in_features, out_features = check_layout(self.qweight, self.qzeros, self.scales, self.group)
        return self.qweight.shape[0], in_features, out_features

    def expert_strides(self) -> tuple[int, int, int]:
        """Elements from one expert's qweight, qzeros and scales to the next's."""
        return self.qweight[0].numel(), self.qzeros[0].numel(), self.scales[0].numel()


@triton.jit
def _gate_up_kernel(x_ptr, sorted_ids_ptr, starts_ptr, counts_ptr, ends_ptr, q_ptr, z_ptr, s_ptr, act_ptr,
                    num_experts, hidden, width, x_stride, q_stride, z_stride, s_stride, bias_bits, TOP_K: tl.constexpr,
                    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_E: tl.constexpr, TILES_FIRST: tl.constexpr, WEIGHTS_FIRST: tl.constexpr):
    expert, p, row_mask, r = _block_rows(sorted_ids_ptr, starts_ptr, counts_ptr, ends_ptr, num_experts,
                                         BLOCK_M, BLOCK_E, TILES_FIRST)
    if expert >= num_experts:
        return
    num_packed, out_features = 2 * width // 8, 2 * width
    # The gate's columns (its packed columns end with them: F a multiple of 8); the up's are width further.
    f, f_mask, j, j_mask = awq_columns(tl.program_id(0) if TILES_FIRST else tl.program_id(1), width // 8, width,
                                       BLOCK_N)
    e = expert.to(tl.int64)
    q_e, z_e, s_e = q_ptr + e * q_stride, z_ptr + e * z_stride, s_ptr + e * s_stride
    x_rows = x_ptr + (r // TOP_K).to(tl.int64) * x_stride
    acc_gate = awq_step_acc(BLOCK_M, BLOCK_N, WEIGHTS_FIRST)
    acc_up = awq_step_acc(BLOCK_M, BLOCK_N, WEIGHTS_FIRST)
    for d0 in range(0, hidden, BLOCK_K):  # awq_block_dot's step, for gate and up at once (x read once)
        d = d0 + tl.arange(0, BLOCK_K)
        d_mask = d < hidden
        x = tl.load(x_rows[:, None] + d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        acc_gate = awq_step_dot(acc_gate, x, q_e, z_e, s_e, d, d_mask, d0 // GROUP, j, j_mask, f, f_mask, num_packed,
                                out_features, bias_bits, WEIGHTS_FIRST)
        acc_up = awq_step_dot(acc_up, x, q_e, z_e, s_e, d, d_mask, d0 // GROUP, j + width // 8, j_mask, f + width,
                              f_mask, num_packed, out_features, bias_bits, WEIGHTS_FIRST)
    act = silu_mul(awq_step_result(acc_gate, WEIGHTS_FIRST), awq_step_result(acc_up, WEIGHTS_FIRST),
                   act_ptr.dtype.element_ty)
    tl.store(act_ptr + p.to(tl.int64)[:, None] * width + f[None, :], act.to(act_ptr.dtype.element_ty),
             mask=f_mask[None, :])


@triton.jit
def _down_kernel(act_ptr, sorted_ids_ptr, starts_ptr, counts_ptr, ends_ptr, q_ptr, z_ptr, s_ptr, y_ptr, num_experts,
                 hidden, width, q_stride, z_stride, s_stride, bias_bits, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, TILES_FIRST: tl.constexpr,
                 WEIGHTS_FIRST: tl.constexpr):
    expert, p, row_mask, r = _block_rows(sorted_ids_ptr, starts_ptr, counts_ptr, ends_ptr, num_experts,
                                         BLOCK_M, BLOCK_E, TILES_FIRST)
    if expert >= num_experts:
        return
    num_packed = (hidden + 7) // 8
    o, o_mask, j, j_mask = awq_columns(tl.program_id(0) if TILES_FIRST else tl.program_id(1), num_packed, hidden,
                                       BLOCK_N)
    e = expert.to(tl.int64)
    acc = awq_block_dot(act_ptr + p.to(tl.int64) * width, row_mask, q_ptr + e * q_stride, z_ptr + e * z_stride,
                        s_ptr + e * s_stride, j, j_mask, o, o_mask, num_packed, hidden, 0, width, bias_bits, GROUP,
                        BLOCK_K, WEIGHTS_FIRST)
    tl.store(y_ptr + r.to(tl.int64)[:, None] * hidden + o[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_mask[:, None] & o_mask[None, :])


def _gate_up_shape(w: AwqWeights) -> tuple[int, int, int]:
    num_experts, hidden, double_width = w.shape()
    assert double_width % (2 * AWQ_PACK) == 0, f"gate_up's F ({double_width // 2}) must be a multiple of 8"
    return num_experts, hidden, double_width // 2


def gate_up(x_TD: Tensor, a: moe_align.Alignment, w_gate_up: AwqWeights, top_k: int, tile: GemmBlocks,
            tiles_first: bool = True) -> Tensor:
    """moe_gemm.gate_up on AWQ experts: act_PF in x's dtype (tile.block_k divides the group size)."""
    num_experts, hidden, width = _gate_up_shape(w_gate_up)
    assert x_TD.stride(1) == 1 and w_gate_up.group % tile.block_k == 0 and tile.block_n % AWQ_PACK == 0
    act_PF = x_TD.new_empty(a.sorted_ids_P.shape[0], width)
    num_blocks = a.sorted_ids_P.shape[0] // a.block_m
    if num_blocks:
        _gate_up_kernel[_grid(num_blocks, triton.cdiv(width, tile.block_n), tiles_first)](
            x_TD, a.sorted_ids_P, a.starts_E, a.counts_E, a.ends_E, w_gate_up.qweight, w_gate_up.qzeros,
            w_gate_up.scales, act_PF, num_experts, hidden, width, x_TD.stride(0), *w_gate_up.expert_strides(),
            bias_bits_for(x_TD.dtype),
            TOP_K=top_k, GROUP=w_gate_up.group, BLOCK_M=a.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            BLOCK_E=triton.next_power_of_2(num_experts), TILES_FIRST=tiles_first,
            WEIGHTS_FIRST=a.block_m <= WEIGHTS_FIRST_MAX_ROWS, num_warps=tile.num_warps, num_stages=tile.num_stages)
    return act_PF


def down(act_PF: Tensor, a: moe_align.Alignment, w_down: AwqWeights, num_routed: int, tile: GemmBlocks,
         tiles_first: bool = True) -> Tensor:
    """moe_gemm.down on AWQ experts: y_RD, each position's output at its routed row."""
    num_experts, width, hidden = w_down.shape()
    assert act_PF.is_contiguous() and w_down.group % tile.block_k == 0 and tile.block_n % AWQ_PACK == 0
    y_RD = act_PF.new_empty(num_routed, hidden)
    num_blocks = a.sorted_ids_P.shape[0] // a.block_m
    if num_blocks:
        _down_kernel[_grid(num_blocks, triton.cdiv(hidden, tile.block_n), tiles_first)](
            act_PF, a.sorted_ids_P, a.starts_E, a.counts_E, a.ends_E, w_down.qweight, w_down.qzeros, w_down.scales,
            y_RD, num_experts, hidden, width, *w_down.expert_strides(), bias_bits_for(act_PF.dtype),
            GROUP=w_down.group, BLOCK_M=a.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            BLOCK_E=triton.next_power_of_2(num_experts),
            TILES_FIRST=tiles_first, WEIGHTS_FIRST=a.block_m <= WEIGHTS_FIRST_MAX_ROWS, num_warps=tile.num_warps,
            num_stages=tile.num_stages)
    return y_RD


def fit_config(config: MoEConfig, group: int = AWQ_GROUP, max_step: int = AWQ_MAX_STEP) -> MoEConfig:
    """config with each GEMM's K step at most max_step and one group (tiny test models have
    groups below 128). Each step unpacks a [block_k, block_n] tile of 4-bit values in registers;
    up to 512 tokens block_k 128 was no faster (default_config)."""
    def fit(blocks: GemmBlocks) -> GemmBlocks:
        return dataclasses.replace(blocks, block_k=min(blocks.block_k, max_step, group))
    return dataclasses.replace(config, gate_up=fit(config.gate_up), down=fit(config.down))


def default_config(num_tokens: int, group: int = AWQ_GROUP) -> MoEConfig:
    """moe_gemm.default_config's blocks for a step of num_tokens, fitted to AWQ (fit_config); up to
    128 tokens both GEMMs take AWQ_SMALL_BLOCKS, at 128-row blocks (above 512) AWQ_LARGE_*."""
    config = moe_gemm.default_config(num_tokens)
    if num_tokens <= 128:
        config = dataclasses.replace(config, gate_up=AWQ_SMALL_BLOCKS, down=AWQ_SMALL_BLOCKS)
    elif config.block_m == 128:
        return fit_config(dataclasses.replace(config, gate_up=AWQ_LARGE_GATE_UP, down=AWQ_LARGE_DOWN), group,
                          max_step=AWQ_GROUP)
    return fit_config(config, group)


def grouped_moe(x_TD: Tensor, w_gate_ED: Tensor, w_gate_up: AwqWeights, w_down: AwqWeights, top_k: int,
                norm_topk_prob: bool, hit_counts_E: Tensor, config: MoEConfig | None = None,
                add_norm: AddNorm | None = None) -> Tensor:
    """moe_grouped.grouped_moe with AWQ experts (the gate stays bf16): route, align, gate_up, down, combine."""
    num_experts, num_tokens = w_gate_ED.shape[0], x_TD.shape[0]
    assert w_gate_up.qweight.shape[0] == w_down.qweight.shape[0] == num_experts, "no spare slots here"
    config = config or default_config(num_tokens, w_gate_up.group)
    ids_TK, weights_TK, counts_CE = moe_grouped.route(x_TD, w_gate_ED, top_k, norm_topk_prob, hit_counts_E)
    a = moe_align.align(ids_TK, num_experts, config.block_m, chunk_counts=counts_CE)
    act_PF = gate_up(x_TD, a, w_gate_up, top_k, config.gate_up, config.tiles_first)
    y_RD = down(act_PF, a, w_down, ids_TK.numel(), config.down, config.tiles_first)
    if add_norm is None:
        return moe_grouped.combine(y_RD, None, weights_TK)
    return moe_grouped.combine_add_norm(y_RD, weights_TK, add_norm)


def sorted_experts(x_PD: Tensor, offsets_L: Tensor, w_gate_up: AwqWeights, w_down: AwqWeights,
                   config: MoEConfig | None = None) -> Tensor:
    """moe_gemm.sorted_experts (the dispatch path's rows, already sorted by local expert; rows past
    offsets_L[-1] neither read nor written) on AWQ experts."""
    num_rows, num_local = x_PD.shape[0], offsets_L.shape[0]
    config = config or default_config(16 * num_rows // num_local, w_gate_up.group)
    a = moe_align.segments(offsets_L, num_rows, config.block_m)
    act_PF = gate_up(x_PD, a, w_gate_up, 1, config.gate_up, config.tiles_first)
    return down(act_PF, a, w_down, num_rows, config.down, config.tiles_first)


@triton.jit
def _one_token_gate_up_kernel(x_ptr, ids_ptr, q_ptr, z_ptr, s_ptr, act_ptr, partials_ptr, counters_ptr, q_stride,
                              z_stride, s_stride, d_split, HIDDEN: tl.constexpr, WIDTH: tl.constexpr,
                              GROUP: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
                              SPLITS: tl.constexpr, PDL: tl.constexpr, GROUPS: tl.constexpr,
                              ONE_GROUP: tl.constexpr):
    """act[k, f] = SiLU(gate) * up of the token's k-th expert, on the CUDA cores: 2 SPLITS programs
    a tile, the gate's SPLITS along D then the up's (one GEMV's registers each), the last of them
    summing the partials. PDL: waits for gate_route's ids, then lets the down kernel start.
    GROUPS: awq_gemv_groups (BLOCK_D its rows a slice; ONE_GROUP: splits of one group each,
    awq_gemv_one_group), else awq_gemv_cols."""
    f_block, k, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if PDL:
        wait_for_previous_kernel()
    e = tl.load(ids_ptr + k).to(tl.int64)
    j = f_block * (BLOCK_F // 8) + tl.arange(0, BLOCK_F // 8)  # the gate's packed columns; the up's WIDTH / 8 on
    j_mask = j < WIDTH // 8
    d_start = (part % SPLITS) * d_split
    q_e, z_e, s_e, j_part = q_ptr + e * q_stride, z_ptr + e * z_stride, s_ptr + e * s_stride, j + (part // SPLITS) * (
        WIDTH // 8)
    d_end = tl.minimum(d_start + d_split, HIDDEN)
    f = awq_tile_columns(f_block, BLOCK_F // 8)
    f_mask = f < WIDTH
    if ONE_GROUP:
        values = awq_gemv_one_group(x_ptr, q_e, z_e, s_e, j_part, j_mask, f + (part // SPLITS) * WIDTH, f_mask,
                                    2 * WIDTH // 8, 2 * WIDTH, d_start, d_end, GROUP, BLOCK_D)
    elif GROUPS:
        values = awq_gemv_groups(x_ptr, q_e, z_e, s_e, j_part, j_mask, 2 * WIDTH // 8, 2 * WIDTH, d_start, d_end,
                                 GROUP, BLOCK_D, BLOCK_F // 8)
    else:
        values = awq_gemv_cols(x_ptr, q_e, z_e, s_e, j_part, j_mask, 2 * WIDTH // 8, 2 * WIDTH, d_start, d_end,
                               GROUP, BLOCK_D, BLOCK_F // 8)
    part_stride = tl.num_programs(1) * WIDTH  # partials [2 SPLITS, K, F]: the gate's splits, then the up's
    partials = partials_ptr + k * WIDTH
    tl.store(partials + part * part_stride + f, values, mask=f_mask)
    if awq_last_split(counters_ptr + k * tl.num_programs(0) + f_block, 2 * SPLITS):
        gate = awq_sum_splits(partials, part_stride, f, f_mask, SPLITS)
        up = awq_sum_splits(partials + SPLITS * part_stride, part_stride, f, f_mask, SPLITS)
        act = silu_mul(gate, up, act_ptr.dtype.element_ty)
        tl.store(act_ptr + k * WIDTH + f, act.to(act_ptr.dtype.element_ty), mask=f_mask)


@triton.jit
def _one_token_down_kernel(act_ptr, ids_ptr, weights_ptr, q_ptr, z_ptr, s_ptr, out_ptr, partials_ptr, counters_ptr,
                           q_stride, z_stride, s_stride, f_split, HIDDEN: tl.constexpr, WIDTH: tl.constexpr,
                           TOP_K: tl.constexpr, GROUP: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_F: tl.constexpr,
                           SPLITS: tl.constexpr, PDL: tl.constexpr, GROUPS: tl.constexpr, ONE_GROUP: tl.constexpr):
    """out[o] = sum over k of weight_k * (act[k] @ w_down[ids[k], o]) for a block of output columns:
    TOP_K x SPLITS programs (the k-th expert's rows, SPLITS along F) store fp32 partials, and the
    last of them to finish sums each expert's splits in order, rounds it to the model dtype as a
    stored expert output, and adds the K weighted outputs as moe_grouped.combine does (each
    product rounded, increasing expert order): no combine launch after it. PDL: its first
    weights are loaded before it waits for gate_up's act (ids are final once gate_up runs).
    GROUPS: as the gate_up kernel's."""
    o_block, k, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    e = tl.load(ids_ptr + k).to(tl.int64)
    j = o_block * (BLOCK_O // 8) + tl.arange(0, BLOCK_O // 8)
    j_mask = j < (HIDDEN + 7) // 8
    f_start = split * f_split
    a_k, q_e, z_e, s_e = act_ptr + k * WIDTH, q_ptr + e * q_stride, z_ptr + e * z_stride, s_ptr + e * s_stride
    f_end = tl.minimum(f_start + f_split, WIDTH)
    o = awq_tile_columns(o_block, BLOCK_O // 8)
    o_mask = o < HIDDEN
    if ONE_GROUP:
        y = awq_gemv_one_group(a_k, q_e, z_e, s_e, j, j_mask, o, o_mask, (HIDDEN + 7) // 8, HIDDEN, f_start,
                               f_end, GROUP, BLOCK_F, PDL)
    elif GROUPS:
        y = awq_gemv_groups(a_k, q_e, z_e, s_e, j, j_mask, (HIDDEN + 7) // 8, HIDDEN, f_start, f_end, GROUP, BLOCK_F,
                            BLOCK_O // 8, PDL)
    else:
        y = awq_gemv_cols(a_k, q_e, z_e, s_e, j, j_mask, (HIDDEN + 7) // 8, HIDDEN, f_start, f_end, GROUP, BLOCK_F,
                          BLOCK_O // 8, PDL)
    split_stride = TOP_K * HIDDEN  # partials [SPLITS, K, D]
    tl.store(partials_ptr + split * split_stride + k * HIDDEN + o, y, mask=o_mask)
    if awq_last_split(counters_ptr + o_block, TOP_K * SPLITS):
        dtype = out_ptr.dtype.element_ty
        total = tl.zeros([BLOCK_O], tl.float32)
        for kk in tl.static_range(TOP_K):
            y_k = awq_sum_splits(partials_ptr + kk * HIDDEN, split_stride, o, o_mask, SPLITS).to(dtype)
            total += (y_k.to(tl.float32) * tl.load(weights_ptr + kk).to(tl.float32)).to(dtype).to(tl.float32)
        tl.store(out_ptr + o, total.to(dtype), mask=o_mask)


@dataclasses.dataclass(frozen=True, slots=True)
class OneTokenTiles:
    """Launch shape of the one-token kernels: gate_up_f and down_o columns a program (multiples of
    8; 64 reads whole 32-byte sectors of each qweight row), gate_up_d and down_f rows a step
    (dividing the group size), *_splits programs along the reduction (towards, not past; gate_up
    has as many again: the gate's and the up's run apart). gemv: "nibbles" (awq_gemv_cols) or
    "groups" (awq_gemv_groups: a step is a whole group, gate_up_d and down_f its rows a slice)."""

    gate_up_f: int
    gate_up_d: int
    gate_up_splits: int
    gate_up_warps: int
    down_o: int
    down_f: int
    down_splits: int
    down_warps: int
    gemv: str = "nibbles"

    def __post_init__(self):
        if self.gemv not in ("nibbles", "groups"):
            raise ValueError(f"OneTokenTiles.gemv must be 'nibbles' or 'groups', not {self.gemv!r}")

    def step(self, rows_a_step: int, group: int) -> int:
        """The reduction's rows a loop step: a group for the grouped GEMV, else rows_a_step."""
        return group if self.gemv == "groups" else rows_a_step


# The fastest one-token tiles of awq_gemv_cols in bench/kernels/awq_sweep.py at Qwen3-30B-A3B's shapes (D 2048,
# F 768, 8 experts) on an H200 (docs/performance.md): 384 and 512 programs, unsplit.
NIBBLE_TILES = OneTokenTiles(gate_up_f=32, gate_up_d=64, gate_up_splits=1, gate_up_warps=4, down_o=32, down_f=64,
                             down_splits=1, down_warps=4)
# awq_gemv_groups' tiles, the default: splits of one group each (awq_gemv_one_group: 16 of gate_up's 2,048 rows,
# 6 of down's 768), gate_up 128 columns a program in slices of 16 rows, down 256 in slices of 8, 2 warps each. The
# fastest of an H100 A/B of one-token tiles at Qwen3-30B-A3B's shapes (docs/performance.md). NIBBLE_TILES serve
# with --quant-gemv-variants awq-nibbles (quant_variants.use_gemv_variants).
GROUPED_TILES = OneTokenTiles(gate_up_f=128, gate_up_d=16, gate_up_splits=16, gate_up_warps=2, down_o=256, down_f=8,
                              down_splits=6, down_warps=2, gemv="groups")
ONE_TOKEN_TILES = GROUPED_TILES
# down's split counters start here, apart from gate_up's (PDL starts down while gate_up runs).
_DOWN_COUNTERS = MAX_SPLIT_TILES // 2


def _splits(depth: int, step: int, splits: int) -> tuple[int, int]:
    """(rows a split, a multiple of step; the splits that gives) of depth rows in at most `splits`."""
    rows = triton.cdiv(triton.cdiv(depth, step), splits) * step
    return rows, triton.cdiv(depth, rows)


def _split_buffers(device, splits: int, rows: int, cols: int, num_tiles: int, offset: int):
    """(fp32 partials [splits, rows, cols], the kernel's split counters from offset on) of a launch whose
    num_tiles tiles each count their programs."""
    assert num_tiles <= _DOWN_COUNTERS, num_tiles
    partials = torch.empty(splits, rows, cols, dtype=torch.float32, device=device)
    return partials, split_counters(device, MAX_SPLIT_TILES)[offset:]


def one_token_gate_up(x_1D: Tensor, ids_1K: Tensor, w_gate_up: AwqWeights,
                      tiles: OneTokenTiles = ONE_TOKEN_TILES) -> Tensor:
    """act_KF: SiLU(gate) * up of x_1D through each of its K experts (moe_small.one_token_gate_up)."""
    _, hidden, width = _gate_up_shape(w_gate_up)
    top_k = ids_1K.shape[1]
    assert x_1D.shape == (1, hidden) and x_1D.is_contiguous() and ids_1K.is_contiguous()
    assert w_gate_up.group % tiles.gate_up_d == 0 and tiles.gate_up_f % AWQ_PACK == 0
    act_KF = x_1D.new_empty(top_k, width)
    d_split, splits = _splits(hidden, tiles.step(tiles.gate_up_d, w_gate_up.group), tiles.gate_up_splits)
    grid = (triton.cdiv(width, tiles.gate_up_f), top_k, 2 * splits)
    partials, counters = _split_buffers(x_1D.device, 2 * splits, top_k, width, grid[0] * top_k, 0)
    _one_token_gate_up_kernel[grid](
        x_1D, ids_1K, w_gate_up.qweight, w_gate_up.qzeros, w_gate_up.scales, act_KF, partials, counters,
        *w_gate_up.expert_strides(), d_split, HIDDEN=hidden, WIDTH=width, GROUP=w_gate_up.group,
        BLOCK_F=tiles.gate_up_f, BLOCK_D=tiles.gate_up_d, SPLITS=splits, PDL=uses_pdl(x_1D),
        GROUPS=tiles.gemv == "groups", ONE_GROUP=tiles.gemv == "groups" and d_split == w_gate_up.group,
        num_warps=tiles.gate_up_warps, num_stages=1, launch_pdl=uses_pdl(x_1D))
    return act_KF


def one_token_down(act_KF: Tensor, ids_1K: Tensor, weights_1K: Tensor, w_down: AwqWeights,
                   tiles: OneTokenTiles = ONE_TOKEN_TILES) -> Tensor:
    """out_1D: the K experts' down projections of act_KF, weighted and summed in expert order (one kernel)."""
    _, width, hidden = w_down.shape()
    top_k = act_KF.shape[0]
    assert act_KF.shape[1] == width and act_KF.is_contiguous() and weights_1K.is_contiguous()
    assert w_down.group % tiles.down_f == 0 and tiles.down_o % AWQ_PACK == 0
    out_1D = act_KF.new_empty(1, hidden)
    f_split, splits = _splits(width, tiles.step(tiles.down_f, w_down.group), tiles.down_splits)
    grid = (triton.cdiv(hidden, tiles.down_o), top_k, splits)
    # Every program stores partials: the last of a column block's K x splits sums them.
    partials, counters = _split_buffers(act_KF.device, splits, top_k, hidden, grid[0], _DOWN_COUNTERS)
    _one_token_down_kernel[grid](
        act_KF, ids_1K, weights_1K, w_down.qweight, w_down.qzeros, w_down.scales, out_1D, partials, counters,
        *w_down.expert_strides(), f_split, HIDDEN=hidden, WIDTH=width, TOP_K=top_k, GROUP=w_down.group,
        BLOCK_O=tiles.down_o, BLOCK_F=tiles.down_f, SPLITS=splits, PDL=uses_pdl(ids_1K),
        GROUPS=tiles.gemv == "groups", ONE_GROUP=tiles.gemv == "groups" and f_split == w_down.group,
        num_warps=tiles.down_warps, num_stages=1, launch_pdl=uses_pdl(ids_1K))
    return out_1D


def one_token_experts(x_1D: Tensor, ids_1K: Tensor, weights_1K: Tensor, w_gate_up: AwqWeights, w_down: AwqWeights,
                      tiles: OneTokenTiles = ONE_TOKEN_TILES) -> Tensor:
    """One token's MoE output from its routing (routing.gate_route's ids_1K, weights_1K)."""
    return one_token_down(one_token_gate_up(x_1D, ids_1K, w_gate_up, tiles), ids_1K, weights_1K, w_down, tiles)
