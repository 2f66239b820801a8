"""The MoE of one rank holding every expert, for steps too big for triton_fused.fused_moe (issue 8).

moe.MoELayer runs gate -> dispatch -> experts -> combine for any number of ranks; with one rank
that still packs, copies and re-sorts message buffers. Here every expert is
local, so the layer is five short steps, with no host sync and every grid and buffer sized from
T alone (capturable in a CUDA graph):

1. route (triton_fused.route): each token's K experts in increasing order, weights, hit counts.
   Up to triton_fused.GATE_ROUTE_ROWS_MAX_TOKENS tokens, gate_route_rows does the gate matmul
   and this in one kernel, and counts each ALIGN_TOKENS tokens' rows per expert for step 2.
2. align (two small kernels, one after gate_route_rows): a counting sort of the R = T * K
   routed rows by expert into segments padded to a multiple of BLOCK_M rows: sorted_ids_P (the
   routed row r = t * K + k at each position), each expert's segment start, row count and
   padded end.
3. gate_up: a grouped GEMM over the segments that gathers x rows by index (vLLM's fused_moe
   layout, one expert per block of rows) with SiLU(gate) * up in its epilogue: act_PF.
4. down: the grouped GEMM on act_PF, storing each output row at its routed row r: y_RD.
5. combine: each token's K outputs times their weights, summed in increasing expert order;
   given an AddNorm (the fused layer loop), also added into the residual stream and normed for
   the next layer in the same kernel.

Each intermediate the torch code stores in the model dtype is rounded the same way here (gate
and up, SiLU, its product, the down output, each weighted output), so outputs match moe.py to
within fp32 summation order. `gemms="torch"` runs steps 3-4 as moe.experts (torch._grouped_mm on
gathered rows, unpadded segments) instead: the alternative the benchmark compares.

With several ranks, moe.experts runs steps 3-4 on CUDA through sorted_experts: dispatch's rows
come sorted by local expert, so `segments` (one kernel) pads each expert's segment to BLOCK_M
positions that name their row, and the same two GEMM kernels take them with K = 1.

Legend as in moe.py: T tokens, D hidden, F expert width, G = 2F, E experts, K experts per token,
R = T * K routed rows, P = B * BLOCK_M padded positions in B blocks.
"""

import dataclasses

import torch
import triton
import triton.language as tl
from torch import Tensor

from services.model import moe, triton_flags, triton_fused
from services.model.layers import AddNorm
from services.model.triton_fused import add_residual, store_rms_norm

# The switch MoELayer reads (False: the general dispatch/combine code, e.g. to compare).
ENABLED = True
# The switch moe.experts reads on CUDA (expert-parallel ranks): sorted_experts' Triton GEMMs on
# dispatch's rows (False: torch._grouped_mm and SiLU * up in torch, e.g. to compare).
EP_EXPERTS = True
# Tokens per program of the align kernels: small, so that a decode step spreads over many SMs.
ALIGN_TOKENS = 16
ALIGN_WARPS = 4  # warps per program of the align kernels
# Positions per program of the segments kernel (each compares its positions with every expert).
SEGMENT_POSITIONS = 32
# grouped_moe given an AddNorm (the fused layer loop) adds its output into the residual stream
# and takes the next RMSNorm in its combine kernel (False: combine, then the AddNorm's own
# add_rms_norm_ kernel, e.g. to compare).
FUSED_ADD_NORM = True
# The grouped GEMMs' launch order (MoEConfig.tiles_first) for steps of up to this many tokens:
# each block of rows' column tiles in turn (neighbouring programs read one expert's weights).
# Bigger steps launch each column tile over every block in turn. At 256 tokens on an H200 the
# down kernel took 104 against 110 us a layer (bench/results/decode_variants_h200_order.md).
TILES_FIRST_MAX_TOKENS = 512


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
    each block's column tiles in turn (else each tile over the blocks)."""

    block_m: int
    gate_up: GemmBlocks
    down: GemmBlocks
    tiles_first: bool = False


def default_config(num_tokens: int) -> MoEConfig:
    """The tiles for a step of num_tokens: within 2% of the fastest of bench/moe_large_batch.py's
    sweep (Qwen3-30B-A3B's shape on an H200, bench/results/moe_large_batch_h200.json; up to 512
    tokens re-swept with more candidates in bench/results/moe_tile_sweep_h200.json: at 512,
    gate_up (128, 64, 4, 4) took 207 us against 216 for (128, 64, 8, 3))."""
    tiles_first = num_tokens <= TILES_FIRST_MAX_TOKENS
    if num_tokens <= 128:
        return MoEConfig(16, GemmBlocks(128, 128, 4, 3), GemmBlocks(128, 128, 4, 4), tiles_first)
    if num_tokens <= 256:
        return MoEConfig(32, GemmBlocks(128, 128, 4, 3), GemmBlocks(64, 128, 4, 4), tiles_first)
    if num_tokens <= 512:
        return MoEConfig(64, GemmBlocks(128, 64, 4, 4), GemmBlocks(128, 64, 4, 4), tiles_first)
    return MoEConfig(128, GemmBlocks(128, 64, 8, 4), GemmBlocks(256, 64, 8, 4), tiles_first)


@triton.jit
def _local_ids(ids_ptr, t, t_mask, k, ids_stride, id_offset, num_experts):
    """Token t's k-th expert as a local id (its id - id_offset), -1 where that is no expert
    of [0, num_experts): another rank's, or none (padding)."""
    ids_k = tl.load(ids_ptr + t * ids_stride + k, mask=t_mask, other=-1).to(tl.int32) - id_offset
    return tl.where(t_mask & (ids_k >= 0) & (ids_k < num_experts), ids_k, -1)


@triton.jit
def _expert_members(ids_ptr, t, t_mask, e, ids_stride, id_offset, num_experts, TOP_K: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """[tokens, experts] int32: 1 where the token routes to the (local) expert."""
    member = tl.zeros([BLOCK_T, BLOCK_E], tl.int32)
    for k in tl.static_range(TOP_K):
        ids_k = _local_ids(ids_ptr, t, t_mask, k, ids_stride, id_offset, num_experts)
        member += (ids_k[:, None] == e[None, :]).to(tl.int32)
    return member


@triton.jit
def _count_kernel(ids_ptr, chunk_counts_ptr, num_tokens, num_experts, ids_stride, id_offset, flag_pads_ptr, flag_rank,
                  flag_channel, flag_timeout_ns, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                  FLAG_RANKS: tl.constexpr, WAIT: tl.constexpr):
    if WAIT:  # the ids come from the peers (symm_exchange's signals): their flags first
        triton_flags.wait_flags(flag_pads_ptr, flag_rank, flag_channel, flag_timeout_ns, FLAG_RANKS)
    chunk = tl.program_id(0)
    t = chunk * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    counts = tl.sum(_expert_members(ids_ptr, t, t < num_tokens, e, ids_stride, id_offset, num_experts, TOP_K, BLOCK_T,
                                    BLOCK_E), 0)
    tl.store(chunk_counts_ptr + chunk * num_experts + e, counts, mask=e < num_experts)


@triton.jit
def _place_kernel(ids_ptr, chunk_counts_ptr, sorted_ids_ptr, pos_ptr, starts_ptr, counts_ptr, ends_ptr,
                  num_tokens, num_experts, num_chunks, ids_stride, id_offset, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr):
    chunk = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    e_mask = e < num_experts
    total = tl.zeros([BLOCK_E], tl.int32)
    before = tl.zeros([BLOCK_E], tl.int32)  # rows of earlier chunks, per expert
    for c0 in range(0, num_chunks, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        counts = tl.load(chunk_counts_ptr + c[:, None] * num_experts + e[None, :],
                         mask=(c < num_chunks)[:, None] & e_mask[None, :], other=0)
        total += tl.sum(counts, 0)
        before += tl.sum(tl.where((c < chunk)[:, None], counts, 0), 0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    first = e_mask & (chunk == 0)
    tl.store(starts_ptr + e, starts, mask=first)
    tl.store(counts_ptr + e, total, mask=first)
    tl.store(ends_ptr + e, ends, mask=first)
    t = chunk * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < num_tokens
    member = _expert_members(ids_ptr, t, t_mask, e, ids_stride, id_offset, num_experts, TOP_K, BLOCK_T, BLOCK_E)
    # A row's place: its expert's start, the rows of earlier chunks, then earlier tokens of this one.
    pos_TE = (starts + before)[None, :] + tl.cumsum(member, 0) - member
    for k in tl.static_range(TOP_K):
        ids_k = _local_ids(ids_ptr, t, t_mask, k, ids_stride, id_offset, num_experts)
        pos = tl.sum(tl.where(ids_k[:, None] == e[None, :], pos_TE, 0), 1)
        tl.store(sorted_ids_ptr + pos, t * TOP_K + k, mask=ids_k >= 0)  # rows of no local expert: no place
        tl.store(pos_ptr + t * TOP_K + k, pos, mask=t_mask)


@dataclasses.dataclass(frozen=True, slots=True)
class Alignment:
    """The routed rows sorted by expert, each expert's segment padded to block_m rows."""

    sorted_ids_P: Tensor  # routed row r = t * K + k at each position (padding: unset)
    pos_R: Tensor | None  # each routed row's position (None from segments: not needed there)
    starts_E: Tensor  # int32 first position of each expert's segment
    counts_E: Tensor  # int32 routed rows of each expert
    ends_E: Tensor  # int32 padded end of each segment (block_m 1: the grouped-GEMM offsets)
    block_m: int


def align(ids_TK: Tensor, num_experts: int, block_m: int, id_offset: int = 0,
          chunk_counts: Tensor | None = None, wait: triton_flags.Flags | None = None) -> Alignment:
    """Counting sort of the routed rows by expert (each token's ids distinct), stable in r.
    chunk_counts: each ALIGN_TOKENS tokens' rows per expert, if the routing counted them
    (triton_fused.gate_route_rows; id_offset 0): the count kernel is skipped. wait: the peers'
    flags the count kernel waits for before reading ids_TK (symm_exchange's signals).

    ids_TK may be a strided view (its rows any stride, its columns contiguous). Expert
    ids_TK[t, k] - id_offset is the local expert; a routed row whose local id is outside
    [0, num_experts) (another rank's expert, or padding) gets no position (its pos_R is
    meaningless) and is counted nowhere.
    """
    num_tokens, top_k = ids_TK.shape
    assert top_k <= 1 or ids_TK.stride(1) == 1
    num_routed = num_tokens * top_k
    # Each non-empty expert pads at most block_m - 1 rows.
    num_blocks = (num_routed + min(num_experts, num_routed) * (block_m - 1)) // block_m
    device = ids_TK.device
    sorted_ids_P = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    pos_R = torch.empty(num_routed, dtype=torch.int32, device=device)
    # Written by the place kernel; zeros for an empty step (which launches nothing).
    starts_E, counts_E, ends_E = (torch.empty if num_tokens else torch.zeros)(3, num_experts, dtype=torch.int32,
                                                                              device=device)
    if num_tokens:
        num_chunks = triton.cdiv(num_tokens, ALIGN_TOKENS)
        block_e = triton.next_power_of_2(num_experts)
        ids_stride = ids_TK.stride(0)
        if chunk_counts is None:
            chunk_counts = torch.empty(num_chunks, num_experts, dtype=torch.int32, device=device)
            _count_kernel[(num_chunks,)](ids_TK, chunk_counts, num_tokens, num_experts, ids_stride, id_offset,
                                         TOP_K=top_k, BLOCK_T=ALIGN_TOKENS, BLOCK_E=block_e, num_warps=ALIGN_WARPS,
                                         **triton_flags.wait_args(wait, chunk_counts))
        else:
            assert chunk_counts.shape == (num_chunks, num_experts) and id_offset == 0 and wait is None
        _place_kernel[(num_chunks,)](ids_TK, chunk_counts, sorted_ids_P, pos_R, starts_E, counts_E, ends_E,
                                     num_tokens, num_experts, num_chunks, ids_stride, id_offset, TOP_K=top_k,
                                     BLOCK_M=block_m, BLOCK_T=ALIGN_TOKENS, BLOCK_E=block_e, BLOCK_C=64,
                                     num_warps=ALIGN_WARPS)
    return Alignment(sorted_ids_P, pos_R, starts_E, counts_E, ends_E, block_m)


@triton.jit
def _segments_kernel(offsets_ptr, sorted_ids_ptr, starts_ptr, counts_ptr, ends_ptr, num_experts, num_positions,
                     BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    e = tl.arange(0, BLOCK_E)
    e_mask = e < num_experts
    row_ends = tl.load(offsets_ptr + e, mask=e_mask, other=0)
    row_starts = tl.load(offsets_ptr + e - 1, mask=e_mask & (e > 0), other=0)
    counts = row_ends - row_starts
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    first = e_mask & (tl.program_id(0) == 0)
    tl.store(starts_ptr + e, starts, mask=first)
    tl.store(counts_ptr + e, counts, mask=first)
    tl.store(ends_ptr + e, ends, mask=first)
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    # [positions, experts]: the segment holding each position (none: padding, left unset).
    in_segment = (p[:, None] >= starts[None, :]) & (p[:, None] < (starts + counts)[None, :])
    row = tl.sum(tl.where(in_segment, p[:, None] + (row_starts - starts)[None, :], 0), 1)
    is_row = tl.sum(in_segment.to(tl.int32), 1) > 0
    tl.store(sorted_ids_ptr + p, row, mask=is_row & (p < num_positions))


def segments(offsets_L: Tensor, num_rows: int, block_m: int) -> Alignment:
    """The Alignment of num_rows rows already sorted by expert (expert l's rows end at
    offsets_L[l], rows past the last are not read): each expert's rows in a segment padded to
    block_m, sorted_ids_P the row itself. One kernel, no sort, no host sync."""
    num_experts = offsets_L.shape[0]
    num_blocks = (num_rows + min(num_experts, num_rows) * (block_m - 1)) // block_m
    num_positions, device = num_blocks * block_m, offsets_L.device
    sorted_ids_P = torch.empty(num_positions, dtype=torch.int32, device=device)
    starts_E, counts_E, ends_E = torch.zeros(3, num_experts, dtype=torch.int32, device=device)
    if num_positions:
        _segments_kernel[(triton.cdiv(num_positions, SEGMENT_POSITIONS),)](
            offsets_L, sorted_ids_P, starts_E, counts_E, ends_E, num_experts, num_positions, BLOCK_M=block_m,
            BLOCK_P=SEGMENT_POSITIONS, BLOCK_E=triton.next_power_of_2(num_experts))
    return Alignment(sorted_ids_P, None, starts_E, counts_E, ends_E, block_m)


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


@triton.jit
def _weighted_sum(y_ptr, rows_ptr, weights_ptr, t, d, mask, hidden, TOP_K: tl.constexpr, HAS_ROWS: tl.constexpr):
    """fp32 [BLOCK_D]: token t's K rows of y (columns d) times their weights, each product
    rounded to the model dtype as moe.combine stores it, summed in increasing expert order."""
    dtype = y_ptr.dtype.element_ty
    total = tl.zeros(d.shape, tl.float32)
    for k in tl.static_range(TOP_K):
        r = t * TOP_K + k
        row = r
        if HAS_ROWS:
            row = tl.load(rows_ptr + r).to(tl.int64)
        y = tl.load(y_ptr + row * hidden + d, mask=mask, other=0.0).to(tl.float32)
        total += (y * tl.load(weights_ptr + r).to(tl.float32)).to(dtype).to(tl.float32)
    return total


@triton.jit
def _combine_kernel(y_ptr, rows_ptr, weights_ptr, out_ptr, hidden, TOP_K: tl.constexpr, HAS_ROWS: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = d < hidden
    total = _weighted_sum(y_ptr, rows_ptr, weights_ptr, t, d, mask, hidden, TOP_K, HAS_ROWS)
    tl.store(out_ptr + t * hidden + d, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine_add_norm_kernel(y_ptr, weights_ptr, x_ptr, norm_ptr, h_ptr, hidden, eps, TOP_K: tl.constexpr,
                             BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < hidden
    total = _weighted_sum(y_ptr, y_ptr, weights_ptr, t, d, mask, hidden, TOP_K, False)
    x = tl.load(x_ptr + t * hidden + d, mask=mask, other=0.0)
    x = add_residual(x_ptr, t * hidden + d, mask, x, total.to(x_ptr.dtype.element_ty))
    w = tl.load(norm_ptr + d, mask=mask, other=0.0).to(tl.float32)
    store_rms_norm(h_ptr, t * hidden + d, mask, x, w, hidden, eps)


def combine(y_XD: Tensor, rows_R: Tensor | None, weights_TK: Tensor) -> Tensor:
    """out_TD: token t's K rows of y (row rows_R[r] for routed row r = t * K + k, or r itself
    for None) times their weights, summed in increasing k."""
    num_tokens, top_k = weights_TK.shape
    hidden = y_XD.shape[1]
    out_TD = y_XD.new_empty(num_tokens, hidden)
    if num_tokens:
        block_d = min(triton.next_power_of_2(hidden), 1024)
        _combine_kernel[(num_tokens, triton.cdiv(hidden, block_d))](
            y_XD, y_XD if rows_R is None else rows_R, weights_TK, out_TD, hidden, TOP_K=top_k,
            HAS_ROWS=rows_R is not None, BLOCK_D=block_d)
    return out_TD


def combine_add_norm(y_RD: Tensor, weights_TK: Tensor, add_norm: AddNorm) -> Tensor:
    """add_norm(combine(y_RD, None, weights_TK)) in one kernel, the same bits: the combined
    output added into add_norm.x_TD in place, that sum's RMSNorm returned."""
    x_TD, (num_tokens, top_k) = add_norm.x_TD, weights_TK.shape
    assert x_TD.is_contiguous() and x_TD.shape == (num_tokens, y_RD.shape[1])
    h_TD = torch.empty_like(x_TD)
    if num_tokens:
        _combine_add_norm_kernel[(num_tokens,)](
            y_RD, weights_TK, x_TD, add_norm.weight_D, h_TD, x_TD.shape[1], add_norm.eps, TOP_K=top_k,
            BLOCK_D=triton.next_power_of_2(x_TD.shape[1]), num_warps=8)
    return h_TD


def _grid(num_blocks: int, num_tiles: int, tiles_first: bool) -> tuple[int, int]:
    """A GEMM's grid: blocks of rows by column tiles, the faster-launched axis first."""
    return (num_tiles, num_blocks) if tiles_first else (num_blocks, num_tiles)


def gate_up(x_TD: Tensor, a: Alignment, w_gate_up_EGD: Tensor, top_k: int, tile: GemmBlocks,
            tiles_first: bool = False) -> Tensor:
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
            TILES_FIRST=tiles_first, num_warps=tile.num_warps, num_stages=tile.num_stages)
    return act_PF


def down(act_PF: Tensor, a: Alignment, w_down_EDF: Tensor, num_routed: int, tile: GemmBlocks,
         tiles_first: bool = False) -> Tensor:
    """y_RD: each position's act times its expert's W_down^T, stored at its routed row."""
    num_experts, hidden, width = w_down_EDF.shape
    y_RD = act_PF.new_empty(num_routed, hidden)
    num_blocks = a.sorted_ids_P.shape[0] // a.block_m
    if num_blocks:
        _down_kernel[_grid(num_blocks, triton.cdiv(hidden, tile.block_n), tiles_first)](
            act_PF, a.sorted_ids_P, a.starts_E, a.counts_E, a.ends_E, w_down_EDF, y_RD, num_experts, hidden,
            width, BLOCK_M=a.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            BLOCK_E=triton.next_power_of_2(num_experts), EVEN_K=width % tile.block_k == 0,
            TILES_FIRST=tiles_first, num_warps=tile.num_warps, num_stages=tile.num_stages)
    return y_RD


def sorted_experts(x_PD: Tensor, offsets_L: Tensor, w_gate_up_LGD: Tensor, w_down_LDF: Tensor,
                   config: MoEConfig | None = None) -> Tensor:
    """moe.experts (row_block 0) by the Triton GEMMs, for rows dispatch already sorted by local
    expert: y_PD (P: moe.py's pairs), rows past offsets_L[-1] (fixed-capacity padding) neither
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


def route(x_TD: Tensor, w_gate_ED: Tensor, top_k: int, norm_topk_prob: bool,
          hit_counts_E: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """grouped_moe's routing (step 1): ids_TK, weights_TK and, where gate_route_rows counted
    them, each ALIGN_TOKENS tokens' rows per expert for align (else None); adds the routed
    experts to hit_counts_E."""
    if 1 < x_TD.shape[0] <= triton_fused.GATE_ROUTE_ROWS_MAX_TOKENS:
        assert triton_fused.GATE_ROUTE_ROWS == ALIGN_TOKENS
        return triton_fused.gate_route_rows(x_TD, w_gate_ED, top_k, norm_topk_prob, hit_counts_E)
    logits_TE = torch.nn.functional.linear(x_TD, w_gate_ED)
    ids_TK, weights_TK = triton_fused.route(logits_TE, top_k, norm_topk_prob, hit_counts_E, x_TD.dtype)[:2]
    return ids_TK, weights_TK, None


def grouped_moe(x_TD: Tensor, w_gate_ED: Tensor, w_gate_up_EGD: Tensor, w_down_EDF: Tensor, top_k: int,
                norm_topk_prob: bool, hit_counts_E: Tensor, config: MoEConfig | None = None,
                gemms: str = "triton", add_norm: AddNorm | None = None) -> Tensor:
    """MoELayer on one rank holding every expert (expert e in slot e), for any T; adds the
    routed experts to hit_counts_E. gemms "torch": the expert GEMMs as moe.experts. With
    add_norm: add_norm(the output) (fused into the combine, FUSED_ADD_NORM)."""
    num_experts, num_tokens = w_gate_ED.shape[0], x_TD.shape[0]
    assert w_gate_up_EGD.shape[0] == w_down_EDF.shape[0] == num_experts, "no spare slots here"
    assert x_TD.is_contiguous() and w_gate_up_EGD.is_contiguous() and w_down_EDF.is_contiguous()
    if gemms not in ("triton", "torch"):
        raise ValueError(f"gemms must be 'triton' or 'torch', not {gemms!r}")
    block_m = 1 if gemms == "torch" else (config or default_config(num_tokens)).block_m
    ids_TK, weights_TK, counts_CE = route(x_TD, w_gate_ED, top_k, norm_topk_prob, hit_counts_E)
    a = align(ids_TK, num_experts, block_m, chunk_counts=counts_CE)
    if gemms == "torch":
        y_PD = moe.experts(x_TD[a.sorted_ids_P // top_k], a.ends_E, w_gate_up_EGD, w_down_EDF, kernels=False)
        out_TD = combine(y_PD, a.pos_R, weights_TK)
        return out_TD if add_norm is None else add_norm(out_TD)
    config = config or default_config(num_tokens)
    act_PF = gate_up(x_TD, a, w_gate_up_EGD, top_k, config.gate_up, config.tiles_first)
    y_RD = down(act_PF, a, w_down_EDF, ids_TK.numel(), config.down, config.tiles_first)
    if add_norm is None:
        return combine(y_RD, None, weights_TK)
    if FUSED_ADD_NORM:
        return combine_add_norm(y_RD, weights_TK, add_norm)
    return add_norm(combine(y_RD, None, weights_TK))
