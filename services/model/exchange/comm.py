"""The collectives the MoE layers exchange expert rows with: one process group, or none.

ExpertComm wraps the few torch.distributed collectives the dispatch path
(moe_dispatch.py) and the gathered expert-parallel layer (kernels/moe_ep.py)
use; with no group (one rank holding every expert) each is a copy, so the same
code runs; so is a group of one rank (an expert service alone in its group: no gloo call a
layer). Its `exchange`, when the expert service sets one up, is the
symmetric-memory exchange (exchange/symmetric.py) for decode-sized steps; its
`plan`, when the expert service sets one, picks each step's design (gather or
all-to-all: exchange/cost_model.py).
"""

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from services.model.exchange.plan import DispatchPlan


class ExpertComm:
    """The process group the experts are spread over (None: a single local rank)."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.rank = 0 if group is None else dist.get_rank(group)
        self.world_size = 1 if group is None else dist.get_world_size(group)
        # kernels/moe_ep.py's exchange over symmetric memory (exchange/symmetric.py), if set:
        # the decode steps that fit its buffers go through it instead of NCCL.
        self.exchange = None
        # The group's exchange design per step size (cost_model.DispatchPlan), if set; None keeps
        # each backend's own: the gather on CUDA with the Triton backend, the all-to-all in torch.
        self.plan: DispatchPlan | None = None

    @classmethod
    def local(cls) -> "ExpertComm":
        """One rank holding every expert; no torch.distributed needed."""
        return cls(None)

    def all_to_all(self, out: Tensor, inp: Tensor, out_splits: Sequence[int] | None = None,
                   in_splits: Sequence[int] | None = None) -> None:
        """all_to_all_single along dim 0: in_splits[r] rows go to rank r, out_splits[r]
        come from it; None splits dim 0 into equal parts."""
        if self.world_size == 1:
            out.copy_(inp)
        else:
            dist.all_to_all_single(out, inp, None if out_splits is None else list(out_splits),
                                   None if in_splits is None else list(in_splits), group=self.group)

    def all_gather(self, out: Tensor, inp: Tensor) -> None:
        """Every rank's inp, stacked along dim 0 in rank order, into out."""
        if self.world_size == 1:
            out.copy_(inp)
        else:
            dist.all_gather_into_tensor(out, inp, group=self.group)

    def reduce_scatter(self, out: Tensor, inp: Tensor) -> None:
        """out = the sum over the ranks of their inp's rank-th block of rows (dim 0)."""
        if self.world_size == 1:
            out.copy_(inp)
        else:
            dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.SUM, group=self.group)

    def max_over_ranks(self, value: int, device) -> int:
        """The largest `value` any rank passes (one small all_reduce and a host sync)."""
        if self.world_size == 1:
            return value
        value_1 = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(value_1, op=dist.ReduceOp.MAX, group=self.group)
        return int(value_1.item())
