"""Rows routed to experts, sorted by expert into padded segments: the grouped GEMMs' layout (issue 8).

- align: a counting sort of the R = T * K routed rows by expert into segments
  padded to a multiple of block_m rows (two small kernels, or one after
  routing.gate_route_rows, which counts each ALIGN_TOKENS tokens' rows per
  expert itself): sorted_ids_P (the routed row r = t * K + k at each
  position), each expert's segment start, row count and padded end.
- segments: the same layout for rows already sorted by expert (the dispatch
  path's received rows): one kernel, each position naming its row.

No host sync; every grid and buffer sized from T alone (capturable in a CUDA graph).

Legend as in moe_dispatch.py: T tokens, E experts, K experts per token,
R = T * K routed rows, P = B * block_m padded positions in B blocks.
"""

import dataclasses

import torch
import triton
import triton.language as tl
from torch import Tensor

from services.model.kernels import flags

# Tokens per program of the align kernels: small, so that a decode step spreads over many SMs.
ALIGN_TOKENS = 16
ALIGN_WARPS = 4  # warps per program of the align kernels
# Positions per program of the segments kernel (each compares its positions with every expert).
SEGMENT_POSITIONS = 32


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
    if WAIT:  # the ids come from the peers (the exchange's signals): their flags first
        flags.wait_flags(flag_pads_ptr, flag_rank, flag_channel, flag_timeout_ns, FLAG_RANKS)
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
          chunk_counts: Tensor | None = None, wait: flags.Flags | None = None) -> Alignment:
    """Counting sort of the routed rows by expert (each token's ids distinct), stable in r.
    chunk_counts: each ALIGN_TOKENS tokens' rows per expert, if the routing counted them
    (routing.gate_route_rows; id_offset 0): the count kernel is skipped. wait: the peers'
    flags the count kernel waits for before reading ids_TK (the exchange's signals).

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
                                         **flags.wait_args(wait, chunk_counts))
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

