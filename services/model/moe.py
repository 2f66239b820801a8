"""The expert-parallel MoE layer as four steps: gate -> dispatch -> experts -> combine.

Legend: T tokens of this rank, D hidden, F expert width, G = 2F (gate and up
fused), E experts, N ranks, L = E / N local experts, K experts per token,
R = T * K token-copies this rank routes, P rows this rank's experts compute.

Expert e lives on rank e // L. Every rank runs every step of every MoE layer,
even with no tokens (an idle step), so that the collectives of all ranks line
up. With one rank, `ExpertComm.local()` turns the exchanges into copies but the
same dispatch/combine code runs.
"""

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor


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

    def all_to_all(self, out: Tensor, inp: Tensor, out_splits: Sequence[int],
                   in_splits: Sequence[int]) -> None:
        """all_to_all_single along dim 0: in_splits[r] rows go to rank r, out_splits[r] come from it."""
        if self.group is None:
            out.copy_(inp)
        else:
            dist.all_to_all_single(out, inp, list(out_splits), list(in_splits), group=self.group)


def local_expert_ids(num_experts: int, rank: int, world_size: int) -> range:
    """The global experts rank `rank` of `world_size` holds: a contiguous slice."""
    if num_experts % world_size:
        raise ValueError(f"{num_experts} experts do not split evenly over {world_size} ranks")
    per_rank = num_experts // world_size
    return range(rank * per_rank, (rank + 1) * per_rank)


@dataclasses.dataclass(frozen=True, slots=True)
class DispatchMeta:
    """What combine needs to send expert outputs back and sum them per token."""

    num_tokens: int
    token_idx_R: Tensor  # the source token of each routed row, rows sorted by global expert
    weights_R: Tensor  # the routing weight of each routed row
    send_splits: tuple[int, ...]  # rows sent to each rank
    recv_splits: tuple[int, ...]  # rows received from each rank
    order_P: Tensor  # the received row at each position of the expert-sorted buffer
    offsets_L: Tensor  # int32 cumulative rows per local expert: the grouped-GEMM offsets


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
             comm: ExpertComm) -> tuple[Tensor, DispatchMeta]:
    """Sends each token-copy to its expert's rank; returns x_PD sorted by local expert.

    The split sizes come to the host (one sync per layer), which rules out CUDA
    graphs; fixed-capacity buffers will replace them.
    """
    num_ranks, num_experts = comm.world_size, counts_E.shape[0]
    num_local = num_experts // num_ranks
    # Sorting by global expert also groups the rows by destination rank.
    order_R = ids_TK.flatten().argsort(stable=True)
    token_idx_R = order_R // ids_TK.shape[1]
    send_x_RD = x_TD[token_idx_R]

    # Counts first: each rank learns how many rows of each local expert every rank sends.
    recv_counts_NL = torch.empty_like(counts_E)
    comm.all_to_all(recv_counts_NL, counts_E, [num_local] * num_ranks, [num_local] * num_ranks)
    recv_counts_NL = recv_counts_NL.view(num_ranks, num_local)
    splits = torch.stack((counts_E.view(num_ranks, num_local).sum(1), recv_counts_NL.sum(1)))
    send_splits, recv_splits = (tuple(row) for row in splits.tolist())

    recv_x_PD = x_TD.new_empty(sum(recv_splits), x_TD.shape[1])
    comm.all_to_all(recv_x_PD, send_x_RD, recv_splits, send_splits)

    # Rows arrive grouped by source rank, then local expert: regroup by local expert.
    local_ids_P = torch.arange(num_local, device=x_TD.device).repeat(num_ranks).repeat_interleave(
        recv_counts_NL.flatten(), output_size=recv_x_PD.shape[0])
    order_P = local_ids_P.argsort(stable=True)
    meta = DispatchMeta(
        num_tokens=x_TD.shape[0],
        token_idx_R=token_idx_R,
        weights_R=weights_TK.flatten()[order_R],
        send_splits=send_splits,
        recv_splits=recv_splits,
        order_P=order_P,
        offsets_L=recv_counts_NL.sum(0).cumsum(0).to(torch.int32),
    )
    return recv_x_PD[order_P], meta


def experts(x_PD: Tensor, offsets_L: Tensor, w_gate_up_LGD: Tensor, w_down_LDF: Tensor) -> Tensor:
    """The local experts' SwiGLU MLPs over rows grouped by expert: y_PD."""
    gate_PF, up_PF = grouped_mm(x_PD, w_gate_up_LGD, offsets_L).chunk(2, dim=-1)
    return grouped_mm(F.silu(gate_PF) * up_PF, w_down_LDF, offsets_L)


def combine(y_PD: Tensor, meta: DispatchMeta, comm: ExpertComm) -> Tensor:
    """Sends expert outputs back to their tokens' ranks; returns the weighted sum out_TD."""
    arrived_PD = torch.empty_like(y_PD)
    arrived_PD[meta.order_P] = y_PD
    y_RD = y_PD.new_empty(meta.token_idx_R.shape[0], y_PD.shape[1])
    comm.all_to_all(y_RD, arrived_PD, meta.send_splits, meta.recv_splits)
    out_TD = y_PD.new_zeros(meta.num_tokens, y_PD.shape[1])
    return out_TD.index_add_(0, meta.token_idx_R, y_RD * meta.weights_R[:, None])


def grouped_mm(x_PI: Tensor, w_LOI: Tensor, offsets_L: Tensor) -> Tensor:
    """Row group l of x (ending at offsets_L[l]) times w_LOI[l].T: [P, O]."""
    if _has_grouped_mm(x_PI.device.type, x_PI.dtype):
        return torch._grouped_mm(x_PI, w_LOI.transpose(-2, -1), offs=offsets_L)
    out_PO = x_PI.new_empty(x_PI.shape[0], w_LOI.shape[1])
    start = 0
    for expert, end in enumerate(offsets_L.tolist()):
        out_PO[start:end] = x_PI[start:end] @ w_LOI[expert].T
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
                 top_k: int, norm_topk_prob: bool, comm: ExpertComm, hit_counts_E: Tensor):
        self.w_gate_ED, self.w_gate_up_LGD, self.w_down_LDF = w_gate_ED, w_gate_up_LGD, w_down_LDF
        self.top_k, self.norm_topk_prob, self.comm = top_k, norm_topk_prob, comm
        # A view into the model's hit_counts_LE: tokens this rank routed to each expert.
        self.hit_counts_E = hit_counts_E

    @classmethod
    def from_weights(cls, weights: Mapping[str, Tensor], prefix: str, expert_ids: Sequence[int],
                     **kwargs) -> "MoELayer":
        """Stacks the hub's per-expert tensors under `prefix` (`model.layers.N.mlp.`)."""
        def stack(proj: str) -> Tensor:
            return torch.stack([weights[f"{prefix}experts.{e}.{proj}.weight"] for e in expert_ids])

        w_gate_up_LGD = torch.cat((stack("gate_proj"), stack("up_proj")), dim=1)
        return cls(weights[f"{prefix}gate.weight"], w_gate_up_LGD, stack("down_proj"), **kwargs)

    def __call__(self, x_TD: Tensor) -> Tensor:
        ids_TK, weights_TK, counts_E = gate(x_TD, self.w_gate_ED, self.top_k, self.norm_topk_prob)
        self.hit_counts_E += counts_E
        x_PD, meta = dispatch(x_TD, ids_TK, weights_TK, counts_E, self.comm)
        y_PD = experts(x_PD, meta.offsets_L, self.w_gate_up_LGD, self.w_down_LDF)
        return combine(y_PD, meta, self.comm)
