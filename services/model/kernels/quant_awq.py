"""AWQ 4-bit linear layers in Triton (issue 29): weight-only, dequantized in registers.

The weights as AWQ's "gemm" checkpoints store them (quant_ref.py): qweight [K, N/8]
int32 (eight 4-bit values an int32 in AWQ's interleaved order: column c of each 8
at bits 4 * [0, 4, 1, 5, 2, 6, 3, 7][c]), qzeros [K/G, N/8] packed the same way,
scales [K/G, N] fp16, G = 128; y = x @ W with W[k, n] = (q - z[k // G, n]) * s[k // G, n].

Each step of BLOCK_K rows (BLOCK_K divides G: one group a step) unpacks its
[BLOCK_K, BLOCK_N / 8] int32 tile to [BLOCK_K, BLOCK_N] values, subtracts the
group's zeros and leaves the scale out: q - z is a small integer, exact in
bf16, so the step is tl.dot(x, q - z) on the tensor cores (or, for one row, FMAs
on the CUDA cores) and its fp32 result times the group's scales; splits along K
are summed after. With 16-bit activations the tile is unpacked without an
integer-to-float conversion (awq_biased_tile: each value put into the mantissa
of a power of two, two columns an int32 op, then one packed 16-bit subtraction
of the zeros unpacked the same way); fp32 activations (the interpreter's tests)
take the plain shifts and conversion (awq_tile). The same kernels serve decode
and prefill; there is no 4-bit tensor-core product to do better. (The one-token experts take quant_awq_gemv's
GEMV instead, split and summed in the kernel: faster for them on an H200; at the
dense linears' shapes the two were within a few percent, either way by shape:
docs/performance.md.)

Legend: M rows (tokens), N output features, K input features, N8 = ceil(N/8) packed columns.
"""

import dataclasses

import torch
import triton
import triton.language as tl
from torch import Tensor

from services.model.kernels.quant_awq_gemv import one_row_linear
from services.model.kernels.quant_fp8 import num_splits, split_output, sum_splits
from services.model.kernels.quant_ref import AWQ_GROUP, AWQ_PACK

# Steps of at most this many rows take skinny tiles (16 rows a program; see default_tiles).
SKINNY_MAX_ROWS = 16
# One row's GEMV: "groups" (quant_awq_gemv's awq_gemv_groups, one_row_linear; the default, faster on an H200:
# bench/kernels/awq_sweep.py, docs/performance.md) or "nibbles" (awq_gemv_tile in _linear_kernel;
# --quant-gemv-variants awq-nibbles).
ONE_ROW_GEMV = "groups"
# The grouped one-row GEMV takes one group a program (awq_gemv_one_group) while its grid (128-column tiles times
# groups) has at most this many programs; bigger weights keep 256-column tiles and splits (default_tiles).
ONE_GROUP_MAX_PROGRAMS = 1024


@triton.jit
def awq_unpack(q_ptrs, mask):
    """[R, 8C] int32: the 4-bit values of the int32 tile at q_ptrs [R, C], columns in order."""
    q = tl.load(q_ptrs, mask=mask, other=0)
    c = tl.arange(0, 8)
    shifts = ((c & 1) * 4 + (c >> 1)) * 4  # AWQ's order: column c sits in nibble [0, 4, 1, 5, 2, 6, 3, 7][c]
    values = (q[:, :, None] >> shifts[None, None, :]) & 0xF
    return tl.reshape(values, (q.shape[0], q.shape[1] * 8))


@triton.jit
def awq_tile(q_ptr, z_ptr, s_ptr, k, k_mask, group, j, j_mask, n, n_mask, num_packed, out_features):
    """(q - z [BK, BN] int32, s [BN] fp32) of rows k (all in `group`) and columns n (packed columns j)."""
    q = awq_unpack(q_ptr + k.to(tl.int64)[:, None] * num_packed + j[None, :], k_mask[:, None] & j_mask[None, :])
    z = awq_unpack(z_ptr + group * num_packed + j[None, :], j_mask[None, :])
    s = tl.load(s_ptr + group * out_features + n, mask=n_mask, other=0.0).to(tl.float32)
    return q - z, s


# awq_biased_tile's BIAS twice in an int32, by activation dtype: the power of two whose mantissa's last bit is 1
# (bf16 128, fp16 1024), so that BIAS + v (v < 16) is exact with v in the mantissa's low bits.
_BIAS_BITS = {torch.bfloat16: 0x43004300, torch.float16: 0x64006400}


def bias_bits_for(dtype: torch.dtype) -> int:
    """The kernels' bias_bits argument for activations of dtype (0 for fp32, which does not use it). An argument,
    not a constant: in a register it lets the compiler merge the mask and the or into one three-input logic op
    (two constants take two ops)."""
    return _BIAS_BITS.get(dtype, 0)


@triton.jit
def awq_biased_tile(q_ptrs, mask, dtype: tl.constexpr, bias_bits):
    """[R, 8C] in dtype (bf16 or fp16): BIAS + the 4-bit values of the int32 tile at q_ptrs [R, C], columns in
    order, exact (bias_bits: bias_bits_for(dtype)). Columns 2i and 2i + 1 of each 8 sit in nibbles i and i + 4 (AWQ's
    order), 16 bits apart, so one shift and one mask-and-or put both into the mantissas of a pair of BIAS's: no
    integer-to-float conversion."""
    q = tl.load(q_ptrs, mask=mask, other=0)
    # Pair i: columns 2i (low half) and 2i + 1 (high half), each thread all four of its int32s.
    p0 = (q & 0x000F000F) | bias_bits
    p1 = ((q >> 4) & 0x000F000F) | bias_bits
    p2 = ((q >> 8) & 0x000F000F) | bias_bits
    p3 = ((q >> 12) & 0x000F000F) | bias_bits
    low = tl.join(tl.join(_half(p0, 0, dtype), _half(p2, 0, dtype)), tl.join(_half(p1, 0, dtype), _half(p3, 0, dtype)))
    high = tl.join(tl.join(_half(p0, 1, dtype), _half(p2, 1, dtype)), tl.join(_half(p1, 1, dtype), _half(p3, 1, dtype)))
    # [R, C, 2, 2, 2]: pair 2a + b's half h at [.., a, b, h], column 8c + 4a + 2b + h
    return tl.reshape(tl.join(low, high), (q.shape[0], q.shape[1] * 8))


@triton.jit
def _half(pair, h: tl.constexpr, dtype: tl.constexpr):
    """The low (h 0) or high 16 bits of int32 `pair`, as dtype."""
    bits = pair & 0xFFFF if h == 0 else pair >> 16
    return bits.to(tl.uint16).to(dtype, bitcast=True)


@triton.jit
def awq_step_dot(acc, a, q_ptr, z_ptr, s_ptr, k, k_mask, group, j, j_mask, n, n_mask, num_packed, out_features,
                 bias_bits, WEIGHTS_FIRST: tl.constexpr):
    """acc [BM, BN] + a @ W[k, n] (rows k all in `group`): tl.dot(a, q - z) times the group's scales; WEIGHTS_FIRST:
    acc transposed, [BN, BM], + tl.dot((q - z)^T, a^T), so that the weights' BN columns are the tensor cores'
    64-row side and a's few rows the narrow one (for 16-32 rows: no 16-row instructions with their operands
    shuffled between registers). For 16-bit a, q - z is (BIAS + q) - (BIAS + z) of awq_biased_tile (exact: small
    integers); fp32 a (the interpreter's tests) takes awq_tile's shifts and conversion."""
    if a.dtype == tl.float32:
        w, s = awq_tile(q_ptr, z_ptr, s_ptr, k, k_mask, group, j, j_mask, n, n_mask, num_packed, out_features)
        w = w.to(a.dtype)
    else:
        w = awq_biased_tile(q_ptr + k.to(tl.int64)[:, None] * num_packed + j[None, :],
                            k_mask[:, None] & j_mask[None, :], a.dtype, bias_bits)
        w -= awq_biased_tile(z_ptr + group * num_packed + j[None, :], j_mask[None, :], a.dtype, bias_bits)
        s = tl.load(s_ptr + group * out_features + n, mask=n_mask, other=0.0).to(tl.float32)
    if WEIGHTS_FIRST:
        acc += tl.dot(tl.trans(w), tl.trans(a), input_precision="ieee") * s[:, None]
    else:
        acc += tl.dot(a, w, input_precision="ieee") * s[None, :]
    return acc


@triton.jit
def awq_step_acc(BM: tl.constexpr, BN: tl.constexpr, WEIGHTS_FIRST: tl.constexpr):
    """awq_step_dot's zero accumulator for [BM, BN] outputs (transposed where WEIGHTS_FIRST)."""
    if WEIGHTS_FIRST:
        acc = tl.zeros([BN, BM], tl.float32)
    else:
        acc = tl.zeros([BM, BN], tl.float32)
    return acc


@triton.jit
def awq_step_result(acc, WEIGHTS_FIRST: tl.constexpr):
    """fp32 [BM, BN] of awq_step_dot's accumulator."""
    if WEIGHTS_FIRST:
        acc = tl.trans(acc)
    return acc


@triton.jit
def awq_gemv_tile(x_ptr, q_ptr, z_ptr, s_ptr, j, j_mask, n, n_mask, num_packed, out_features, k_start, k_end,
                  GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """fp32 [BLOCK_N]: x[k_start:k_end] @ W[k_start:k_end, n] on the CUDA cores (k_start a multiple of BLOCK_K)."""
    acc = tl.zeros([BLOCK_K, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < k_end
        x = tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        w, s = awq_tile(q_ptr, z_ptr, s_ptr, k, k_mask, k0 // GROUP, j, j_mask, n, n_mask, num_packed, out_features)
        acc += (x[:, None] * s[None, :]) * w.to(tl.float32)
    return tl.sum(acc, 0)


@triton.jit
def awq_block_dot(a_rows, a_mask, q_ptr, z_ptr, s_ptr, j, j_mask, n, n_mask, num_packed, out_features, k_start,
                  k_end, bias_bits, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, WEIGHTS_FIRST: tl.constexpr):
    """fp32 [BM, BN]: a[rows, k_start:k_end] @ W[k_start:k_end, n] in awq_step_dot's steps."""
    acc = awq_step_acc(a_rows.shape[0], n.shape[0], WEIGHTS_FIRST)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < k_end
        a = tl.load(a_rows[:, None] + k[None, :], mask=a_mask[:, None] & k_mask[None, :], other=0.0)
        acc = awq_step_dot(acc, a, q_ptr, z_ptr, s_ptr, k, k_mask, k0 // GROUP, j, j_mask, n, n_mask, num_packed,
                           out_features, bias_bits, WEIGHTS_FIRST)
    return awq_step_result(acc, WEIGHTS_FIRST)


@triton.jit
def awq_columns(n_block, num_packed, out_features, BLOCK_N: tl.constexpr):
    """Block n_block's columns n, their packed columns j, and both masks (BLOCK_N a multiple of 8)."""
    n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    j = n_block * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    return n, n < out_features, j, j < num_packed


@triton.jit
def _linear_kernel(x_ptr, q_ptr, z_ptr, s_ptr, y_ptr, num_rows, out_features, num_packed, in_features, x_stride,
                   k_split, bias_bits, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, WEIGHTS_FIRST: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < num_rows
    n, n_mask, j, j_mask = awq_columns(tl.program_id(1), num_packed, out_features, BLOCK_N)
    split = tl.program_id(2)
    k_start = split * k_split
    k_end = tl.minimum(k_start + k_split, in_features)
    if BLOCK_M == 1:  # one row on the CUDA cores
        acc = awq_gemv_tile(x_ptr + tl.program_id(0).to(tl.int64) * x_stride, q_ptr, z_ptr, s_ptr, j, j_mask, n,
                            n_mask, num_packed, out_features, k_start, k_end, GROUP, BLOCK_K, BLOCK_N)[None, :]
    else:
        acc = awq_block_dot(x_ptr + m.to(tl.int64) * x_stride, m_mask, q_ptr, z_ptr, s_ptr, j, j_mask, n, n_mask,
                            num_packed, out_features, k_start, k_end, bias_bits, GROUP, BLOCK_K, WEIGHTS_FIRST)
    y_rows = y_ptr + (split * num_rows + m).to(tl.int64) * out_features  # split > 0: fp32 partials
    tl.store(y_rows[:, None] + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@dataclasses.dataclass(frozen=True, slots=True)
class AwqTiles:
    """Launch shape of the AWQ linear kernel."""

    block_m: int  # rows per program; 1: the CUDA-core GEMV
    block_n: int  # output features per program (a multiple of 8)
    block_k: int  # input rows per step (divides the group size)
    split_k: int  # programs along K (fp32 partials summed after)
    warps: int
    stages: int
    gemv: str = "nibbles"  # block_m 1: "groups" takes one_row_linear (block_k its rows a slice, split_k at most)
    weights_first: bool = False  # block_m > 1: awq_step_dot's WEIGHTS_FIRST

    def __post_init__(self):
        if self.gemv not in ("nibbles", "groups") or (self.gemv == "groups" and self.block_m != 1):
            raise ValueError(f"AwqTiles.gemv {self.gemv!r} must be 'nibbles', or 'groups' with block_m 1 "
                             f"(not {self.block_m})")


def default_tiles(num_rows: int, out_features: int, in_features: int) -> AwqTiles:
    """The tiles for a step: one row's GEMV (ONE_ROW_GEMV's), skinny tiles up to SKINNY_MAX_ROWS, square
    tiles above; each split along K while its grid is small (quant_fp8.num_splits)."""
    if num_rows == 1 and ONE_ROW_GEMV == "groups":
        # One group a program, 128 columns in slices of 16 rows, 2 warps: the fastest of an H100 A/B at
        # Qwen3-30B-A3B's q|k|v and o (640 and 512 programs). Qwen3-235B-A22B's (2,304 and 2,048 programs that way)
        # were slower so; they keep awq_sweep's tiles: 256 columns, 4 warps, splits at least two groups deep.
        groups = triton.cdiv(in_features, AWQ_GROUP)
        if triton.cdiv(out_features, 128) * groups <= ONE_GROUP_MAX_PROGRAMS:
            return AwqTiles(1, 128, 16, groups, 2, 1, "groups")
        return AwqTiles(1, 256, 16, num_splits(triton.cdiv(out_features, 256), in_features, 2 * AWQ_GROUP), 4, 1,
                        "groups")
    block_m = 1 if num_rows == 1 else 16 if num_rows <= SKINNY_MAX_ROWS else 64 if num_rows <= 64 else 128
    block_n = 64 if block_m <= 16 else 128
    programs = triton.cdiv(num_rows, block_m) * triton.cdiv(out_features, block_n)
    # A whole group a step: faster than half groups at 16-4,096 rows with the biased tiles; the weights first in
    # the dot at 128-row tiles, where that was faster (and slower at 16-64 rows; docs/performance.md)
    return AwqTiles(block_m, block_n, AWQ_GROUP, num_splits(programs, in_features, 2 * AWQ_GROUP),
                    4 if block_m < 128 else 8, 3, weights_first=block_m == 128)


def check_layout(qweight: Tensor, qzeros: Tensor, scales: Tensor, group: int) -> tuple[int, int]:
    """(K, N) of an AWQ weight (leading expert dimensions allowed), its three tensors' shapes checked."""
    in_features, out_features = qweight.shape[-2], scales.shape[-1]
    num_groups, num_packed = triton.cdiv(in_features, group), triton.cdiv(out_features, AWQ_PACK)
    assert qweight.shape[-1] == qzeros.shape[-1] == num_packed, (qweight.shape, qzeros.shape, scales.shape)
    assert qzeros.shape[-2] == scales.shape[-2] == num_groups, (qweight.shape, qzeros.shape, scales.shape)
    assert qweight.dtype == qzeros.dtype == torch.int32
    assert qweight.is_contiguous() and qzeros.is_contiguous() and scales.is_contiguous()
    return in_features, out_features


def linear(x_MK: Tensor, qweight: Tensor, qzeros: Tensor, scales: Tensor, group: int = AWQ_GROUP,
           tiles: AwqTiles | None = None) -> Tensor:
    """y_MN = x @ W in x's dtype, W dequantized in registers. x's rows may have any stride, its columns contiguous."""
    in_features, out_features = check_layout(qweight, qzeros, scales, group)
    num_rows = x_MK.shape[0]
    assert x_MK.shape[1] == in_features and x_MK.stride(1) == 1
    tiles = tiles or default_tiles(num_rows, out_features, in_features)
    assert group % tiles.block_k == 0 and tiles.block_n % AWQ_PACK == 0, tiles
    if tiles.gemv == "groups":
        assert num_rows == 1, f"the grouped GEMV takes one row, not {num_rows}"
        return one_row_linear(x_MK, qweight, qzeros, scales, group, tiles.block_n, tiles.block_k, tiles.split_k,
                              tiles.warps)
    y, k_split = split_output(num_rows, out_features, in_features, tiles.block_k, tiles.split_k, x_MK.dtype,
                              x_MK.device)
    if num_rows:
        grid = (triton.cdiv(num_rows, tiles.block_m), triton.cdiv(out_features, tiles.block_n), y.shape[0])
        _linear_kernel[grid](x_MK, qweight, qzeros, scales, y, num_rows, out_features, qweight.shape[1], in_features,
                             x_MK.stride(0), k_split, bias_bits_for(x_MK.dtype), GROUP=group, BLOCK_M=tiles.block_m,
                             BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, WEIGHTS_FIRST=tiles.weights_first,
                             num_warps=tiles.warps, num_stages=tiles.stages)
    return sum_splits(y, x_MK.dtype)
