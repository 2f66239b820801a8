"""The AWQ 4-bit GEMVs for one row on the CUDA cores (issue 29): decode's one-token experts.

AWQ's stored layout (quant_awq.py): qweight [K, N/8] int32, nibble I of packed column j holding
column awq_column(j, I) = 8 j + [0, 2, 4, 6, 1, 3, 5, 7][I]. A program takes packed columns j
(BLOCK_C of them: 4 BLOCK_C bytes of each of its K rows) and keeps one [BLOCK_K, BLOCK_C]
accumulator per nibble in the layout the int32 tile is loaded in, so no step unpacks [R, C, 8]
to [R, 8C] (a layout conversion through shared memory). A value is made exact in fp32 by one
AND|OR into a float's mantissa (awq_bits; no int-to-float conversions), the group's zero
subtracted the same way, and the scale (pre-divided by awq_bits' power of two) applied per
value. The next step's weights are loaded before this step's FMAs (awq_gemv_cols; served with
--quant-gemv-variants awq-nibbles).

awq_gemv_groups (the default: quant_awq_moe.GROUPED_TILES, quant_awq.ONE_ROW_GEMV; faster on an H200,
docs/performance.md) steps a whole group at a time and keeps the zeros and scales out of the inner product: one AND
(the nibble read as a subnormal float) and one FFMA per value, a quarter of awq_gemv_cols'
instructions per weight byte, and 16-byte loads of a whole group in flight per thread
(bench/kernels/sass_stats.py: static figures). one_row_linear is the dense linear's one-row GEMV on it.
A split one group deep takes awq_gemv_one_group instead: the program's rows summed first, then the
group's zero and scale applied once a column (the default tiles' choice at Qwen3-30B-A3B's shapes).

Split along K (more programs in flight than the columns alone give), each split stores fp32
partials and the last of a tile's splits to finish sums them in split order (the same bits
every run) and writes the output: no second kernel (awq_last_split, split_counters). The GEMVs
return a tile's 8 BLOCK_C columns as one vector in column order (awq_stack), so the tile's sum over
its rows is one reduction and its stores and the split sum's loads are contiguous.

Legend: K input rows, N output columns, C packed columns of a program.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from services.model.kernels.launch import uses_pdl, wait_for_previous_kernel

# awq_gemv_groups' x scale (2^100) and the scales' (2^149 / 2^100): products of x and a subnormal nibble stay normal.
X_SCALE = tl.constexpr(2.0**100)
S_SCALE = tl.constexpr(2.0**49)
# Tiles a split GEMV may have at once (split_counters' slots).
MAX_SPLIT_TILES = 1 << 16
_COUNTERS: dict[tuple[torch.device, str], Tensor] = {}


@triton.jit
def awq_column(j, I: tl.constexpr):
    """The columns of nibble I of packed columns j: 8 j + [0, 2, 4, 6, 1, 3, 5, 7][I] (AWQ's order)."""
    return 8 * j + ((I % 4) * 2 + I // 4)


@triton.jit
def awq_bits(lo, hi, I: tl.constexpr):
    """fp32 2^23 + v 16^(I % 4), v nibble I of the int32s (lo, hi = lo >> 16): exact, by one AND|OR
    into a float's mantissa instead of a shift and an int-to-float conversion per value."""
    if I >= 4:
        v = hi & (0xF << (4 * (I - 4)))
    else:
        v = lo & (0xF << (4 * I))
    return (v | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def awq_stack(t):
    """The 8 nibble tiles t[I] [R, C] as one [R, 8 C] in column order: element (r, 8 c + o) is nibble
    (o % 2) * 4 + o // 2 of packed column c (awq_column's inverse). One reduction and one contiguous
    store of it replace eight of each: tl.join appends a dimension, so o's bits are joined from the
    highest (o // 4) to the lowest (o % 2), and the reshape only merges dimensions held by one thread."""
    q00, q01 = tl.join(t[0], t[2]), tl.join(t[4], t[6])  # o 0, 4 and 1, 5
    q10, q11 = tl.join(t[1], t[3]), tl.join(t[5], t[7])  # o 2, 6 and 3, 7
    stacked = tl.join(tl.join(q00, q10), tl.join(q01, q11))  # [R, C, o // 4, o // 2 % 2, o % 2]
    return tl.reshape(stacked, [t[0].shape[0], 8 * t[0].shape[1]])


@triton.jit
def awq_tile_columns(tile, BLOCK_C: tl.constexpr):
    """The 8 BLOCK_C output columns, in order, of packed columns tile * BLOCK_C + [0, BLOCK_C)."""
    return tile * (8 * BLOCK_C) + tl.arange(0, 8 * BLOCK_C)


@triton.jit
def _gemv_step_weights(q_ptr, z_ptr, s_ptr, k0, k_end, j, j_mask, num_packed, out_features, GROUP: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """qweight [BLOCK_K, C], the group's packed zeros [C] and 8 scale vectors [C] of the step at k0,
    each nibble's divided by awq_bits' 16^(I % 4) (exact: a power of two); nothing past k_end."""
    k = k0 + tl.arange(0, BLOCK_K)
    group = k0 // GROUP
    g_mask = j_mask & (k0 < k_end)
    q = tl.load(q_ptr + k.to(tl.int64)[:, None] * num_packed + j[None, :], mask=(k < k_end)[:, None] & j_mask[None, :],
                other=0)
    z = tl.load(z_ptr + group * num_packed + j, mask=g_mask, other=0)
    s = ()
    for i in tl.static_range(8):
        n = awq_column(j, i)
        s_i = tl.load(s_ptr + group * out_features + n, mask=g_mask & (n < out_features), other=0.0)
        s = s + (s_i.to(tl.float32) / (1 << (4 * (i % 4))),)
    return q, z, s


@triton.jit
def _gemv_step_fmas(acc, x, q, z, s):
    """acc (8 x [BLOCK_K, C]) + x[k] (q - z) s of each nibble: (q - z) 16^(I % 4) exact as the
    difference of two awq_bits, times the step's pre-divided scales."""
    q_hi, z_hi = q >> 16, z >> 16
    out = ()
    for i in tl.static_range(8):
        w = awq_bits(q, q_hi, i) - awq_bits(z, z_hi, i)[None, :]
        out = out + (acc[i] + x[:, None] * (w * s[i][None, :]),)
    return out


@triton.jit
def awq_gemv_cols(x_ptr, q_ptr, z_ptr, s_ptr, j, j_mask, num_packed, out_features, k_start, k_end,
                  GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False):
    """fp32 [8 BLOCK_C]: x[k_start:k_end] @ W[k_start:k_end, 8 j[0] + c] in column order (packed columns j
    contiguous; awq_stack), on the CUDA cores (k_start a multiple of BLOCK_K). Each nibble sums in its
    own [BLOCK_K, BLOCK_C] accumulator in the layout qweight is loaded in: no unpacking reshape, so no layout conversion
    through shared memory per step. The next step's weights are loaded before this step's FMAs
    (x is not: carried over the loop, it would be converted to qweight's layout every step). PDL: the
    first step's weights are loaded before waiting for the previous kernel (which writes x)."""
    acc = ()
    for i in tl.static_range(8):
        acc = acc + (tl.zeros([BLOCK_K, BLOCK_C], tl.float32),)
    q, z, s = _gemv_step_weights(q_ptr, z_ptr, s_ptr, k_start, k_end, j, j_mask, num_packed, out_features, GROUP,
                                 BLOCK_K)
    if PDL:
        wait_for_previous_kernel()
    for k0 in range(k_start, k_end, BLOCK_K):
        q_next, z_next, s_next = _gemv_step_weights(q_ptr, z_ptr, s_ptr, k0 + BLOCK_K, k_end, j, j_mask, num_packed,
                                                    out_features, GROUP, BLOCK_K)
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + k, mask=k < k_end, other=0.0).to(tl.float32)
        acc = _gemv_step_fmas(acc, x, q, z, s)
        q, z, s = q_next, z_next, s_next
    return tl.sum(awq_stack(acc), 0)


@triton.jit
def awq_subnormal(lo, hi, I: tl.constexpr):
    """fp32 v 16^(I % 4) 2^-149, v nibble I of the int32s (lo, hi = lo >> 16), exact: the masked bits
    read as a subnormal float (exponent field 0, no implicit one), so one AND makes the value."""
    if I >= 4:
        v = hi & (0xF << (4 * (I - 4)))
    else:
        v = lo & (0xF << (4 * I))
    return v.to(tl.float32, bitcast=True)


@triton.jit
def _group_weights(q_ptr, k0, k_end, j, j_mask, num_packed, GROUP: tl.constexpr, ROWS: tl.constexpr):
    """qweight's rows of the group at k0 as GROUP / ROWS slices [ROWS, C] (a tuple); nothing past k_end."""
    slices = ()
    for r in tl.static_range(GROUP // ROWS):
        k = k0 + r * ROWS + tl.arange(0, ROWS)
        slices = slices + (tl.load(q_ptr + k.to(tl.int64)[:, None] * num_packed + j[None, :],
                                   mask=(k < k_end)[:, None] & j_mask[None, :], other=0),)
    return slices


@triton.jit
def _group_slices(slices, x_ptr, k0, k_end, GROUP: tl.constexpr, ROWS: tl.constexpr):
    """(8 x [ROWS, C]: x[k] X_SCALE q 16^(I % 4) 2^-149 over the group at k0, its slices' rows summed by
    each thread in registers; [ROWS]: those x X_SCALE summed the same way); nothing past k_end."""
    acc = ()
    for i in tl.static_range(8):
        acc = acc + (tl.zeros(slices[0].shape, tl.float32),)
    xsum = tl.zeros([ROWS], tl.float32)
    for r in tl.static_range(GROUP // ROWS):
        k = k0 + r * ROWS + tl.arange(0, ROWS)
        x = tl.load(x_ptr + k, mask=k < k_end, other=0.0).to(tl.float32) * X_SCALE
        q = slices[r]
        q_hi = q >> 16
        xsum += x
        out = ()
        for i in tl.static_range(8):
            out = out + (acc[i] + x[:, None] * awq_subnormal(q, q_hi, i),)
        acc = out
    return acc, xsum


@triton.jit
def awq_gemv_groups(x_ptr, q_ptr, z_ptr, s_ptr, j, j_mask, num_packed, out_features, k_start, k_end,
                    GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False):
    """awq_gemv_cols' fp32 [8 BLOCK_C] (k_start a multiple of GROUP), the zeros and scales kept out of
    the inner product: per group, s (sum_k x q - z sum_k x). Each 4-bit value is made by one AND as
    a subnormal float (awq_subnormal) and taken by one FFMA against x X_SCALE (2^100: the products
    stay normal floats, exact, for |x| from 2^-77 to 2^28); per group, one zeros load, 8 scale
    loads (times 2^149 / X_SCALE / 16^(I % 4), exact) and two FFMAs per accumulator. A group's
    qweight is loaded as GROUP / ROWS slices of [ROWS, BLOCK_C] whose rows each thread sums in
    registers (no shuffles or shared memory until the end), every slice's loads issued before
    the FMAs use them, and the next group's before this group's zeros and scales are applied. PDL:
    the first group's weights are loaded before waiting for the previous kernel (which writes x)."""
    total = ()
    for i in tl.static_range(8):
        total = total + (tl.zeros([ROWS, BLOCK_C], tl.float32),)
    slices = _group_weights(q_ptr, k_start, k_end, j, j_mask, num_packed, GROUP, ROWS)
    if PDL:
        wait_for_previous_kernel()
    for k0 in range(k_start, k_end, GROUP):
        acc, xsum = _group_slices(slices, x_ptr, k0, k_end, GROUP, ROWS)
        slices = _group_weights(q_ptr, k0 + GROUP, k_end, j, j_mask, num_packed, GROUP, ROWS)
        z = tl.load(z_ptr + (k0 // GROUP) * num_packed + j, mask=j_mask, other=0)
        z_hi = z >> 16
        out = ()
        for i in tl.static_range(8):
            n = awq_column(j, i)
            s = tl.load(s_ptr + (k0 // GROUP) * out_features + n, mask=j_mask & (n < out_features), other=0.0)
            s = s.to(tl.float32) * (S_SCALE / (1 << (4 * (i % 4))))
            group_sum = acc[i] - awq_subnormal(z, z_hi, i)[None, :] * xsum[:, None]
            out = out + (total[i] + group_sum * s[None, :],)
        total = out
    return tl.sum(awq_stack(total), 0)


@triton.jit
def awq_gemv_one_group(x_ptr, q_ptr, z_ptr, s_ptr, j, j_mask, n, n_mask, num_packed, out_features, k_start,
                       k_end, GROUP: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr = False):
    """awq_gemv_groups' fp32 [8 BLOCK_C] for a split of one group (k_start a multiple of GROUP, k_end
    at most GROUP on; n, n_mask: j's 8 BLOCK_C columns in order, awq_tile_columns). The program's
    rows are summed first (one reduction), then the group's zero and scale are applied once a column:
    no accumulators carried over groups and no per-row corrections, so a program holds a fraction
    of awq_gemv_groups' registers. PDL: the weights, zeros and scales are loaded before waiting for
    the previous kernel (which writes x)."""
    group = k_start // GROUP
    slices = _group_weights(q_ptr, k_start, k_end, j, j_mask, num_packed, GROUP, ROWS)
    offset = n % 8
    nibble = (offset % 2) * 4 + offset // 2  # awq_column's inverse
    z_word = tl.load(z_ptr + group * num_packed + n // 8, mask=n_mask, other=0)
    z = ((z_word >> (16 * (nibble // 4))) & (0xF << (4 * (nibble % 4)))).to(tl.float32, bitcast=True)
    s = tl.load(s_ptr + group * out_features + n, mask=n_mask, other=0.0).to(tl.float32)
    s = s * S_SCALE / (1 << (4 * (nibble % 4))).to(tl.float32)
    if PDL:
        wait_for_previous_kernel()
    acc, xsum = _group_slices(slices, x_ptr, k_start, k_end, GROUP, ROWS)
    return (tl.sum(awq_stack(acc), 0) - z * tl.sum(xsum, 0)) * s


@triton.jit
def awq_sum_splits(partials_ptr, split_stride, n, n_mask, SPLITS: tl.constexpr):
    """The SPLITS fp32 partial rows at partials_ptr + s * split_stride, columns n, summed in split order
    (read past the L1: other programs wrote them)."""
    total = tl.load(partials_ptr + n, mask=n_mask, other=0.0, cache_modifier=".cg")
    for split in tl.static_range(1, SPLITS):
        total += tl.load(partials_ptr + split * split_stride + n, mask=n_mask, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def awq_last_split(counter_ptr, SPLITS: tl.constexpr):
    """Whether this program is the last of its tile's SPLITS to get here, each having stored its
    partials first (released by the barrier and the count, acquired by the last); the last sets
    the counter back to zero for the next launch (and the next replay of a CUDA graph)."""
    tl.debug_barrier()  # every thread's partials stored before the count
    count = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = count == SPLITS - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def awq_finish_splits(y_ptr, partials_ptr, split_stride, values, split, counter_ptr, n, n_mask,
                      SPLITS: tl.constexpr):
    """Stores a split's values (columns n): at y_ptr in y's dtype unsplit; else as fp32 partials (split s
    at partials_ptr + s * split_stride), and the last of the tile's splits to get here stores their sum
    at y_ptr."""
    if SPLITS == 1:
        tl.store(y_ptr + n, values.to(y_ptr.dtype.element_ty), mask=n_mask)
    else:
        tl.store(partials_ptr + split * split_stride + n, values, mask=n_mask)
        if awq_last_split(counter_ptr, SPLITS):
            total = awq_sum_splits(partials_ptr, split_stride, n, n_mask, SPLITS)
            tl.store(y_ptr + n, total.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _one_row_kernel(x_ptr, q_ptr, z_ptr, s_ptr, y_ptr, partials_ptr, counters_ptr, out_features, num_packed,
                    in_features, k_split, GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr,
                    SPLITS: tl.constexpr, ONE_GROUP: tl.constexpr, PDL: tl.constexpr):
    c_block, split = tl.program_id(0), tl.program_id(1)
    j = c_block * BLOCK_C + tl.arange(0, BLOCK_C)
    j_mask = j < num_packed
    n = awq_tile_columns(c_block, BLOCK_C)
    n_mask = n < out_features
    k_start = split * k_split
    k_end = tl.minimum(k_start + k_split, in_features)
    if ONE_GROUP:
        y = awq_gemv_one_group(x_ptr, q_ptr, z_ptr, s_ptr, j, j_mask, n, n_mask, num_packed, out_features, k_start,
                               k_end, GROUP, ROWS, PDL)
    else:
        y = awq_gemv_groups(x_ptr, q_ptr, z_ptr, s_ptr, j, j_mask, num_packed, out_features, k_start, k_end, GROUP,
                            ROWS, BLOCK_C, PDL)
    awq_finish_splits(y_ptr, partials_ptr, out_features, y, split, counters_ptr + c_block, n, n_mask, SPLITS)


def one_row_linear(x_1K: Tensor, qweight: Tensor, qzeros: Tensor, scales: Tensor, group: int, block_n: int, rows: int,
                   splits: int, warps: int) -> Tensor:
    """y_1N = x @ W for one row by awq_gemv_groups (quant_awq.linear's "groups" one-row GEMV): block_n
    columns a program (a multiple of 8), slices of `rows` rows, up to `splits` programs along K
    (a whole number of groups each; one group each, awq_gemv_one_group), the last of a tile's summing
    their fp32 partials in order; a PDL launch where the GPU has them (launch.uses_pdl)."""
    in_features, num_packed, out_features = qweight.shape[0], qweight.shape[1], scales.shape[1]
    if block_n % 8 or group % rows:
        raise ValueError(f"block_n ({block_n}) must be a multiple of 8 and rows ({rows}) divide the group ({group})")
    k_split = triton.cdiv(triton.cdiv(in_features, group), splits) * group
    num_splits, tiles = triton.cdiv(in_features, k_split), triton.cdiv(num_packed, block_n // 8)
    y = x_1K.new_empty(1, out_features)
    partials = torch.empty(num_splits if num_splits > 1 else 0, out_features, dtype=torch.float32, device=y.device)
    counters = split_counters(y.device, tiles, "one_row") if num_splits > 1 else partials
    pdl = uses_pdl(x_1K)
    _one_row_kernel[(tiles, num_splits)](x_1K, qweight, qzeros, scales, y, partials, counters, out_features,
                                         num_packed, in_features, k_split, GROUP=group, ROWS=rows,
                                         BLOCK_C=block_n // 8, SPLITS=num_splits, ONE_GROUP=k_split == group,
                                         PDL=pdl, num_warps=warps, num_stages=1, launch_pdl=pdl)
    return y


def split_counters(device: torch.device, num_tiles: int, user: str = "moe") -> Tensor:
    """int32 counters of awq_last_split, zero between launches: one buffer per device and user, kept
    (CUDA graphs bake its address in). Kernels on one device run one at a time here (one stream),
    so the MoE's share one (the dense one-row GEMV has its own: a PDL launch of the MoE may start
    while it runs); the first call must come before any CUDA graph capture (it zeroes them)."""
    if num_tiles > MAX_SPLIT_TILES:
        raise ValueError(f"a split AWQ GEMV of {num_tiles} tiles exceeds MAX_SPLIT_TILES ({MAX_SPLIT_TILES})")
    counters = _COUNTERS.get((device, user))
    if counters is None:
        counters = _COUNTERS[(device, user)] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return counters
