"""The experts of the MoE in block FP8 (issue 29): moe_gemm's grouped GEMMs and moe_small's one-token kernels.

The same layouts, grids and roundings as the bf16 kernels they mirror, with the
experts' weights in block FP8 (quant_fp8.py):

- w_gate_up_EGD float8 [E, 2F, D] (each expert's gate rows, then its up rows) with
  s_gate_up [E, 2 * ceil(F/128), ceil(D/128)]: the gate rows' block scales, then the
  up rows' (each half blocked on its own; the plain block layout of [2F, D] when F
  is a multiple of 128, as in every released Qwen3-MoE).
- w_down_EDF float8 [E, D, F] with s_down [E, ceil(D/128), ceil(F/128)].

- gate_up / down: moe_gemm's grouped GEMMs over moe_align's segments, kernel "fp8"
  (the tensor cores; x and act quantized per token and 128-channel group) or
  "weight-only" (the weights widened to the activations' dtype).
- one_token_gate_up / one_token_down: batch-1 decode's per-expert GEMVs on the CUDA
  cores (moe_small's one-token kernels' grids, PDL launches), down summing the K
  weighted outputs itself in increasing expert order.
- grouped_moe: moe_grouped.grouped_moe on these (route, align, gate_up, down, combine);
  sorted_experts: moe_gemm.sorted_experts on these (the dispatch path's rows).

Legend as in moe_dispatch.py: T tokens, D hidden, F expert width, G = 2F, E experts,
K experts per token, R = T * K routed rows, P padded positions; Db, Fb: 128-blocks.
"""

import triton
import triton.language as tl
from torch import Tensor

from services.model.kernels import moe_align, moe_gemm, moe_grouped
from services.model.kernels.launch import uses_pdl, wait_for_previous_kernel
from services.model.kernels.moe_gemm import GemmBlocks, MoEConfig, _block_rows, _grid
from services.model.kernels.moe_small import MoeTiles
from services.model.kernels.quant_fp8 import (BLOCK, FP8_BLOCK, WEIGHT_ONLY_MAX_ROWS, fp8_block_dot, fp8_gemv_rows,
                                              gemv_stages, load_fp8, native_fp8, quantize_act, tile_scale_rows,
                                              tile_scales, weight_arg)
from services.model.layers import AddNorm


@triton.jit
def silu_mul(acc_gate, acc_up, dtype: tl.constexpr):
    """SiLU(gate) * up, each intermediate rounded to dtype as moe_experts.experts rounds it."""
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    return (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up


@triton.jit
def _gate_up_kernel(x_ptr, xs_ptr, sorted_ids_ptr, starts_ptr, counts_ptr, ends_ptr, w_ptr, s_ptr, act_ptr,
                    num_experts, hidden, width, x_stride, up_scale_row, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, TILES_FIRST: tl.constexpr, A_FP8: tl.constexpr,
                    NATIVE: tl.constexpr):
    expert, p, row_mask, r = _block_rows(sorted_ids_ptr, starts_ptr, counts_ptr, ends_ptr, num_experts,
                                         BLOCK_M, BLOCK_E, TILES_FIRST)
    if expert >= num_experts:
        return
    f0 = (tl.program_id(0) if TILES_FIRST else tl.program_id(1)) * BLOCK_N
    f = f0 + tl.arange(0, BLOCK_N)
    f_mask = f < width
    d_blocks = tl.cdiv(hidden, BLOCK)
    token = (r // TOP_K).to(tl.int64)
    x_rows = x_ptr + token * x_stride
    xs_rows = xs_ptr + token * d_blocks
    w_gate = w_ptr + expert.to(tl.int64) * 2 * width * hidden + f.to(tl.int64) * hidden
    w_up = w_gate + width * hidden
    # Gate's block-scale rows, then up's (up_scale_row blocks further).
    s_gate = tile_scale_rows(s_ptr + expert.to(tl.int64) * 2 * up_scale_row * d_blocks, f0, f, d_blocks, BLOCK_N)
    s_up = s_gate + up_scale_row * d_blocks
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for d0 in range(0, hidden, BLOCK):  # fp8_block_dot's step, for gate and up at once (x read once)
        d = d0 + tl.arange(0, BLOCK)
        wm = f_mask[:, None] & (d < hidden)[None, :]
        x = tl.load(x_rows[:, None] + d[None, :], mask=row_mask[:, None] & (d < hidden)[None, :], other=0.0)
        sg, su = tile_scales(s_gate, d0, f_mask, BLOCK_N <= BLOCK), tile_scales(s_up, d0, f_mask, BLOCK_N <= BLOCK)
        if A_FP8:
            xs = tl.load(xs_rows + d0 // BLOCK, mask=row_mask, other=0.0)[:, None]
            wg = tl.load(w_gate[:, None] + d[None, :], mask=wm, other=0.0)
            wu = tl.load(w_up[:, None] + d[None, :], mask=wm, other=0.0)
            acc_gate += tl.dot(x, tl.trans(wg)) * (xs * sg)
            acc_up += tl.dot(x, tl.trans(wu)) * (xs * su)
        else:
            wg = load_fp8(w_gate[:, None] + d[None, :], wm, NATIVE).to(x.dtype)
            wu = load_fp8(w_up[:, None] + d[None, :], wm, NATIVE).to(x.dtype)
            acc_gate += tl.dot(x, tl.trans(wg), input_precision="ieee") * sg
            acc_up += tl.dot(x, tl.trans(wu), input_precision="ieee") * su
    act = silu_mul(acc_gate, acc_up, act_ptr.dtype.element_ty)
    tl.store(act_ptr + p.to(tl.int64)[:, None] * width + f[None, :], act.to(act_ptr.dtype.element_ty),
             mask=f_mask[None, :])


@triton.jit
def _down_kernel(act_ptr, acts_ptr, sorted_ids_ptr, starts_ptr, counts_ptr, ends_ptr, w_ptr, s_ptr, y_ptr,
                 num_experts, hidden, width, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
                 TILES_FIRST: tl.constexpr, A_FP8: tl.constexpr, NATIVE: tl.constexpr):
    expert, p, row_mask, r = _block_rows(sorted_ids_ptr, starts_ptr, counts_ptr, ends_ptr, num_experts,
                                         BLOCK_M, BLOCK_E, TILES_FIRST)
    if expert >= num_experts:
        return
    o0 = (tl.program_id(0) if TILES_FIRST else tl.program_id(1)) * BLOCK_N
    o = o0 + tl.arange(0, BLOCK_N)
    o_mask = o < hidden
    f_blocks = tl.cdiv(width, BLOCK)
    s_expert = s_ptr + expert.to(tl.int64) * tl.cdiv(hidden, BLOCK) * f_blocks
    w_rows = w_ptr + expert.to(tl.int64) * hidden * width + o.to(tl.int64) * width
    acc = fp8_block_dot(tl.zeros([BLOCK_M, BLOCK_N], tl.float32), act_ptr + p.to(tl.int64) * width, row_mask,
                        acts_ptr + p.to(tl.int64) * f_blocks, w_rows, o_mask,
                        tile_scale_rows(s_expert, o0, o, f_blocks, BLOCK_N), 0, width, A_FP8, NATIVE, BLOCK_N <= BLOCK)
    tl.store(y_ptr + r.to(tl.int64)[:, None] * hidden + o[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_mask[:, None] & o_mask[None, :])


# Shared memory the pipelined loads of one program may take (an H200 has 227 KB a block).
SHARED_MEMORY_BUDGET = 192 * 1024


def _check_kernel(kernel: str) -> None:
    if kernel not in ("fp8", "weight-only"):
        raise ValueError(f"kernel must be 'fp8' or 'weight-only', not {kernel!r}")


def _stages(tile: GemmBlocks, block_m: int, a_bytes: int, num_weights: int) -> int:
    """tile.num_stages, fewer where the stages' loads would not fit SHARED_MEMORY_BUDGET: moe_gemm's
    tiles step 64 columns where these step 128, and weight-only steps carry 2-byte activations."""
    stage_bytes = FP8_BLOCK * (block_m * a_bytes + num_weights * tile.block_n)
    return max(1, min(tile.num_stages, SHARED_MEMORY_BUDGET // stage_bytes))


def gate_up(x_TD: Tensor, a: moe_align.Alignment, w_gate_up_EGD: Tensor, s_gate_up: Tensor, top_k: int,
            tile: GemmBlocks, tiles_first: bool = True, kernel: str = "fp8", native: bool | None = None) -> Tensor:
    """moe_gemm.gate_up on block-FP8 experts: act_PF in x's dtype (tile.block_k unused: one 128 block a step).
    native: quant_fp8.weight_arg's (None: the device's)."""
    _check_kernel(kernel)
    num_experts, double_width, hidden = w_gate_up_EGD.shape
    width = double_width // 2
    up_scale_row = triton.cdiv(width, FP8_BLOCK)
    assert x_TD.stride(1) == 1 and w_gate_up_EGD.is_contiguous() and s_gate_up.is_contiguous()
    assert s_gate_up.shape == (num_experts, 2 * up_scale_row, triton.cdiv(hidden, FP8_BLOCK)), s_gate_up.shape
    act_PF = x_TD.new_empty(a.sorted_ids_P.shape[0], width)
    num_blocks = a.sorted_ids_P.shape[0] // a.block_m
    if num_blocks:
        a_fp8 = kernel == "fp8"
        xq_TD, xs_TDb = quantize_act(x_TD) if a_fp8 else (x_TD, x_TD)
        _gate_up_kernel[_grid(num_blocks, triton.cdiv(width, tile.block_n), tiles_first)](
            xq_TD, xs_TDb, a.sorted_ids_P, a.starts_E, a.counts_E, a.ends_E,
            w_gate_up_EGD if a_fp8 else weight_arg(w_gate_up_EGD, native), s_gate_up, act_PF, num_experts, hidden,
            width, xq_TD.stride(0), up_scale_row, TOP_K=top_k, BLOCK_M=a.block_m, BLOCK_N=tile.block_n,
            BLOCK_E=triton.next_power_of_2(num_experts), TILES_FIRST=tiles_first, A_FP8=a_fp8,
            NATIVE=native_fp8(x_TD.device) if native is None else native, num_warps=tile.num_warps,
            num_stages=_stages(tile, a.block_m, xq_TD.element_size(), 2))
    return act_PF


def down(act_PF: Tensor, a: moe_align.Alignment, w_down_EDF: Tensor, s_down: Tensor, num_routed: int,
         tile: GemmBlocks, tiles_first: bool = True, kernel: str = "fp8", native: bool | None = None) -> Tensor:
    """moe_gemm.down on block-FP8 experts: y_RD, each position's output at its routed row."""
    _check_kernel(kernel)
    num_experts, hidden, width = w_down_EDF.shape
    assert act_PF.is_contiguous() and w_down_EDF.is_contiguous() and s_down.is_contiguous()
    assert s_down.shape == (num_experts, triton.cdiv(hidden, FP8_BLOCK), triton.cdiv(width, FP8_BLOCK)), s_down.shape
    y_RD = act_PF.new_empty(num_routed, hidden)
    num_blocks = a.sorted_ids_P.shape[0] // a.block_m
    if num_blocks:
        a_fp8 = kernel == "fp8"
        aq_PF, as_PFb = quantize_act(act_PF) if a_fp8 else (act_PF, act_PF)
        _down_kernel[_grid(num_blocks, triton.cdiv(hidden, tile.block_n), tiles_first)](
            aq_PF, as_PFb, a.sorted_ids_P, a.starts_E, a.counts_E, a.ends_E,
            w_down_EDF if a_fp8 else weight_arg(w_down_EDF, native), s_down, y_RD, num_experts, hidden, width,
            BLOCK_M=a.block_m, BLOCK_N=tile.block_n, BLOCK_E=triton.next_power_of_2(num_experts),
            TILES_FIRST=tiles_first, A_FP8=a_fp8, NATIVE=native_fp8(act_PF.device) if native is None else native,
            num_warps=tile.num_warps,
            num_stages=_stages(tile, a.block_m, aq_PF.element_size(), 1))
    return y_RD


def default_config(num_tokens: int) -> MoEConfig:
    """The FP8 GEMMs' tiles for a step of num_tokens: moe_gemm.default_config's (swept for bf16)
    except where bench/kernels/fp8_moe_sweep.py found FP8's own faster (Qwen3-30B-A3B's shape,
    H200 and H100): 64 columns, 4 warps and 4 stages a gate_up tile, 16 rows a block around 256
    tokens and 64 for prefill-sized steps, there with down's tiles 128 columns wide in 3 stages;
    past 4,096 tokens 128-row blocks of two warpgroups with 128-column tiles."""
    config = moe_gemm.default_config(num_tokens)
    narrow = GemmBlocks(64, FP8_BLOCK, 4, 4)
    if 128 < num_tokens <= 256:
        return MoEConfig(16, narrow, narrow, config.tiles_first)
    if num_tokens > 4096:
        wide = GemmBlocks(128, FP8_BLOCK, 8, 3)
        return MoEConfig(128, wide, wide, config.tiles_first)
    if num_tokens > 512:
        return MoEConfig(64, narrow, GemmBlocks(128, FP8_BLOCK, 4, 3), config.tiles_first)
    return config


def grouped_moe(x_TD: Tensor, w_gate_ED: Tensor, w_gate_up_EGD: Tensor, s_gate_up: Tensor, w_down_EDF: Tensor,
                s_down: Tensor, top_k: int, norm_topk_prob: bool, hit_counts_E: Tensor, config: MoEConfig | None = None,
                kernel: str = "fp8", add_norm: AddNorm | None = None, native: bool | None = None) -> Tensor:
    """moe_grouped.grouped_moe with block-FP8 experts (the gate stays bf16); steps of up to
    WEIGHT_ONLY_MAX_ROWS tokens take the weight-only GEMMs whatever `kernel` says."""
    num_experts, num_tokens = w_gate_ED.shape[0], x_TD.shape[0]
    assert w_gate_up_EGD.shape[0] == w_down_EDF.shape[0] == num_experts, "no spare slots here"
    kernel = "weight-only" if num_tokens <= WEIGHT_ONLY_MAX_ROWS else kernel
    config = config or default_config(num_tokens)
    ids_TK, weights_TK, counts_CE = moe_grouped.route(x_TD, w_gate_ED, top_k, norm_topk_prob, hit_counts_E)
    a = moe_align.align(ids_TK, num_experts, config.block_m, chunk_counts=counts_CE)
    act_PF = gate_up(x_TD, a, w_gate_up_EGD, s_gate_up, top_k, config.gate_up, config.tiles_first, kernel, native)
    y_RD = down(act_PF, a, w_down_EDF, s_down, ids_TK.numel(), config.down, config.tiles_first, kernel, native)
    if add_norm is None:
        return moe_grouped.combine(y_RD, None, weights_TK)
    return moe_grouped.combine_add_norm(y_RD, weights_TK, add_norm)


def sorted_experts(x_PD: Tensor, offsets_L: Tensor, w_gate_up_LGD: Tensor, s_gate_up: Tensor, w_down_LDF: Tensor,
                   s_down: Tensor, config: MoEConfig | None = None, kernel: str = "fp8",
                   native: bool | None = None) -> Tensor:
    """moe_gemm.sorted_experts (the dispatch path's rows, already sorted by local expert; rows past
    offsets_L[-1] neither read nor written) on block-FP8 experts; `kernel` as the caller picks it."""
    num_rows, num_local = x_PD.shape[0], offsets_L.shape[0]
    config = config or default_config(16 * num_rows // num_local)
    a = moe_align.segments(offsets_L, num_rows, config.block_m)
    act_PF = gate_up(x_PD, a, w_gate_up_LGD, s_gate_up, 1, config.gate_up, config.tiles_first, kernel, native)
    return down(act_PF, a, w_down_LDF, s_down, num_rows, config.down, config.tiles_first, kernel, native)


@triton.jit
def _one_token_gate_up_kernel(x_ptr, ids_ptr, w_ptr, s_ptr, act_ptr, HIDDEN: tl.constexpr, WIDTH: tl.constexpr,
                              BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr,
                              STAGES: tl.constexpr):
    """act[k, f] = SiLU(gate) * up of the token's k-th expert, gate and up rows f on the CUDA cores.
    PDL: waits for gate_route's ids, then lets the down kernel start. STAGES: fp8_gemv_rows'."""
    f_block, k = tl.program_id(0), tl.program_id(1)
    if PDL:
        wait_for_previous_kernel()
    expert = tl.load(ids_ptr + k).to(tl.int64)
    f = f_block * BLOCK_F + tl.arange(0, BLOCK_F)
    f_mask = f < WIDTH
    d_blocks: tl.constexpr = (HIDDEN + BLOCK - 1) // BLOCK
    up_scale_row: tl.constexpr = (WIDTH + BLOCK - 1) // BLOCK
    w_gate = w_ptr + expert * 2 * WIDTH * HIDDEN + f.to(tl.int64) * HIDDEN
    s_gate = s_ptr + expert * 2 * up_scale_row * d_blocks + (f_block * BLOCK_F // BLOCK) * d_blocks
    gate = fp8_gemv_rows(x_ptr, w_gate, f_mask, s_gate, 0, HIDDEN, BLOCK_F, BLOCK_D, NATIVE, STAGES)
    up = fp8_gemv_rows(x_ptr, w_gate + WIDTH * HIDDEN, f_mask, s_gate + up_scale_row * d_blocks, 0, HIDDEN, BLOCK_F,
                       BLOCK_D, NATIVE, STAGES)
    act = silu_mul(gate, up, act_ptr.dtype.element_ty)
    tl.store(act_ptr + k * WIDTH + f, act.to(act_ptr.dtype.element_ty), mask=f_mask)


@triton.jit
def _scaled_act(act_ptr, s_rows, k, k_mask, f, WIDTH: tl.constexpr):
    """fp32 [BLOCK_K, BLOCK_F]: act[k, f] times expert k's down scale of f's block (s_rows: each expert's row)."""
    mask = k_mask[:, None] & (f < WIDTH)[None, :]
    act = tl.load(act_ptr + k[:, None] * WIDTH + f[None, :], mask=mask, other=0.0).to(tl.float32)
    return act * tl.load(s_rows[:, None] + f[None, :] // BLOCK, mask=mask, other=0.0)


@triton.jit
def _down_step(acc, act_ptr, w_rows, ko_mask, s_rows, k, k_mask, f0, WIDTH: tl.constexpr, BLOCK_F: tl.constexpr,
               NATIVE: tl.constexpr):
    """acc [BLOCK_K, BLOCK_O, BLOCK_F] + every expert's weights of columns f0 + [0, BLOCK_F) times its scaled act."""
    f = f0 + tl.arange(0, BLOCK_F)
    w = load_fp8(w_rows[:, :, None] + f[None, None, :], ko_mask & (f < WIDTH)[None, None, :], NATIVE)
    return acc + w * _scaled_act(act_ptr, s_rows, k, k_mask, f, WIDTH)[:, None, :]


@triton.jit
def _one_token_down_kernel(act_ptr, ids_ptr, weights_ptr, w_ptr, s_ptr, out_ptr, HIDDEN: tl.constexpr,
                           WIDTH: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_O: tl.constexpr,
                           BLOCK_F: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr, STAGES: tl.constexpr):
    """out[o] = sum over k of weight_k * (act[k] @ w_down[ids[k], o]) for a block of output columns,
    as moe_small's one-token down: every expert's rows in one [BLOCK_K, BLOCK_O, BLOCK_F] tile a
    step (each expert's block scale folded into its act), then the K outputs rounded, weighted,
    rounded and summed in order k. PDL: the first step's weights load during gate_up, then it
    waits for gate_up's act (ids are final once gate_up runs). STAGES > 0: the loop after the first
    step pipelined that deep (quant_fp8.GEMV_PIPELINED), else a plain loop."""
    o_block = tl.program_id(0)
    o = o_block * BLOCK_O + tl.arange(0, BLOCK_O)
    k = tl.arange(0, BLOCK_K)
    k_mask = k < TOP_K
    experts = tl.load(ids_ptr + k, mask=k_mask, other=0).to(tl.int64)
    w_rows = w_ptr + (experts[:, None] * HIDDEN + o[None, :]) * WIDTH  # [BLOCK_K, BLOCK_O]
    ko_mask = (k_mask[:, None] & (o < HIDDEN)[None, :])[:, :, None]
    f_blocks: tl.constexpr = (WIDTH + BLOCK - 1) // BLOCK
    s_rows = s_ptr + (experts * ((HIDDEN + BLOCK - 1) // BLOCK) + o_block * BLOCK_O // BLOCK) * f_blocks  # [BLOCK_K]
    f = tl.arange(0, BLOCK_F)
    w = load_fp8(w_rows[:, :, None] + f[None, None, :], ko_mask & (f < WIDTH)[None, None, :], NATIVE)
    if PDL:  # the first step's weights are on their way: now wait for gate_up's act
        wait_for_previous_kernel()
    acc = w * _scaled_act(act_ptr, s_rows, k, k_mask, f, WIDTH)[:, None, :]
    if STAGES > 0:
        for f0 in tl.range(BLOCK_F, WIDTH, BLOCK_F, num_stages=STAGES):
            acc = _down_step(acc, act_ptr, w_rows, ko_mask, s_rows, k, k_mask, f0, WIDTH, BLOCK_F, NATIVE)
    else:
        for f0 in range(BLOCK_F, WIDTH, BLOCK_F):
            acc = _down_step(acc, act_ptr, w_rows, ko_mask, s_rows, k, k_mask, f0, WIDTH, BLOCK_F, NATIVE)
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
    y = (tl.sum(acc, 2).to(dtype).to(tl.float32) * weight[:, None]).to(dtype).to(tl.float32)  # [BLOCK_K, BLOCK_O]
    total = tl.zeros([BLOCK_O], tl.float32)
    for kk in tl.static_range(TOP_K):  # in order, as moe_dispatch.combine sums
        total += tl.sum(tl.where(k[:, None] == kk, y, 0.0), 0)
    tl.store(out_ptr + o, total.to(dtype), mask=o < HIDDEN)


# One token's tiles (MoeTiles' one-token fields): gate_up_f and down_o divide 128 (one scale row a
# program). gate_up reads a whole row of 2,048 in one step, as moe_small's bf16 tiles do, and down
# 256 columns a step: the fastest plain-loop tiles of an H100 sweep (docs/performance.md).
ONE_TOKEN_TILES = MoeTiles(gate_up_f=4, gate_up_d=2048, gate_up_stages=3, gate_up_warps=4, down_o=4, down_f=256,
                           down_warps=4, one_token=True, down_stages=4)


def one_token_gate_up(x_1D: Tensor, ids_1K: Tensor, w_gate_up_EGD: Tensor, s_gate_up: Tensor,
                      tiles: MoeTiles = ONE_TOKEN_TILES, native: bool | None = None) -> Tensor:
    """act_KF: SiLU(gate) * up of x_1D through each of its K experts (moe_small.one_token_gate_up)."""
    hidden, (top_k, width) = x_1D.shape[1], (ids_1K.shape[1], w_gate_up_EGD.shape[1] // 2)
    assert x_1D.shape[0] == 1 and x_1D.is_contiguous() and ids_1K.is_contiguous() and w_gate_up_EGD.is_contiguous()
    assert FP8_BLOCK % tiles.gate_up_f == 0 and s_gate_up.is_contiguous()
    act_KF = x_1D.new_empty(top_k, width)
    _one_token_gate_up_kernel[(triton.cdiv(width, tiles.gate_up_f), top_k)](
        x_1D, ids_1K, weight_arg(w_gate_up_EGD, native), s_gate_up, act_KF, HIDDEN=hidden, WIDTH=width,
        BLOCK_F=tiles.gate_up_f, BLOCK_D=tiles.gate_up_d, NATIVE=native_fp8(x_1D.device) if native is None else native,
        PDL=uses_pdl(x_1D), STAGES=gemv_stages(tiles.gate_up_stages),
        num_warps=tiles.gate_up_warps, num_stages=tiles.gate_up_stages, launch_pdl=uses_pdl(x_1D))
    return act_KF


def one_token_down(act_KF: Tensor, ids_1K: Tensor, weights_1K: Tensor, w_down_EDF: Tensor, s_down: Tensor,
                   tiles: MoeTiles = ONE_TOKEN_TILES, native: bool | None = None) -> Tensor:
    """out_1D: the K experts' down projections of act_KF, weighted and summed in expert order."""
    (top_k, width), hidden = act_KF.shape, w_down_EDF.shape[1]
    assert act_KF.is_contiguous() and w_down_EDF.is_contiguous() and s_down.is_contiguous()
    assert FP8_BLOCK % tiles.down_o == 0 and weights_1K.is_contiguous()
    out_1D = act_KF.new_empty(1, hidden)
    _one_token_down_kernel[(triton.cdiv(hidden, tiles.down_o),)](
        act_KF, ids_1K, weights_1K, weight_arg(w_down_EDF, native), s_down, out_1D, HIDDEN=hidden, WIDTH=width,
        TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_O=tiles.down_o, BLOCK_F=tiles.down_f,
        NATIVE=native_fp8(act_KF.device) if native is None else native, PDL=uses_pdl(ids_1K),
        STAGES=gemv_stages(tiles.down_stages), num_warps=tiles.down_warps, num_stages=tiles.down_stages,
        launch_pdl=uses_pdl(ids_1K))
    return out_1D


def one_token_experts(x_1D: Tensor, ids_1K: Tensor, weights_1K: Tensor, w_gate_up_EGD: Tensor, s_gate_up: Tensor,
                      w_down_EDF: Tensor, s_down: Tensor, tiles: MoeTiles = ONE_TOKEN_TILES,
                      native: bool | None = None) -> Tensor:
    """One token's MoE output from its routing (routing.gate_route's ids_1K, weights_1K)."""
    act_KF = one_token_gate_up(x_1D, ids_1K, w_gate_up_EGD, s_gate_up, tiles, native)
    return one_token_down(act_KF, ids_1K, weights_1K, w_down_EDF, s_down, tiles, native)
