"""The expert-parallel MoE layer's four steps in torch: gate -> dispatch -> experts -> combine.

Legend: T tokens of this rank, D hidden, F expert width, G = 2F (gate and up
fused), E experts, N ranks, L = E / N local experts, K experts per token,
W = D + 8K / itemsize columns of a dispatched row (the token's hidden row,
then its K expert ids and K fp32 weights bit-cast), J rows this rank
receives (one per (token, source rank); N * C / min(K, L) in the
fixed-capacity mode), P (received row, local expert) pairs this rank's
experts compute.

Expert e lives on rank e // L. Every rank runs every step of every MoE layer,
even with no tokens (an idle step), so that the collectives of all ranks line
up. With one rank, `ExpertComm.local()` turns the exchanges into copies but the
same dispatch/combine code runs. experts is moe_experts.experts (or, on CUDA,
its Triton form): this module holds the other three steps.

On CUDA with several ranks the Triton MoE backend takes kernels/moe_ep.py
for the gather design: every rank gathers every rank's rows and
reduce-scatters fp32 partials (a few kernels and two collectives a layer, the
same roundings as the fixed-capacity mode below). Which design a step takes,
the gather or the deduplicated all-to-all below, is the group's
exchange/cost_model.DispatchPlan (--ep-dispatch); what follows is the
all-to-all, on the CPU and on CUDA, and with `everywhere` the gather design in
torch (every token to every rank at a fixed capacity: the bytes of a gather
and a reduce-scatter, through the same all_to_all, since gloo has no
reduce-scatter; the same sums, so the same bits as the all-to-all).

Dispatch sends a token's row at most once to each rank, whatever number of
its K experts live there, with the token's K expert ids and weights appended
(one all_to_all: no separate metadata message). The receiving rank expands
its rows to one (row, local expert) pair per expert it holds, sorted by
expert for the grouped GEMM. Combine weights each pair's output, sums a
row's pairs into ONE fp32 partial (in the token's expert order), sends the
partials back (one row per token and rank again), and the token's rank adds
its partials over the ranks and rounds once to the model dtype.

Two modes, picked per step and the same on every rank (the caller passes
`capacity`, see `step_capacity`):

- Host splits (capacity None): one all_to_all of the per-peer row and pair
  counts, the split sizes come to the host (a device sync per layer), then
  one all_to_all of exactly the rows. No padding: for big steps (prefill).
- Fixed capacity (capacity C): C counts (token, expert) copies per peer, as
  before the deduplication: C = bucket * min(K, L), the bucket being the
  most tokens of any rank rounded up (step_capacity). Every rank sends every
  peer C / min(K, L) = bucket rows, its tokens for that peer in token order,
  then zero rows (ids travel plus one, so a zero id is no expert: padding
  reaches no expert). One all_to_all with equal splits, fixed shapes, no
  host sync: what a CUDA graph can capture (decode). A token sends at most
  one row to a peer, so nothing is ever dropped. The expert buffers hold
  the most pairs the rows can carry, N * bucket * min(K, L).

Rounding. The products weight * output are rounded to the model dtype as
before the deduplication and summed in fp32 with one final rounding, as
before; what changed is how the fp32 additions associate: each rank sums its
own experts' products (in increasing expert order), then the token's rank
sums the partials of the ranks in one reduction. With one rank, when a
token's experts all live on one rank, or with K <= 2 (additions commute) the
bits equal a single sum over the K products; otherwise they may differ by the
fp32 rounding of the regrouping (about 1e-7 relative), which can flip the
final bf16 rounding of an element. Both modes compute the same sums (the
CPU tests check them bit for bit).

Replicas (expert_map.py): with S spare slots per rank, a rank holds Q = L + S
physical slots, and dispatch works on slots instead of experts: a `SlotMap`
turns each token-copy's expert into one of its replicas' global slot, and
from there on "expert" above reads "slot" (pairs and GEMM groups are per
slot, C = bucket * min(K, Q)). A rank's spares need not follow its
primaries in logical expert order: the ids a row carries stay in the
token's logical expert order, and each rank sums its products in that
order. Which replica ran changes only which rank's partial an expert's
product falls in, so only the fp32 grouping above (never with K <= 2).
"""
import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from services.model.exchange.comm import ExpertComm
from services.model.expert_map import SlotMap


def local_expert_ids(num_experts: int, rank: int, world_size: int) -> range:
    """The global experts rank `rank` of `world_size` holds: a contiguous slice."""
    if num_experts % world_size:
        raise ValueError(f"{num_experts} experts do not split evenly over {world_size} ranks")
    per_rank = num_experts // world_size
    return range(rank * per_rank, (rank + 1) * per_rank)


def step_capacity(max_tokens_per_rank: int, top_k: int, num_local_experts: int,
                  max_fixed_tokens: int) -> int | None:
    """The dispatch capacity of a step (C (token, expert) copies per peer), or None for
    host splits.

    `max_tokens_per_rank` is the largest token count of any rank in the step,
    so every rank computes the same answer. Steps up to `max_fixed_tokens`
    tokens per rank (0 disables the mode) get the fixed-capacity mode with
    the token count rounded up to a power of two (the batch-size buckets a
    CUDA graph is captured for), times min(K, L): the most copies one rank
    can route to one peer. Its messages carry C / min(K, L) token rows, the
    bucket. Bigger steps take host splits, which send no padding.
    """
    if max_fixed_tokens <= 0 or max_tokens_per_rank > max_fixed_tokens:
        return None
    bucket = 1 << max(max_tokens_per_rank - 1, 0).bit_length()
    return bucket * min(top_k, num_local_experts)


@dataclasses.dataclass(frozen=True, slots=True)
class DispatchMeta:
    """What experts and combine need: the received rows' pairs, and where partials come back."""

    offsets_L: Tensor  # int32 cumulative pairs per local expert: the grouped-GEMM offsets
    # Per received row and k: the row of y_PD holding that expert's output and its weight (model
    # dtype). An expert of another rank gets weight 0 and a row of the same token (a finite value).
    pairs_JK: Tensor
    weights_JK: Tensor
    # Per token and rank: whether the token went there, and the row of combine's returned buffer
    # holding that rank's partial sum.
    is_sent_TN: Tensor
    returned_TN: Tensor
    # Host splits: rows sent to and received from each rank (None in fixed-capacity mode).
    send_splits: tuple[int, ...] | None = None
    recv_splits: tuple[int, ...] | None = None
    # Fixed capacity: copies per peer, as dispatch got it (None in host-split mode).
    capacity: int | None = None


def gate(x_TD: Tensor, w_gate_ED: Tensor, top_k: int,
         norm_topk_prob: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax top-k routing: (ids_TK, weights_TK in x's dtype, int64 counts_E)."""
    probs_TE = torch.softmax(F.linear(x_TD, w_gate_ED), dim=-1, dtype=torch.float32)
    weights_TK, ids_TK = torch.topk(probs_TE, top_k, dim=-1)
    if norm_topk_prob:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    ids_R = ids_TK.flatten()
    # scatter_add rather than bincount: no host sync on CUDA.
    counts_E = torch.zeros(w_gate_ED.shape[0], dtype=torch.int64, device=x_TD.device)
    counts_E.scatter_add_(0, ids_R, torch.ones_like(ids_R))
    return ids_TK, weights_TK.to(x_TD.dtype), counts_E


def dispatch(x_TD: Tensor, ids_TK: Tensor, weights_TK: Tensor, counts_E: Tensor,
             comm: ExpertComm, capacity: int | None = None,
             slot_map: SlotMap | None = None, everywhere: bool = False) -> tuple[Tensor, DispatchMeta]:
    """Sends each token's row once to every rank holding one of its experts; returns
    x_PD, the received rows once per local expert they need, sorted by local expert.

    capacity None: host splits; an int: fixed capacity, C (token, expert) copies
    per peer, so C / min(K, L) token rows per peer (ValueError if that is zero or
    fewer than this rank's tokens). With a slot_map the tokens go to replica
    slots and x_PD is sorted by local slot. everywhere (needs a capacity): every
    token's row goes to every rank, the gather design. See the module doc.
    """
    # Each token's experts in increasing order, so that combine sums in that order.
    ids_TK, perm_TK = ids_TK.sort(dim=1)
    weights_TK = weights_TK.gather(1, perm_TK)
    num_slots = counts_E.shape[0]
    if slot_map is not None:  # from here on, "expert" means physical slot
        ids_TK, num_slots = slot_map.route(ids_TK, counts_E), slot_map.num_slots
    num_ranks, num_tokens = comm.world_size, x_TD.shape[0]
    num_local = num_slots // num_ranks
    dest_TK = ids_TK // num_local
    is_sent_TN = torch.zeros(num_tokens, num_ranks, dtype=torch.bool, device=x_TD.device).scatter_(1, dest_TK, True)
    # The rows packed per rank: the ranks holding one of the token's experts, or with everywhere
    # all of them; combine takes partials only from the first (a rank holding none of a row's
    # experts computes no pair for it, so its partial reads rows the experts left unset).
    is_packed_TN = torch.ones_like(is_sent_TN) if everywhere else is_sent_TN
    if everywhere and capacity is None:
        raise ValueError("the gather design (everywhere) needs a fixed capacity")
    if capacity is None:
        sent_N, send_splits, recv_splits, num_pairs = _exchange_counts(is_sent_TN, dest_TK, comm)
        before_N = sent_N.cumsum(0) - sent_N - 1
        num_send, num_recv = sum(send_splits), sum(recv_splits)
    else:
        copies_per_token = min(ids_TK.shape[1], num_local)
        rows_per_peer = capacity // copies_per_token
        if rows_per_peer < max(num_tokens, 1):
            raise ValueError(f"the capacity of {capacity} copies per peer holds {rows_per_peer} tokens of up to "
                             f"{copies_per_token} copies each, not {max(num_tokens, 1)}")
        send_splits = recv_splits = None
        before_N = torch.arange(-1, num_ranks * rows_per_peer - 1, rows_per_peer, device=x_TD.device)
        num_send = num_recv = num_ranks * rows_per_peer
        num_pairs = num_recv * copies_per_token
    # A token's row of the send buffer per rank: the rank's block (before_N: the row before
    # it), then the token's place in it. Where the token does not go, a row of another token
    # or -1 (the last row): in bounds for combine's gather, which discards it.
    returned_TN = is_packed_TN.cumsum(0) + before_N
    send_JW = _pack(x_TD, ids_TK, weights_TK, is_packed_TN, returned_TN, num_send)
    recv_JW = send_JW.new_empty(num_recv, send_JW.shape[1])
    comm.all_to_all(recv_JW, send_JW, recv_splits, send_splits)
    x_PD, offsets_L, pairs_JK, recv_weights_JK = _unpack(recv_JW, x_TD.shape[1], comm.rank, num_local, num_pairs)
    return x_PD, DispatchMeta(offsets_L=offsets_L, pairs_JK=pairs_JK, weights_JK=recv_weights_JK,
                              is_sent_TN=is_sent_TN, returned_TN=returned_TN, send_splits=send_splits,
                              recv_splits=recv_splits, capacity=capacity)


def _exchange_counts(is_sent_TN: Tensor, dest_TK: Tensor,
                     comm: ExpertComm) -> tuple[Tensor, tuple[int, ...], tuple[int, ...], int]:
    """Host splits: rows to each rank, then on the host the send and receive splits and the
    pairs this rank's experts compute (one small all_to_all and one device sync)."""
    num_ranks = comm.world_size
    sent_N = is_sent_TN.sum(0)
    dest_R = dest_TK.flatten()
    pairs_N = torch.zeros_like(sent_N).scatter_add_(0, dest_R, torch.ones_like(dest_R))
    recv_N2 = torch.empty(num_ranks, 2, dtype=sent_N.dtype, device=sent_N.device)
    comm.all_to_all(recv_N2, torch.stack((sent_N, pairs_N), dim=1))
    host = torch.cat((sent_N, recv_N2[:, 0], recv_N2[:, 1].sum(0, keepdim=True))).tolist()
    return sent_N, tuple(host[:num_ranks]), tuple(host[num_ranks:-1]), host[-1]


def _pack(x_TD: Tensor, ids_TK: Tensor, weights_TK: Tensor, is_sent_TN: Tensor, rows_TN: Tensor,
          num_rows: int) -> Tensor:
    """The send buffer [num_rows, W]: each token's [hidden row | ids + 1 | fp32 weights] at
    its rows_TN where it is sent, zero rows elsewhere (id 0: no expert)."""
    (num_tokens, hidden), top_k, dtype = x_TD.shape, ids_TK.shape[1], x_TD.dtype
    assert 4 % dtype.itemsize == 0 and hidden * dtype.itemsize % 4 == 0, f"int32 ids do not fit {dtype} rows"
    table_UW = x_TD.new_zeros(num_tokens + 1, hidden + 8 * top_k // dtype.itemsize)  # U = T + 1: a zero row last
    table_UW[:num_tokens, :hidden] = x_TD
    meta_UM = table_UW[:num_tokens, hidden:].view(torch.int32)
    meta_UM[:, :top_k] = ids_TK + 1
    meta_UM[:, top_k:].view(torch.float32).copy_(weights_TK)
    # The token of each row (T: the zero row); tokens not sent to a rank write row num_rows, cut off.
    token_J = torch.full((num_rows + 1,), num_tokens, dtype=torch.int64, device=x_TD.device)
    tokens_TN = torch.arange(num_tokens, device=x_TD.device)[:, None].expand_as(rows_TN)
    token_J.scatter_(0, rows_TN.where(is_sent_TN, num_rows).flatten(), tokens_TN.flatten())
    return table_UW[token_J[:num_rows]]


def _unpack(recv_JW: Tensor, hidden: int, rank: int, num_local: int,
            num_pairs: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The received rows as x_PD: one row per (row, local expert) pair, sorted by local expert,
    then by row (the first num_pairs: all pairs there are); offsets_L, pairs_JK, weights_JK."""
    x_JD, meta_JM = recv_JW[:, :hidden], recv_JW[:, hidden:].view(torch.int32)
    top_k = meta_JM.shape[1] // 2
    local_JK = meta_JM[:, :top_k] - (1 + rank * num_local)
    is_here_JK = (local_JK >= 0) & (local_JK < num_local)
    key_X = local_JK.where(is_here_JK, num_local).flatten()  # X = J * K; padding and other ranks last
    sorted_X, order_X = key_X.sort(stable=True)
    x_PD = x_JD[order_X[:num_pairs] // top_k]
    # Pairs up to each local expert: the grouped-GEMM offsets.
    local_ids_L = torch.arange(num_local, dtype=sorted_X.dtype, device=recv_JW.device)
    offsets_L = torch.searchsorted(sorted_X, local_ids_L, right=True, out_int32=True)
    # Where each (row, k) pair landed. A pair of another rank (weight 0) reads the row's first
    # pair here, so never a row the grouped GEMM left unset (a padding row: the last, unread).
    pairs_JK = torch.empty_like(order_X).scatter_(0, order_X, torch.arange(key_X.shape[0], device=recv_JW.device))
    pairs_JK = pairs_JK.view(local_JK.shape)
    first_J1 = pairs_JK.where(is_here_JK, max(num_pairs - 1, 0)).amin(dim=1, keepdim=True)
    pairs_JK = pairs_JK.where(is_here_JK, first_J1)
    weights_JK = meta_JM[:, top_k:].view(torch.float32).where(is_here_JK, 0).to(recv_JW.dtype)
    return x_PD, offsets_L, pairs_JK, weights_JK


def combine(y_PD: Tensor, meta: DispatchMeta, comm: ExpertComm) -> Tensor:
    """Weights and sums each received row's outputs into one fp32 partial, returns the
    partials to their tokens' ranks, and sums each token's over the ranks: out_TD."""
    # The products in y's dtype (as a single-rank sum rounds them), summed in fp32.
    partial_JD = (y_PD[meta.pairs_JK] * meta.weights_JK[..., None]).sum(dim=1, dtype=torch.float32)
    if meta.capacity is None:
        returned_ID = partial_JD.new_empty(sum(meta.send_splits), partial_JD.shape[1])
        comm.all_to_all(returned_ID, partial_JD, meta.send_splits, meta.recv_splits)
    else:
        returned_ID = torch.empty_like(partial_JD)
        comm.all_to_all(returned_ID, partial_JD)
    partials_TND = returned_ID[meta.returned_TN].where(meta.is_sent_TN[..., None], 0)
    return partials_TND.sum(dim=1).to(y_PD.dtype)
