"""The expert-parallel MoE layer as four steps: gate -> dispatch -> experts -> combine.

Legend: T tokens of this rank, D hidden, F expert width, G = 2F (gate and up
fused), E experts, N ranks, L = E / N local experts, K experts per token,
R = T * K token-copies this rank routes, P rows this rank's experts compute,
C slots per peer and S = H + C rows per peer message in the fixed-capacity
mode (H header rows carry the counts).

Expert e lives on rank e // L. Every rank runs every step of every MoE layer,
even with no tokens (an idle step), so that the collectives of all ranks line
up. With one rank, `ExpertComm.local()` turns the exchanges into copies but the
same dispatch/combine code runs.

Dispatch has two modes, picked per step and the same on every rank (the
caller passes `capacity`, see `step_capacity`):

- Host splits (capacity None): one all_to_all of the per-expert counts, the
  split sizes come to the host (a device sync per layer), then one
  all_to_all of exactly the routed rows. No padding: for big steps (prefill).
- Fixed capacity (capacity C): every rank sends every peer one message of
  S = H + C rows: H header rows holding its per-local-expert row counts
  (int32, bit-cast into the buffer), its rows for that peer sorted by expert,
  then zeros. One all_to_all with equal splits, fixed shapes, no host sync:
  what a CUDA graph can capture (decode). A token's K experts are distinct,
  so it sends at most min(K, L) rows to one peer: C = max tokens of any
  rank * min(K, L) is always enough, and nothing is ever dropped.

Combine returns the rows the way they came and sums each token's K outputs in
increasing expert order, in one fixed-order reduction (no atomics): the
result does not depend on N or on the mode.

Replicas (expert_map.py): with S spare slots per rank, a rank holds Q = L + S
physical slots, and dispatch works on slots instead of experts: a `SlotMap`
turns each token-copy's expert into one of its replicas' global slot, and
from there on "expert" above reads "slot" (the messages carry Q counts, C
bounds min(K, Q) rows per token). Combine still sums in increasing logical
expert order, so which replica ran does not change a bit of the output.
"""

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from services.model.expert_map import SlotMap


# Rows per block of the expert matmuls of a layer with spare slots on the CPU (see experts):
# products of at least this many rows gave each row the same bits whatever the row count,
# for Qwen3-30B-A3B's and -235B-A22B's expert shapes (D 2048/4096, F 768/1536) with torch
# 2.13's CPU BLAS, one thread.
CPU_REPLICA_ROW_BLOCK = 32


class ExpertComm:
    """The process group the experts are spread over (None: a single local rank)."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.rank = 0 if group is None else dist.get_rank(group)
        self.world_size = 1 if group is None else dist.get_world_size(group)

    @classmethod
    def local(cls) -> "ExpertComm":
        """One rank holding every expert; no torch.distributed needed."""
        return cls(None)

    def all_to_all(self, out: Tensor, inp: Tensor, out_splits: Sequence[int] | None = None,
                   in_splits: Sequence[int] | None = None) -> None:
        """all_to_all_single along dim 0: in_splits[r] rows go to rank r, out_splits[r]
        come from it; None splits dim 0 into equal parts."""
        if self.group is None:
            out.copy_(inp)
        else:
            dist.all_to_all_single(out, inp, None if out_splits is None else list(out_splits),
                                   None if in_splits is None else list(in_splits), group=self.group)

    def max_over_ranks(self, value: int, device) -> int:
        """The largest `value` any rank passes (one small all_reduce and a host sync)."""
        if self.group is None:
            return value
        value_1 = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(value_1, op=dist.ReduceOp.MAX, group=self.group)
        return int(value_1.item())


def local_expert_ids(num_experts: int, rank: int, world_size: int) -> range:
    """The global experts rank `rank` of `world_size` holds: a contiguous slice."""
    if num_experts % world_size:
        raise ValueError(f"{num_experts} experts do not split evenly over {world_size} ranks")
    per_rank = num_experts // world_size
    return range(rank * per_rank, (rank + 1) * per_rank)


def step_capacity(max_tokens_per_rank: int, top_k: int, num_local_experts: int,
                  max_fixed_tokens: int) -> int | None:
    """The dispatch capacity (slots per peer) of a step, or None for host splits.

    `max_tokens_per_rank` is the largest token count of any rank in the step,
    so every rank computes the same answer. Steps up to `max_fixed_tokens`
    tokens per rank (0 disables the mode) get the fixed-capacity mode with
    the token count rounded up to a power of two (the batch-size buckets a
    CUDA graph is captured for), times min(K, L): the most rows one rank can
    send one peer. Bigger steps take host splits, which send no padding.
    """
    if max_fixed_tokens <= 0 or max_tokens_per_rank > max_fixed_tokens:
        return None
    bucket = 1 << max(max_tokens_per_rank - 1, 0).bit_length()
    return bucket * min(top_k, num_local_experts)


@dataclasses.dataclass(frozen=True, slots=True)
class DispatchMeta:
    """What combine needs to send expert outputs back and sum them per token."""

    weights_TK: Tensor  # routing weights, each token's experts in increasing expert order
    src_TK: Tensor  # the row of combine's returned buffer that holds each (token, k) output
    order_P: Tensor  # the received row (slot) at each position of the expert-sorted buffer
    offsets_L: Tensor  # int32 cumulative rows per local expert: the grouped-GEMM offsets
    # Host splits: rows sent to and received from each rank (None in fixed-capacity mode).
    send_splits: tuple[int, ...] | None = None
    recv_splits: tuple[int, ...] | None = None
    # Fixed capacity: slots per peer (None in host-split mode).
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
             slot_map: SlotMap | None = None) -> tuple[Tensor, DispatchMeta]:
    """Sends each token-copy to its expert's rank; returns x_PD sorted by local expert.

    capacity None: host splits; an int: fixed capacity, C slots per peer
    (ValueError if this rank's tokens could overflow it). With a slot_map the
    copies go to replica slots and x_PD is sorted by local slot. See the module doc.
    """
    # Each token's experts in increasing order, so that combine sums in that order.
    ids_TK, perm_TK = ids_TK.sort(dim=1)
    weights_TK = weights_TK.gather(1, perm_TK)
    if slot_map is not None:  # from here on, "expert" means physical slot
        ids_TK = slot_map.route(ids_TK, counts_E)
        counts_E = torch.zeros(slot_map.num_slots, dtype=torch.int64, device=x_TD.device).scatter_add_(
            0, ids_TK.flatten(), torch.ones_like(ids_TK.flatten()))
    # Sorting by global expert also groups the rows by destination rank.
    order_R = ids_TK.flatten().argsort(stable=True)
    send_x_RD = x_TD[order_R // ids_TK.shape[1]]
    if capacity is None:
        x_PD, fields = _exchange_host_splits(send_x_RD, counts_E, comm)
        # The rows come back in the order they were sent: row r is routed row order_R[r].
        src_R = torch.arange(order_R.shape[0], device=x_TD.device)
    else:
        num_peer_rows = ids_TK.shape[0] * min(ids_TK.shape[1], counts_E.shape[0] // comm.world_size)
        if num_peer_rows > capacity:
            raise ValueError(f"{ids_TK.shape[0]} tokens may send {num_peer_rows} rows to one rank, "
                             f"more than the capacity of {capacity} slots per peer")
        x_PD, src_R, fields = _exchange_fixed(send_x_RD, ids_TK.flatten()[order_R], counts_E, comm, capacity)
    src_TK = torch.empty_like(src_R).scatter_(0, order_R, src_R).view(ids_TK.shape)
    return x_PD, DispatchMeta(weights_TK=weights_TK, src_TK=src_TK, **fields)


def _exchange_host_splits(send_x_RD: Tensor, counts_E: Tensor, comm: ExpertComm) -> tuple[Tensor, dict]:
    num_ranks = comm.world_size
    num_local = counts_E.shape[0] // num_ranks
    # Counts first: each rank learns how many rows of each local expert every rank sends.
    recv_counts_NL = torch.empty_like(counts_E)
    comm.all_to_all(recv_counts_NL, counts_E)
    recv_counts_NL = recv_counts_NL.view(num_ranks, num_local)
    splits = torch.stack((counts_E.view(num_ranks, num_local).sum(1), recv_counts_NL.sum(1)))
    send_splits, recv_splits = (tuple(row) for row in splits.tolist())

    recv_x_PD = send_x_RD.new_empty(sum(recv_splits), send_x_RD.shape[1])
    comm.all_to_all(recv_x_PD, send_x_RD, recv_splits, send_splits)
    # Rows arrive grouped by source rank, then local expert: regroup by local expert.
    local_ids_P = torch.arange(num_local, device=counts_E.device).repeat(num_ranks).repeat_interleave(
        recv_counts_NL.flatten(), output_size=recv_x_PD.shape[0])
    order_P = local_ids_P.argsort(stable=True)
    offsets_L = recv_counts_NL.sum(0).cumsum(0).to(torch.int32)
    return recv_x_PD[order_P], dict(order_P=order_P, offsets_L=offsets_L,
                                    send_splits=send_splits, recv_splits=recv_splits)


def _exchange_fixed(send_x_RD: Tensor, ids_R: Tensor, counts_E: Tensor, comm: ExpertComm,
                    capacity: int) -> tuple[Tensor, Tensor, dict]:
    """The fixed-capacity exchange; also returns each routed row's slot (of N * C)."""
    num_ranks, (num_routed, hidden) = comm.world_size, send_x_RD.shape
    num_local = counts_E.shape[0] // num_ranks
    device = counts_E.device
    num_header = _num_header_rows(num_local, send_x_RD)
    counts_NL = counts_E.view(num_ranks, num_local)
    sent_N = counts_NL.sum(1)
    dest_R = ids_R // num_local
    # A routed row's slot: its destination's block of C, then its place among the rows to it.
    slot_R = dest_R * capacity + torch.arange(num_routed, device=device) - (sent_N.cumsum(0) - sent_N)[dest_R]

    send_NSD = send_x_RD.new_zeros(num_ranks, num_header + capacity, hidden)
    _header(send_NSD)[:, :num_local] = counts_NL
    send_NSD.view(-1, hidden).index_copy_(0, _slot_rows(slot_R, capacity, num_header), send_x_RD)
    recv_NSD = torch.empty_like(send_NSD)
    comm.all_to_all(recv_NSD, send_NSD)

    # Slot j of peer n holds local expert l while j < ends[n, l]; l = L marks the padding.
    recv_counts_NL = _header(recv_NSD)[:, :num_local]
    slots_NC = torch.arange(capacity, device=device).repeat(num_ranks, 1)
    local_ids_NC = torch.searchsorted(recv_counts_NL.cumsum(1), slots_NC, right=True)
    order_P = local_ids_NC.flatten().argsort(stable=True)  # expert-sorted, padding last
    x_PD = recv_NSD.view(-1, hidden)[_slot_rows(order_P, capacity, num_header)]
    offsets_L = recv_counts_NL.sum(0).cumsum(0).to(torch.int32)
    return x_PD, slot_R, dict(order_P=order_P, offsets_L=offsets_L, capacity=capacity)


def _num_header_rows(num_local: int, like_D: Tensor) -> int:
    """Rows of a peer message that hold its num_local int32 counts."""
    row_bytes = like_D.shape[-1] * like_D.element_size()
    assert row_bytes % 4 == 0, f"a row of {row_bytes} bytes cannot carry int32 counts"
    return -(-num_local * 4 // row_bytes)


def _header(msg_NSD: Tensor) -> Tensor:
    """Each peer message's bytes as int32 [N, S * D * itemsize / 4]; the counts lead."""
    return msg_NSD.view(msg_NSD.shape[0], -1).view(torch.int32)


def _slot_rows(slot: Tensor, capacity: int, num_header: int) -> Tensor:
    """The row of a flattened [N, H + C, D] message buffer holding each slot of [N * C]."""
    return slot // capacity * (num_header + capacity) + num_header + slot % capacity


def experts(x_PD: Tensor, offsets_L: Tensor, w_gate_up_LGD: Tensor, w_down_LDF: Tensor,
            row_block: int = 0) -> Tensor:
    """The local experts' SwiGLU MLPs over rows grouped by expert: y_PD.

    row_block > 0 multiplies every group in blocks of exactly that many rows
    (zero padded), so that a row's result does not depend on how many rows
    share its expert: CPU BLAS takes other kernels for small matrices (a
    1-row product differs from the same row in a 16-row one in the last bit),
    and with replicas an expert's rows split over slots differently.
    """
    gate_PF, up_PF = grouped_mm(x_PD, w_gate_up_LGD, offsets_L, row_block).chunk(2, dim=-1)
    return grouped_mm(F.silu(gate_PF) * up_PF, w_down_LDF, offsets_L, row_block)


def combine(y_PD: Tensor, meta: DispatchMeta, comm: ExpertComm) -> Tensor:
    """Sends expert outputs back to their tokens' ranks; returns the weighted sum out_TD."""
    arrived_PD = torch.empty_like(y_PD)  # back in arrival order (fixed capacity: padding included)
    arrived_PD[meta.order_P] = y_PD
    num_tokens, top_k = meta.weights_TK.shape
    if meta.capacity is None:
        returned_RD = y_PD.new_empty(num_tokens * top_k, y_PD.shape[1])
        comm.all_to_all(returned_RD, arrived_PD, meta.send_splits, meta.recv_splits)
    else:
        returned_RD = torch.empty_like(arrived_PD)
        comm.all_to_all(returned_RD, arrived_PD)
    y_TKD = returned_RD[meta.src_TK.flatten()].view(num_tokens, top_k, y_PD.shape[1])
    return (y_TKD * meta.weights_TK[..., None]).sum(dim=1)


def grouped_mm(x_PI: Tensor, w_LOI: Tensor, offsets_L: Tensor, row_block: int = 0) -> Tensor:
    """Row group l of x (ending at offsets_L[l]) times w_LOI[l].T: [P, O]
    (row_block > 0: in zero-padded blocks of that many rows, see experts)."""
    if row_block:
        return _blocked_grouped_mm(x_PI, w_LOI, offsets_L, row_block)
    if _has_grouped_mm(x_PI.device.type, x_PI.dtype):
        return torch._grouped_mm(x_PI, w_LOI.transpose(-2, -1), offs=offsets_L)
    out_PO = x_PI.new_empty(x_PI.shape[0], w_LOI.shape[1])
    start = 0
    for expert, end in enumerate(offsets_L.tolist()):
        out_PO[start:end] = x_PI[start:end] @ w_LOI[expert].T
        start = end
    return out_PO


def _blocked_grouped_mm(x_PI: Tensor, w_LOI: Tensor, offsets_L: Tensor, row_block: int) -> Tensor:
    out_PO = x_PI.new_zeros(x_PI.shape[0], w_LOI.shape[1])
    start = 0
    for expert, end in enumerate(offsets_L.tolist()):
        for first in range(start, end, row_block):
            rows = min(row_block, end - first)
            block_BI = x_PI.new_zeros(row_block, x_PI.shape[1])
            block_BI[:rows] = x_PI[first:first + rows]
            out_PO[first:first + rows] = (block_BI @ w_LOI[expert].T)[:rows]
        start = end
    return out_PO


@functools.cache
def _has_grouped_mm(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs for this device and dtype (probed once)."""
    try:
        torch._grouped_mm(torch.zeros(16, 16, dtype=dtype, device=device_type),
                          torch.zeros(1, 16, 16, dtype=dtype, device=device_type),
                          offs=torch.tensor([16], dtype=torch.int32, device=device_type))
    except (AttributeError, NotImplementedError, RuntimeError):
        return False
    return True


class MoELayer:
    """One MoE feed-forward holding its rank's slice of experts."""

    def __init__(self, w_gate_ED: Tensor, w_gate_up_LGD: Tensor, w_down_LDF: Tensor, *,
                 top_k: int, norm_topk_prob: bool, comm: ExpertComm, hit_counts_E: Tensor,
                 slot_map: SlotMap | None = None):
        # With spare slots (slot_map set) the expert weights have Q = L + S rows, spares last.
        self.w_gate_ED, self.w_gate_up_LGD, self.w_down_LDF = w_gate_ED, w_gate_up_LGD, w_down_LDF
        self.top_k, self.norm_topk_prob, self.comm = top_k, norm_topk_prob, comm
        # A view into the model's hit_counts_LE: tokens this rank routed to each (logical) expert.
        self.hit_counts_E = hit_counts_E
        self.slot_map = slot_map
        # With replicas on the CPU: fixed-size row blocks, so outputs do not depend on the replica.
        self.row_block = CPU_REPLICA_ROW_BLOCK if slot_map is not None and w_gate_ED.device.type == "cpu" else 0

    @classmethod
    def from_weights(cls, weights: Mapping[str, Tensor], prefix: str, expert_ids: Sequence[int], *,
                     num_spare_slots: int = 0, **kwargs) -> "MoELayer":
        """Stacks the hub's per-expert tensors under `prefix` (`model.layers.N.mlp.`),
        plus `num_spare_slots` zero slots for replicas (kwargs then need a slot_map)."""
        def stack(proj: str) -> Tensor:
            w_LOI = torch.stack([weights[f"{prefix}experts.{e}.{proj}.weight"] for e in expert_ids])
            if not num_spare_slots:
                return w_LOI
            return torch.cat((w_LOI, w_LOI.new_zeros(num_spare_slots, *w_LOI.shape[1:])))

        w_gate_up_LGD = torch.cat((stack("gate_proj"), stack("up_proj")), dim=1)
        return cls(weights[f"{prefix}gate.weight"], w_gate_up_LGD, stack("down_proj"), **kwargs)

    def load_slot(self, slot: int, weights: Mapping[str, Tensor], expert_prefix: str) -> None:
        """Copies one expert's hub tensors (`expert_prefix` = `...mlp.experts.E.`) into local slot `slot`."""
        w_gate_up_GD = torch.cat((weights[expert_prefix + "gate_proj.weight"],
                                  weights[expert_prefix + "up_proj.weight"]))
        self.w_gate_up_LGD[slot].copy_(w_gate_up_GD)
        self.w_down_LDF[slot].copy_(weights[expert_prefix + "down_proj.weight"])

    def __call__(self, x_TD: Tensor, capacity: int | None = None) -> Tensor:
        """The layer on this rank's tokens; `capacity` picks the dispatch mode (see dispatch)."""
        if self.comm.world_size == 1 and x_TD.is_cuda:  # one rank, few tokens: fused kernels
            from services.model import triton_fused  # imports triton: CUDA only

            if triton_fused.ENABLED and x_TD.shape[0] <= triton_fused.MOE_MAX_TOKENS:
                return triton_fused.fused_moe(x_TD, self.w_gate_ED, self.w_gate_up_LGD, self.w_down_LDF,
                                              self.top_k, self.norm_topk_prob, self.hit_counts_E)
        ids_TK, weights_TK, counts_E = gate(x_TD, self.w_gate_ED, self.top_k, self.norm_topk_prob)
        self.hit_counts_E += counts_E
        x_PD, meta = dispatch(x_TD, ids_TK, weights_TK, counts_E, self.comm, capacity, self.slot_map)
        y_PD = experts(x_PD, meta.offsets_L, self.w_gate_up_LGD, self.w_down_LDF, self.row_block)
        return combine(y_PD, meta, self.comm)
