"""Block-FP8 linear layers in Triton (issue 29): weight-only GEMV/GEMM and FP8 tensor-core GEMM.

The weights as the FP8 checkpoints store them (quant_ref.py): w_NK float8_e4m3fn,
one fp32 scale per 128 x 128 block s_NbKb (partial blocks at the edges); y = x @ (w * s)^T.

- Weight-only (any GPU; the small steps of every GPU): the float8 weights are
  widened in registers and scaled per block, the activations stay as they are.
  One row (batch-1 decode): a GEMV on the CUDA cores reading each weight row
  once, the scale folded into x per 128 columns (one scale row per program:
  BLOCK_N divides 128). More rows: tl.dot on the activations' dtype (float8
  widens exactly to bf16) per 128-column step, each step's fp32 result times
  its block's scales. split_k spreads a skinny product over more programs
  (fp32 partials summed by torch: the same bits every run).
- FP8 tensor cores (compute capability 8.9+; prefill and big decode batches):
  the activations quantized per token and 128-channel group (quantize_act),
  tl.dot on float8 operands with fp32 accumulation, each 128-column step's
  result times the rows' activation scales and the columns' weight scales.

Below compute capability 8.9 Triton refuses the float8e4nv type even as a
pointer, so there the weights go in as their raw bytes and load_fp8 decodes
them (native_fp8). NaN codes (0x7f, 0xff) decode as 480: the loader refuses
NaN weights anyway.

Legend: M rows (tokens), N output features, K input features, Nb = ceil(N/128), Kb = ceil(K/128).
"""

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from services.model.kernels.launch import uses_pdl, wait_for_previous_kernel
from services.model.kernels.quant_ref import E4M3_MAX, FP8_BLOCK

BLOCK = tl.constexpr(FP8_BLOCK)
_E4M3_MAX = tl.constexpr(E4M3_MAX)
# Steps of at most this many rows take the weight-only kernels whatever the GPU: they read
# the weights once, and quantizing so few activations would cost more than it saves.
WEIGHT_ONLY_MAX_ROWS = 16
# Rows per program of quantize_act.
QUANT_ROWS = 16
# The one-row GEMV's long rows (see default_tiles).
LONG_ROW = 4096
# The one-row GEMVs' loops (fp8_gemv_rows, here and in quant_fp8_moe's one-token gate_up): False, a plain loop
# whose steps each wait for their loads; True, pipelined as deep as the launch's stages (static estimates only,
# bench/kernels/sass_stats.py; not yet measured).
GEMV_PIPELINED = False


def gemv_stages(stages: int) -> int:
    """fp8_gemv_rows' STAGES for a launch of `stages` (GEMV_PIPELINED's choice)."""
    return stages if GEMV_PIPELINED else 0


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def native_fp8(device: torch.device) -> bool:
    """Whether Triton takes float8e4nv on this device (compute capability 8.9+; the CPU interpreter too)."""
    return device.type != "cuda" or _capability(device) >= (8, 9)


def weight_arg(w: Tensor, native: bool | None = None) -> Tensor:
    """w as a kernel takes it: itself where Triton has float8 (native), its raw bytes elsewhere."""
    native = native_fp8(w.device) if native is None else native
    return w if native else w.view(torch.uint8)


@triton.jit
def load_fp8(ptrs, mask, NATIVE: tl.constexpr):
    """fp32 values of float8_e4m3fn weights: loaded as float8 (NATIVE), or as raw bytes and
    decoded: normal codes rebias their exponent (7 -> 127) into fp32 bits, subnormal ones are
    mantissa * 2^-9."""
    # if/else, not an early return: the compiler (unlike the interpreter) still builds the code
    # after a returning branch, and a float8 pointer cannot take the byte path's integer `other`.
    if NATIVE:
        out = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        bits = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
        mag = bits & 0x7F
        normal = ((mag + (120 << 3)) << 20).to(tl.float32, bitcast=True)
        value = tl.where((mag >> 3) == 0, mag.to(tl.float32) * 0.001953125, normal)
        out = tl.where(bits >= 128, -value, value)
    return out


@triton.jit
def _scaled_x(x_ptr, w_scale_row, k, k_mask):
    """fp32 x[k] times the scales of k's blocks."""
    x = tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
    return x * tl.load(w_scale_row + k // BLOCK, mask=k_mask, other=0.0)


@triton.jit
def _fp8_gemv_step(acc, x_ptr, w_rows, n_mask, w_scale_row, k0, k_end, BLOCK_K: tl.constexpr, NATIVE: tl.constexpr):
    """acc [BLOCK_N, BLOCK_K] + the weights of columns k0 + [0, BLOCK_K) times x scaled by their blocks."""
    k = k0 + tl.arange(0, BLOCK_K)
    k_mask = k < k_end
    x = _scaled_x(x_ptr, w_scale_row, k, k_mask)
    return acc + load_fp8(w_rows[:, None] + k[None, :], n_mask[:, None] & k_mask[None, :], NATIVE) * x[None, :]


@triton.jit
def fp8_gemv_rows(x_ptr, w_rows, n_mask, w_scale_row, k_start, k_end, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, NATIVE: tl.constexpr, STAGES: tl.constexpr = 0, PDL: tl.constexpr = False):
    """fp32 [BLOCK_N]: weight rows (w_rows: each row's start; all rows in the 128-row block whose
    scales start at w_scale_row) dotted with x[k_start:k_end], on the CUDA cores. STAGES > 0: the
    loop pipelined that deep (cp.async into shared memory, as gemv.gemv_rows), so a step's loads
    do not wait out the memory latency; 0: a plain loop (GEMV_STAGES). PDL: waits for the previous
    kernel (which writes x), the plain loop's first weights loaded before."""
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    if STAGES > 0:
        if PDL:
            wait_for_previous_kernel()
        for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
            acc = _fp8_gemv_step(acc, x_ptr, w_rows, n_mask, w_scale_row, k0, k_end, BLOCK_K, NATIVE)
    else:
        loop_start = k_start
        if PDL:
            k = k_start + tl.arange(0, BLOCK_K)
            k_mask = k < k_end
            w = load_fp8(w_rows[:, None] + k[None, :], n_mask[:, None] & k_mask[None, :], NATIVE)
            wait_for_previous_kernel()
            acc += w * _scaled_x(x_ptr, w_scale_row, k, k_mask)[None, :]
            loop_start = k_start + BLOCK_K
        for k0 in range(loop_start, k_end, BLOCK_K):
            acc = _fp8_gemv_step(acc, x_ptr, w_rows, n_mask, w_scale_row, k0, k_end, BLOCK_K, NATIVE)
    return tl.sum(acc, 1)


@triton.jit
def tile_scale_rows(scale_ptr, first, rows, row_stride, BLOCK_N: tl.constexpr):
    """The block-scale rows of a tile's weight rows (first: the tile's first, rows: each; row_stride
    the scales of one 128-row block): a tile of at most 128 rows starts at a multiple of its height,
    so it lies in one block and takes that block's row (fp8_block_dot's W_SCALE_TILE), else each row's."""
    if BLOCK_N <= BLOCK:
        scale_rows = scale_ptr + (first // BLOCK) * row_stride
    else:
        scale_rows = scale_ptr + (rows // BLOCK) * row_stride
    return scale_rows


@triton.jit
def tile_scales(scale_rows, k0, w_mask, W_SCALE_TILE: tl.constexpr):
    """The weight rows' block scales of the 128-column step at k0 (scale_rows: tile_scale_rows'): one
    number where the tile lies in one 128-row block (W_SCALE_TILE), else a [1, BN] row, each row's."""
    if W_SCALE_TILE:
        scales = tl.load(scale_rows + k0 // BLOCK)
    else:
        scales = tl.load(scale_rows + k0 // BLOCK, mask=w_mask, other=0.0)[None, :]
    return scales


@triton.jit
def fp8_block_dot(acc, a_rows, a_mask, a_scale_rows, w_rows, w_mask, w_scale_rows, k_start, k_end,
                  A_FP8: tl.constexpr, NATIVE: tl.constexpr, W_SCALE_TILE: tl.constexpr):
    """acc [BM, BN] + a[rows, k_start:k_end] @ W[rows, k_start:k_end]^T in steps of one 128-column
    block (k_start a multiple of 128): A_FP8, both float8 on the tensor cores, each step times
    a's row scales (a_scale_rows: each row's first) and the weight rows' block scales
    (w_scale_rows: each row's block's first; W_SCALE_TILE: the tile's rows lie in one 128-row
    block and w_scale_rows is that block's first, one scale a step, folded into a's row scales:
    one multiply-add an element); else the weights widened to a's dtype. A float8 dot
    accumulates at the tensor cores' reduced precision (Triton's default on sm90), so each block's
    result is promoted into the fp32 acc: 128-column promotions keep that error small."""
    for k0 in range(k_start, k_end, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        k_mask = k < k_end
        a = tl.load(a_rows[:, None] + k[None, :], mask=a_mask[:, None] & k_mask[None, :], other=0.0)
        w_scale = tile_scales(w_scale_rows, k0, w_mask, W_SCALE_TILE)
        if A_FP8:
            w = tl.load(w_rows[:, None] + k[None, :], mask=w_mask[:, None] & k_mask[None, :], other=0.0)
            a_scale = tl.load(a_scale_rows + k0 // BLOCK, mask=a_mask, other=0.0)[:, None]
            if W_SCALE_TILE:
                acc += tl.dot(a, tl.trans(w)) * (a_scale * w_scale)
            else:
                acc += tl.dot(a, tl.trans(w)) * a_scale * w_scale
        else:
            w = load_fp8(w_rows[:, None] + k[None, :], w_mask[:, None] & k_mask[None, :], NATIVE).to(a.dtype)
            acc += tl.dot(a, tl.trans(w), input_precision="ieee") * w_scale
    return acc


@triton.jit
def _linear_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, y_ptr, num_rows, out_features, in_features, x_stride, k_split,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, A_FP8: tl.constexpr,
                   NATIVE: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    m_mask, n_mask = m < num_rows, n < out_features
    k_start = split * k_split
    k_end = tl.minimum(k_start + k_split, in_features)
    num_k_blocks = tl.cdiv(in_features, BLOCK)
    w_rows = w_ptr + n.to(tl.int64) * in_features
    if BLOCK_M == 1:  # one row on the CUDA cores
        w_scale_row = s_ptr + (tl.program_id(1) * BLOCK_N // BLOCK) * num_k_blocks
        acc = fp8_gemv_rows(x_ptr + tl.program_id(0).to(tl.int64) * x_stride, w_rows, n_mask, w_scale_row, k_start,
                            k_end, BLOCK_N, BLOCK_K, NATIVE, STAGES, PDL)[None, :]
    else:
        acc = fp8_block_dot(tl.zeros([BLOCK_M, BLOCK_N], tl.float32), x_ptr + m.to(tl.int64) * x_stride, m_mask,
                            xs_ptr + m * num_k_blocks, w_rows, n_mask,
                            tile_scale_rows(s_ptr, tl.program_id(1) * BLOCK_N, n, num_k_blocks, BLOCK_N),
                            k_start, k_end, A_FP8, NATIVE, BLOCK_N <= BLOCK)
    y_rows = y_ptr + (split * num_rows + m).to(tl.int64) * out_features  # split > 0: fp32 partials
    tl.store(y_rows[:, None] + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _quant_act_kernel(x_ptr, xq_ptr, xs_ptr, num_rows, in_features, x_stride, BLOCK_M: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    group = tl.program_id(1)
    k = group * BLOCK + tl.arange(0, BLOCK)
    mask = (m < num_rows)[:, None] & (k < in_features)[None, :]
    x = tl.load(x_ptr + m.to(tl.int64)[:, None] * x_stride + k[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    scale = tl.where(amax > 0, amax / _E4M3_MAX, 1.0)
    q = tl.clamp(x / scale[:, None], -_E4M3_MAX, _E4M3_MAX)
    tl.store(xq_ptr + m.to(tl.int64)[:, None] * in_features + k[None, :], q.to(xq_ptr.dtype.element_ty), mask=mask)
    tl.store(xs_ptr + m * tl.cdiv(in_features, BLOCK) + group, scale, mask=m < num_rows)


def quantize_act(x_MK: Tensor) -> tuple[Tensor, Tensor]:
    """(xq_MK float8_e4m3fn, xs_MKb fp32): x per token and 128-channel group, x ~ xq * xs, each group's
    largest |x| at 448 (quant_ref.quant_act_fp8). x's rows may have any stride, its columns contiguous."""
    num_rows, in_features = x_MK.shape
    assert x_MK.stride(1) == 1
    xq_MK = torch.empty(num_rows, in_features, dtype=torch.float8_e4m3fn, device=x_MK.device)
    xs_MKb = torch.empty(num_rows, triton.cdiv(in_features, FP8_BLOCK), dtype=torch.float32, device=x_MK.device)
    if num_rows:
        _quant_act_kernel[(triton.cdiv(num_rows, QUANT_ROWS), xs_MKb.shape[1])](
            x_MK, xq_MK, xs_MKb, num_rows, in_features, x_MK.stride(0), BLOCK_M=QUANT_ROWS, num_warps=4)
    return xq_MK, xs_MKb


# The tensor-core steps of at most this many rows take default_tiles' unsplit 64 x 64 tiles
# (faster than the split square tiles from 32 to 512 rows on an H100; docs/performance.md).
DECODE_TILE_MAX_ROWS = 512


@dataclasses.dataclass(frozen=True, slots=True)
class LinearTiles:
    """Launch shape of the FP8 linear kernel."""

    block_m: int  # rows per program; 1: the CUDA-core GEMV
    block_n: int  # output features per program (divides 128 for the GEMV: one scale row)
    block_k: int  # the GEMV's step (the tl.dot path steps one 128-column block)
    split_k: int  # programs along K (fp32 partials summed after)
    warps: int
    stages: int


def num_splits(num_programs: int, in_features: int, min_k: int) -> int:
    """Programs along K for a grid of num_programs output tiles: enough to fill an H200's 132 SMs
    about twice, each split at least min_k deep."""
    return max(1, min(264 // num_programs, triton.cdiv(in_features, min_k)))


def split_output(num_rows: int, out_features: int, in_features: int, step: int, splits: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[Tensor, int]:
    """(y [S, M, N], each split's depth, a multiple of step): S = 1 writes y in dtype, more write
    fp32 partials that sum_splits adds up (the same bits every run, unlike atomics)."""
    k_split = triton.cdiv(triton.cdiv(in_features, step), splits) * step
    count = triton.cdiv(in_features, k_split)
    y = torch.empty(count, num_rows, out_features, dtype=dtype if count == 1 else torch.float32, device=device)
    return y, k_split


def sum_splits(y: Tensor, dtype: torch.dtype) -> Tensor:
    """y_MN of split_output's y."""
    return y[0] if y.shape[0] == 1 else y.sum(0).to(dtype)


def default_tiles(num_rows: int, out_features: int, in_features: int, tensor_cores: bool) -> LinearTiles:
    """The tiles for a step: the GEMV for one row, skinny tl.dot tiles for up to
    WEIGHT_ONLY_MAX_ROWS, square tiles above; each split along K while its grid is small. The
    tensor cores take decode batches (up to DECODE_TILE_MAX_ROWS rows) in 64 x 64 tiles, never
    split: the split's fp32 partials and their sum cost more than the idle SMs of a small grid."""
    if num_rows == 1:
        # Rows of LONG_ROW columns or more: 4 rows a program in steps of half that (fewer, longer steps keep
        # more of a program's loads in flight); shorter rows 8 rows in steps of 512, where the longer steps
        # tied (the fastest of an H100 sweep: docs/performance.md).
        if in_features >= LONG_ROW:
            return LinearTiles(1, 4, LONG_ROW // 2, 1, 4, 1)
        return LinearTiles(1, 8, 512, 1, 4, 3)
    if num_rows <= WEIGHT_ONLY_MAX_ROWS:
        splits = num_splits(triton.cdiv(out_features, 32), in_features, 4 * FP8_BLOCK)
        return LinearTiles(16, 32, FP8_BLOCK, splits, 4, 4)
    if tensor_cores and num_rows <= DECODE_TILE_MAX_ROWS:
        return LinearTiles(64, 64, FP8_BLOCK, 1, 4, 4)
    block_m = 64 if num_rows <= 64 else 128
    programs = triton.cdiv(num_rows, block_m) * triton.cdiv(out_features, 128)
    return LinearTiles(block_m, 128, FP8_BLOCK, num_splits(programs, in_features, 4 * FP8_BLOCK),
                       8 if block_m == 128 and tensor_cores else 4, 4 if tensor_cores else 3)


def linear(x_MK: Tensor, w_NK: Tensor, s_NbKb: Tensor, kernel: str = "fp8", tiles: LinearTiles | None = None,
           native: bool | None = None) -> Tensor:
    """y_MN = x @ (w * s)^T in x's dtype. kernel "fp8" (quant_select: FP8 tensor cores there) takes them
    for steps of more than WEIGHT_ONLY_MAX_ROWS rows; "weight-only" never. native: see weight_arg."""
    if kernel not in ("fp8", "weight-only"):
        raise ValueError(f"kernel must be 'fp8' or 'weight-only', not {kernel!r}")
    num_rows, (out_features, in_features) = x_MK.shape[0], w_NK.shape
    tensor_cores = kernel == "fp8" and num_rows > WEIGHT_ONLY_MAX_ROWS
    tiles = tiles or default_tiles(num_rows, out_features, in_features, tensor_cores)
    if tensor_cores:
        xq_MK, xs_MKb = quantize_act(x_MK)
        return linear_tiled(xq_MK, xs_MKb, w_NK, s_NbKb, tiles, x_MK.dtype, native)
    return linear_tiled(x_MK, None, w_NK, s_NbKb, tiles, x_MK.dtype, native)


def linear_tiled(x_MK: Tensor, xs_MKb: Tensor | None, w_NK: Tensor, s_NbKb: Tensor, tiles: LinearTiles,
                 out_dtype: torch.dtype, native: bool | None = None) -> Tensor:
    """y_MN in out_dtype with these tiles: x float8 with its scales xs (the tensor cores), or x unquantized
    (xs None: weight-only). x's rows may have any stride, its columns contiguous."""
    num_rows, (out_features, in_features) = x_MK.shape[0], w_NK.shape
    assert x_MK.shape[1] == in_features and x_MK.stride(1) == 1 and w_NK.is_contiguous() and s_NbKb.is_contiguous()
    assert s_NbKb.shape == (triton.cdiv(out_features, FP8_BLOCK), triton.cdiv(in_features, FP8_BLOCK)), s_NbKb.shape
    assert tiles.block_m > 1 or FP8_BLOCK % tiles.block_n == 0, "a GEMV program's rows share one scale row"
    a_fp8 = xs_MKb is not None
    assert not a_fp8 or (tiles.block_m > 1 and x_MK.dtype == torch.float8_e4m3fn)
    y, k_split = split_output(num_rows, out_features, in_features, FP8_BLOCK, tiles.split_k, out_dtype, x_MK.device)
    if num_rows:
        grid = (triton.cdiv(num_rows, tiles.block_m), triton.cdiv(out_features, tiles.block_n), y.shape[0])
        pdl = tiles.block_m == 1 and uses_pdl(x_MK)  # the one-row GEMV
        _linear_kernel[grid](x_MK, x_MK if xs_MKb is None else xs_MKb, w_NK if a_fp8 else weight_arg(w_NK, native),
                             s_NbKb, y, num_rows, out_features, in_features, x_MK.stride(0), k_split,
                             BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, A_FP8=a_fp8,
                             NATIVE=native_fp8(x_MK.device) if native is None else native,
                             STAGES=gemv_stages(tiles.stages), PDL=pdl, num_warps=tiles.warps,
                             num_stages=tiles.stages, launch_pdl=pdl)
    return sum_splits(y, out_dtype)
