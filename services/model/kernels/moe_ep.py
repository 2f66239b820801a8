"""The expert-parallel MoE layer on CUDA as a gather and a reduce-scatter (issue 8).

moe_dispatch's dispatch sends each token's row once to each rank holding one
of its experts, and combine returns one fp32 partial per (token, rank): about
fifty small torch ops a layer around the two all_to_alls. With few ranks a
token reaches nearly every rank anyway (top-8 of 128 experts over 2 ranks: a
token misses a rank with probability C(64, 8) / C(128, 8), about 0.3%), so
here every rank gathers every rank's rows and the layer is a few kernels:

1. route (routing.route) this rank's tokens: K expert ids in increasing
   order, weights in the model dtype, hit counts; with replicas the slot map
   turns ids into global slots.
2. pack (one kernel) B rows: [hidden row | ids + 1 | fp32 weights] (moe_dispatch's
   row layout; ids 0 past the rank's T tokens: padding, no expert). Without
   replicas steps 1 and 2 are one kernel (route_pack).
3. all_gather the N * B rows (one collective, equal sizes).
4. align (moe_align.align on the gathered ids, offset to local experts: the
   other ranks' experts and padding get no place), gate_up (reading x in place
   from the gathered rows) and down: moe_gemm's grouped GEMMs.
5. partials (one kernel): per gathered row, the sum over its local experts of
   weight * output, each product rounded to the model dtype and summed in fp32
   in increasing expert order: moe_dispatch.combine's rounding.
6. reduce_scatter (sum) the fp32 partials: this rank's B rows, summed over the
   ranks and rounded once to the model dtype.

B (rows per rank) is the step's fixed row count, the same on every rank: the
decode bucket (moe_dispatch.step_capacity's capacity / min(K, L)) or, for bigger
steps, the largest token count of any rank. Every shape comes from B, so a
decode step captures in a CUDA graph with its two collectives, and nothing
reads back to the host.

With comm.exchange set (services/model/exchange/symmetric.py, the expert service's
--ep-exchange, symmetric memory on CUDA by default), the decode steps that fit
its buffers exchange over NVLink instead of two NCCL collectives: route_pack
writes into the exchange's row target (with push, straight into every rank's
gathered rows), the partials into its partial target (with push, straight to
their owners), and the exchange's sum comes back in the model dtype, with the
residual add and the next layer's RMSNorm fused where the layer loop hands them
over (add_norm). With its signals route_pack and partials set the peers' flags
and align's count kernel waits for them (kernels/flags.py), in place of barriers.

Rounding: as moe_dispatch's fixed-capacity mode (each rank sums its own experts'
products, the partials are summed in fp32, rounded once). The fp32 sum over
ranks is NCCL's: with two ranks one addition, the same bits as moe_dispatch.combine.

Legend as in moe_dispatch.py: T tokens of this rank, B rows per rank, N ranks, D hidden,
K experts per token, L local experts (slots), W row width in the model dtype,
J = N * B gathered rows.
"""

import dataclasses

import torch
import triton
import triton.language as tl
from torch import Tensor

from services.model.exchange.comm import ExpertComm
from services.model.kernels import flags, moe_align, moe_gemm, routing
from services.model.layers import AddNorm

# The switch the Triton MoE backend reads on CUDA with several ranks (False: the dispatch path).
ENABLED = True
# Warps of the small kernels: 1, 2 or 8 were no faster on an H200.
ROUTE_PACK_WARPS = 4
PARTIALS_WARPS = 4
LOCAL_TILES = True  # local_config's own tiles where it has them (False: moe_gemm.default_config's)
# local_config's tiles (block_n, block_k, warps, stages) at 129-256 gathered rows: the fastest of
# a sweep on an H200 (block_m 32), faster there than default_config's (docs/performance.md).
LOCAL_GATE_UP = (64, 128, 4, 2)
LOCAL_DOWN = (128, 128, 4, 3)


def row_width(hidden: int, top_k: int, dtype: torch.dtype) -> int:
    """W: a packed row's width in elements of dtype (hidden, then K int32 ids, K fp32 weights)."""
    assert 4 % dtype.itemsize == 0 and hidden * dtype.itemsize % 4 == 0, f"int32 ids do not fit {dtype} rows"
    return hidden + 8 * top_k // dtype.itemsize


@triton.jit
def _buffer(ptr, dests_ptr, d, byte_offset, HAS_DESTS: tl.constexpr):
    """Destination d's buffer as ptr's type: ptr itself, or with HAS_DESTS the address
    dests_ptr[d] + byte_offset (a buffer laid out as ptr's: the exchange's peers)."""
    if HAS_DESTS:
        ptr = (tl.load(dests_ptr + d) + byte_offset).to(ptr.dtype)
    return ptr


@triton.jit
def _copy_row(x_ptr, rows_ptr, dests_ptr, j, row, hidden, row_stride, NUM_DESTS: tl.constexpr,
              HAS_DESTS: tl.constexpr, BLOCK_D: tl.constexpr):
    """x's row j into the hidden part of send row `row` of each destination."""
    for d0 in range(0, hidden, BLOCK_D):
        c = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + j * hidden + c, mask=c < hidden)
        for dest in tl.static_range(NUM_DESTS):
            tl.store(_buffer(rows_ptr, dests_ptr, dest, 0, HAS_DESTS) + row * row_stride + c, x, mask=c < hidden)


@triton.jit
def _store_meta(meta_ptr, dests_ptr, row, meta_stride, meta_bytes, k, ids, weight_bits, mask,
                TOP_K: tl.constexpr, NUM_DESTS: tl.constexpr, HAS_DESTS: tl.constexpr):
    """Send row `row`'s ids + 1 and fp32 weight bits at places k of each destination."""
    for dest in tl.static_range(NUM_DESTS):
        meta = _buffer(meta_ptr, dests_ptr, dest, meta_bytes, HAS_DESTS) + row * meta_stride
        tl.store(meta + k, ids, mask=mask)
        tl.store(meta + TOP_K + k, weight_bits, mask=mask)


@triton.jit
def _pack_kernel(x_ptr, ids_ptr, weights_ptr, rows_ptr, meta_ptr, dests_ptr, first_row, num_tokens, hidden,
                 row_stride, meta_stride, meta_bytes, flag_pads_ptr, flag_rank, flag_channel, flag_clear_channel,
                 flag_counter_ptr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                 NUM_DESTS: tl.constexpr, HAS_DESTS: tl.constexpr, FLAG_RANKS: tl.constexpr,
                 FLAG_CLEAR: tl.constexpr, FLAG_SCOPE: tl.constexpr, SIGNAL: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    is_token = j < num_tokens
    k = tl.arange(0, BLOCK_K)
    k_mask = k < TOP_K
    ids = tl.load(ids_ptr + j * TOP_K + k, mask=is_token & k_mask, other=-1).to(tl.int32)
    weights = tl.load(weights_ptr + j * TOP_K + k, mask=is_token & k_mask, other=0.0).to(tl.float32)
    # ids + 1: 0 is no expert (padding rows)
    _store_meta(meta_ptr, dests_ptr, first_row + j, meta_stride, meta_bytes, k, ids + 1,
                weights.to(tl.int32, bitcast=True), k_mask, TOP_K, NUM_DESTS, HAS_DESTS)
    if is_token:
        _copy_row(x_ptr, rows_ptr, dests_ptr, j, first_row + j, hidden, row_stride, NUM_DESTS, HAS_DESTS, BLOCK_D)
    if SIGNAL:  # the rows are in every peer's buffer: the last program says so (the exchange's signals)
        flags.signal_peers(flag_pads_ptr, flag_rank, flag_channel, flag_clear_channel, flag_counter_ptr,
                                  FLAG_RANKS, FLAG_CLEAR, FLAG_SCOPE)


def _send_buffer(x_TD: Tensor, top_k: int, rows_per_rank: int,
                 out: Tensor | None = None) -> tuple[Tensor, Tensor, int]:
    """The unfilled send_BW for x_TD's tokens (out, if given), its meta columns, and BLOCK_D
    of the row copy."""
    num_tokens, hidden = x_TD.shape
    if rows_per_rank < num_tokens:
        raise ValueError(f"{num_tokens} tokens do not fit {rows_per_rank} rows per rank")
    shape = (rows_per_rank, row_width(hidden, top_k, x_TD.dtype))
    send_BW = x_TD.new_empty(shape) if out is None else out
    assert send_BW.shape == shape and send_BW.dtype == x_TD.dtype and send_BW.is_contiguous()
    return send_BW, _meta(send_BW, hidden), min(triton.next_power_of_2(max(hidden, 1)), 1024)


def _dest_args(x_TD: Tensor, send_BW: Tensor, dests: tuple[Tensor, int] | None,
               signal: flags.Flags | None = None) -> dict:
    """The destination arguments of the pack kernels: send_BW itself, or each buffer of dests;
    and signal's flags (the exchange's signals), if given."""
    flag_args = flags.signal_args(signal, send_BW)
    if dests is None:
        assert signal is None, "flags signal rows pushed to the peers"
        return dict(dests_ptr=send_BW, first_row=0, meta_bytes=0, NUM_DESTS=1, HAS_DESTS=False, **flag_args)
    ptrs_N, first_row = dests
    return dict(dests_ptr=ptrs_N, first_row=first_row, meta_bytes=x_TD.shape[1] * x_TD.element_size(),
                NUM_DESTS=ptrs_N.numel(), HAS_DESTS=True, **flag_args)


def pack(x_TD: Tensor, ids_TK: Tensor, weights_TK: Tensor, rows_per_rank: int, out: Tensor | None = None,
         dests: tuple[Tensor, int] | None = None, signal: flags.Flags | None = None) -> Tensor:
    """send_BW (written into out, if given): token t's [x row | ids + 1 | fp32 weights] in row
    t < T, rows past T with id 0 (their hidden part unset: no expert reads it). dests: (ptrs_N,
    first_row): the rows go instead into each of the N buffers at those addresses (laid out as
    send_BW's), from their row first_row (the exchange's push; out then only gives the shape).
    signal: the peers' flags the kernel sets once every row is written (the exchange's signals)."""
    (num_tokens, hidden), top_k = x_TD.shape, ids_TK.shape[1]
    assert x_TD.is_contiguous() and ids_TK.is_contiguous() and weights_TK.is_contiguous()
    send_BW, meta_BM, block_d = _send_buffer(x_TD, top_k, rows_per_rank, out)
    if rows_per_rank:
        _pack_kernel[(rows_per_rank,)](x_TD, ids_TK, weights_TK, send_BW, meta_BM, num_tokens=num_tokens,
                                       hidden=hidden, row_stride=send_BW.stride(0), meta_stride=meta_BM.stride(0),
                                       TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_D=block_d,
                                       **_dest_args(x_TD, send_BW, dests, signal))
    return send_BW


@triton.jit
def _route_pack_kernel(logits_ptr, x_ptr, rows_ptr, meta_ptr, hits_ptr, dests_ptr, first_row, num_tokens,
                       num_experts, hidden, row_stride, meta_stride, meta_bytes, flag_pads_ptr, flag_rank, flag_channel,
                       flag_clear_channel, flag_counter_ptr, NORM: tl.constexpr, TOP_K: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, NUM_DESTS: tl.constexpr,
                       HAS_DESTS: tl.constexpr, FLAG_RANKS: tl.constexpr, FLAG_CLEAR: tl.constexpr,
                       FLAG_SCOPE: tl.constexpr, SIGNAL: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    if j < num_tokens:
        e = tl.arange(0, BLOCK_E)
        logits = tl.load(logits_ptr + j * num_experts + e, mask=e < num_experts, other=float("-inf")).to(tl.float32)
        chosen, w, rank = routing.choose_experts(logits[None, :], e, num_experts, NORM, TOP_K, BLOCK_E)
        chosen, w, rank = tl.reshape(chosen, [BLOCK_E]), tl.reshape(w, [BLOCK_E]), tl.reshape(rank, [BLOCK_E])
        # As route then pack: ids + 1, the weights rounded to the model dtype, as fp32 bits.
        w = w.to(x_ptr.dtype.element_ty).to(tl.float32)
        _store_meta(meta_ptr, dests_ptr, first_row + j, meta_stride, meta_bytes, rank, (e + 1).to(tl.int32),
                    w.to(tl.int32, bitcast=True), chosen, TOP_K, NUM_DESTS, HAS_DESTS)
        tl.atomic_add(hits_ptr + e, chosen.to(hits_ptr.dtype.element_ty), mask=chosen)
        _copy_row(x_ptr, rows_ptr, dests_ptr, j, first_row + j, hidden, row_stride, NUM_DESTS, HAS_DESTS, BLOCK_D)
    else:  # padding: no expert
        _store_meta(meta_ptr, dests_ptr, first_row + j, meta_stride, meta_bytes, k, tl.zeros([BLOCK_K], tl.int32),
                    tl.zeros([BLOCK_K], tl.int32), k < TOP_K, TOP_K, NUM_DESTS, HAS_DESTS)
    if SIGNAL:  # as _pack_kernel's
        flags.signal_peers(flag_pads_ptr, flag_rank, flag_channel, flag_clear_channel, flag_counter_ptr,
                                  FLAG_RANKS, FLAG_CLEAR, FLAG_SCOPE)


def route_pack(logits_TE: Tensor, x_TD: Tensor, top_k: int, norm_topk_prob: bool, hit_counts_E: Tensor,
               rows_per_rank: int, out: Tensor | None = None, dests: tuple[Tensor, int] | None = None,
               signal: flags.Flags | None = None) -> Tensor:
    """pack(x_TD, *routing.route(logits_TE, ...)[:2], rows_per_rank, out, dests, signal) in
    one kernel: the same rows, and each token's experts added to hit_counts_E."""
    (num_tokens, hidden), num_experts = x_TD.shape, logits_TE.shape[1]
    assert x_TD.is_contiguous() and logits_TE.is_contiguous() and hit_counts_E.is_contiguous() and top_k < 128
    send_BW, meta_BM, block_d = _send_buffer(x_TD, top_k, rows_per_rank, out)
    if rows_per_rank:
        _route_pack_kernel[(rows_per_rank,)](
            logits_TE, x_TD, send_BW, meta_BM, hit_counts_E, num_tokens=num_tokens, num_experts=num_experts,
            hidden=hidden, row_stride=send_BW.stride(0), meta_stride=meta_BM.stride(0), NORM=norm_topk_prob,
            TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(num_experts),
            BLOCK_D=block_d, num_warps=ROUTE_PACK_WARPS, **_dest_args(x_TD, send_BW, dests, signal))
    return send_BW


def _meta(rows_JW: Tensor, hidden: int) -> Tensor:
    """The int32 columns after the hidden part: K ids + 1, then K fp32 weights' bits."""
    return rows_JW.view(torch.int32)[:, hidden * rows_JW.dtype.itemsize // 4:]


@triton.jit
def _partials_kernel(y_ptr, meta_ptr, out_ptr, owners_ptr, first_row, rows_per_rank, hidden, meta_stride, id_offset,
                     num_local, flag_pads_ptr, flag_rank, flag_channel, flag_clear_channel, flag_counter_ptr,
                     TOP_K: tl.constexpr, HAS_OWNERS: tl.constexpr, BLOCK_D: tl.constexpr, FLAG_RANKS: tl.constexpr,
                     FLAG_CLEAR: tl.constexpr, FLAG_SCOPE: tl.constexpr, SIGNAL: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < hidden
    dtype = y_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_D], tl.float32)
    for k in tl.static_range(TOP_K):  # increasing expert order, as moe_dispatch.combine sums
        local = tl.load(meta_ptr + j * meta_stride + k) - id_offset
        is_local = (local >= 0) & (local < num_local)
        # Masked rather than branched around (every k's loads may issue at once): another
        # rank's expert adds 0: the faster of the two on an H200.
        weight = tl.load(meta_ptr + j * meta_stride + TOP_K + k).to(tl.float32, bitcast=True)
        y = tl.load(y_ptr + (j * TOP_K + k) * hidden + d, mask=d_mask & is_local, other=0.0).to(tl.float32)
        total += (y * weight.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    out = out_ptr + j * hidden
    if HAS_OWNERS:  # row j's owner, rank j // B, at row first_row + j % B of its buffer
        out = tl.load(owners_ptr + j // rows_per_rank).to(out_ptr.dtype) + (first_row + j % rows_per_rank) * hidden
    tl.store(out + d, total, mask=d_mask)
    if SIGNAL:  # every partial is with its owner: the last program says so (the exchange's signals)
        flags.signal_peers(flag_pads_ptr, flag_rank, flag_channel, flag_clear_channel, flag_counter_ptr,
                                  FLAG_RANKS, FLAG_CLEAR, FLAG_SCOPE)


def partials(y_RD: Tensor, meta_JM: Tensor, id_offset: int, num_local: int, out: Tensor | None = None,
             owners: tuple[Tensor, int] | None = None, signal: flags.Flags | None = None) -> Tensor:
    """fp32 partial_JD (written into out, if given): each gathered row's weighted outputs of its
    local experts (y_RD's row j * K + k), each product rounded to y's dtype, summed in increasing k.
    owners: (ptrs_N, first_row): row j goes instead to the buffer at ptrs_N[j // B] (B = J / N),
    at its row first_row + j % B (the exchange's push; out then only gives the shape). signal:
    the peers' flags the kernel sets once every partial is written (the exchange's signals)."""
    num_rows, top_k = meta_JM.shape[0], meta_JM.shape[1] // 2
    hidden = y_RD.shape[1]
    partial_JD = torch.empty(num_rows, hidden, dtype=torch.float32, device=y_RD.device) if out is None else out
    assert partial_JD.shape == (num_rows, hidden) and partial_JD.dtype == torch.float32 and partial_JD.is_contiguous()
    owners_ptr, first_row, rows_per_rank = partial_JD, 0, 1
    if owners is not None:
        (owners_ptr, first_row), rows_per_rank = owners, num_rows // owners[0].numel()
    assert signal is None or owners is not None, "flags signal partials pushed to their owners"
    if num_rows:
        block_d = min(triton.next_power_of_2(hidden), 1024)
        _partials_kernel[(num_rows, triton.cdiv(hidden, block_d))](
            y_RD, meta_JM, partial_JD, owners_ptr, first_row, rows_per_rank, hidden, meta_JM.stride(0), id_offset,
            num_local, TOP_K=top_k, HAS_OWNERS=owners is not None, BLOCK_D=block_d,
            num_warps=PARTIALS_WARPS, **flags.signal_args(signal, partial_JD))
    return partial_JD


def local_partials(recv_JW: Tensor, hidden: int, top_k: int, id_offset: int, w_gate_up_LGD: Tensor | None,
                   w_down_LDF: Tensor | None, config: moe_gemm.MoEConfig | None = None, out: Tensor | None = None,
                   owners: tuple[Tensor, int] | None = None, signal: flags.Flags | None = None,
                   wait: flags.Flags | None = None, gemms=None) -> Tensor:
    """Steps 4-5 on the gathered rows: the fp32 partial_JD (into out or owners, and signal, as
    partials takes them) of this rank's local experts, whose global ids (+ 1, as packed) start at
    id_offset; with wait, once the peers' flags say their rows are in recv_JW. gemms (quantized
    experts, kernels/quant_moe.ExpertGemms: num_slots and aligned(x_JD, a, top_k, num_routed,
    config) -> y_RD) in place of moe_gemm's on the dense weights."""
    num_rows = recv_JW.shape[0]
    num_local = w_gate_up_LGD.shape[0] if gemms is None else gemms.num_slots
    meta_JM = _meta(recv_JW, hidden)
    config = config or local_config(num_rows)
    a = moe_align.align(meta_JM[:, :top_k], num_local, config.block_m, id_offset, wait=wait)
    if gemms is not None:
        y_RD = gemms.aligned(recv_JW[:, :hidden], a, top_k, num_rows * top_k, config)
        return partials(y_RD, meta_JM, id_offset, num_local, out, owners, signal)
    act_PF = moe_gemm.gate_up(recv_JW[:, :hidden], a, w_gate_up_LGD, top_k, config.gate_up, config.tiles_first)
    y_RD = moe_gemm.down(act_PF, a, w_down_LDF, num_rows * top_k, config.down, config.tiles_first)
    return partials(y_RD, meta_JM, id_offset, num_local, out, owners, signal)


def local_config(num_rows: int) -> moe_gemm.MoEConfig:
    """local_partials' tiles at J gathered rows: as the one-rank layer's at J tokens over the
    model's E = N * L experts (the same rows per expert), except at 129-256 rows (128 tokens per
    rank on two ranks), where the GEMMs have half the one-rank layer's programs: LOCAL_GATE_UP
    and LOCAL_DOWN there, with LOCAL_TILES."""
    config = moe_gemm.default_config(num_rows)
    if LOCAL_TILES and 128 < num_rows <= 256:
        return dataclasses.replace(config, gate_up=moe_gemm.GemmBlocks(*LOCAL_GATE_UP),
                                   down=moe_gemm.GemmBlocks(*LOCAL_DOWN))
    return config


def _route_and_pack(layer, x_TD: Tensor, rows_per_rank: int, out: Tensor | None = None,
                    dests: tuple[Tensor, int] | None = None, signal: flags.Flags | None = None) -> Tensor:
    """Steps 1-2: this rank's rows, routed by the layer's gate, packed (route_pack / pack's
    out, dests and signal); their experts added to layer.hit_counts_E."""
    logits_TE = torch.nn.functional.linear(x_TD, layer.w_gate_ED)
    if layer.slot_map is None:
        return route_pack(logits_TE, x_TD, layer.top_k, layer.norm_topk_prob, layer.hit_counts_E, rows_per_rank,
                          out, dests, signal)
    # each token-copy to one replica's global slot
    ids_TK, weights_TK = routing.route(logits_TE, layer.top_k, layer.norm_topk_prob, layer.hit_counts_E,
                                            x_TD.dtype)[:2]
    ids_R = ids_TK.flatten()
    counts_E = torch.zeros(layer.w_gate_ED.shape[0], dtype=torch.int64, device=x_TD.device)
    counts_E.scatter_add_(0, ids_R, torch.ones_like(ids_R))
    ids_TK = layer.slot_map.route(ids_TK, counts_E).contiguous()
    return pack(x_TD, ids_TK, weights_TK, rows_per_rank, out, dests, signal)


def gathered_moe(layer, x_TD: Tensor, rows_per_rank: int, add_norm: AddNorm | None = None, gemms=None) -> Tensor:
    """MoELayer's output for this rank's x_TD, every rank passing the same rows_per_rank
    (>= each rank's token count); adds the routed experts to layer.hit_counts_E. With add_norm,
    add_norm(the output) (fused into the exchange's sum). Steps that fit comm.exchange's
    buffers exchange through it (the exchange's protocol), others through NCCL. gemms: the
    quantized experts' GEMMs (local_partials')."""
    comm: ExpertComm = layer.comm
    num_tokens, hidden = x_TD.shape
    num_local = layer.w_gate_up_LGD.shape[0] if gemms is None else gemms.num_slots
    w_gate_up_LGD, w_down_LDF = (layer.w_gate_up_LGD, layer.w_down_LDF) if gemms is None else (None, None)
    id_offset = 1 + comm.rank * num_local
    x_TD = x_TD.contiguous()
    exchange = comm.exchange
    if exchange is not None and exchange.fits(rows_per_rank, row_width(hidden, layer.top_k, x_TD.dtype)):
        _route_and_pack(layer, x_TD, rows_per_rank, *exchange.row_target(rows_per_rank))
        recv_JW, wait = exchange.gathered_rows(rows_per_rank)
        local_partials(recv_JW, hidden, layer.top_k, id_offset, w_gate_up_LGD, w_down_LDF, None,
                       *exchange.partial_target(rows_per_rank), wait=wait, gemms=gemms)
        # The exchange rounds the fp32 sum to the model dtype in its own kernel.
        return exchange.reduce(num_tokens, rows_per_rank, x_TD.dtype, add_norm)
    send_BW = _route_and_pack(layer, x_TD, rows_per_rank)
    recv_JW = send_BW.new_empty(comm.world_size * rows_per_rank, send_BW.shape[1])
    comm.all_gather(recv_JW, send_BW)
    partial_JD = local_partials(recv_JW, hidden, layer.top_k, id_offset, w_gate_up_LGD, w_down_LDF, gemms=gemms)
    out_BD = partial_JD.new_empty(rows_per_rank, hidden)
    comm.reduce_scatter(out_BD, partial_JD)  # NCCL sums in fp32
    out_TD = out_BD[:num_tokens].to(x_TD.dtype)
    return out_TD if add_norm is None else add_norm(out_TD)
