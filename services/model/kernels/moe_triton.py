"""The Triton MoE backend ("triton" in moe_backend.py's registry): the kernels a step takes on CUDA.

Per step, from the layer's group and the step's size, with every switch read at call time:

1. One rank holding every expert in its slot (no replicas), more than
   moe_small.MOE_MAX_TOKENS tokens: moe_grouped.grouped_moe (moe_grouped.ENABLED).
2. Several ranks at a fixed capacity: moe_ep.gathered_moe, a gather and a reduce-scatter
   (moe_ep.ENABLED), unless the group's plan (comm.plan, exchange/cost_model.py) picks
   the all-to-all for the step's size: then 4., at the fixed capacity where the plan runs
   the step at one (decode, CUDA graphs), else with host splits (exactly the rows).
3. One rank, up to MOE_MAX_TOKENS tokens: moe_small.fused_moe.
4. Otherwise the dispatch path (moe_dispatch.py), its experts by moe_gemm.sorted_experts
   (moe_gemm.EP_EXPERTS; moe_experts.experts for row blocks).

With launch.ENABLED off, or for CPU tensors, every step takes the dispatch path in torch.

Legend as in moe_dispatch.py: T tokens of this rank, D hidden, P dispatched pairs, L local experts.
"""

import torch
from torch import Tensor

from services.model.kernels import launch, moe_ep, moe_gemm, moe_grouped, moe_small
from services.model.moe_backend import MOE_BACKENDS, MoEBackend, MoELayerState, dispatched_moe
from services.model.moe_experts import experts


class TritonMoE(MoEBackend):
    """Triton kernels on CUDA, a kernel family picked per step (see the module doc)."""

    def forward(self, layer, x_TD, capacity, add_norm):
        if self._takes_grouped_moe(layer, x_TD):
            return moe_grouped.grouped_moe(x_TD, layer.w_gate_ED, layer.w_gate_up_LGD, layer.w_down_LDF, layer.top_k,
                                           layer.norm_topk_prob, layer.hit_counts_E, add_norm=add_norm)
        if layer.comm.world_size > 1 and capacity is not None and self.gathers(x_TD.device):
            rows_per_rank, plan = capacity // min(layer.top_k, layer.w_gate_up_LGD.shape[0]), layer.comm.plan
            if plan is None or plan.design(rows_per_rank) == "gather":
                return moe_ep.gathered_moe(layer, x_TD, rows_per_rank, add_norm)
            if not plan.is_fixed(rows_per_rank):  # the model pads every step here: send exactly the rows
                capacity = None
        out_TD = self._output(layer, x_TD, capacity)
        return out_TD if add_norm is None else add_norm(out_TD)

    def routed_ids(self, layer, x_TD):
        """grouped_moe's own routing where the step takes it (moe_grouped.route: gate_route_rows'
        logits round otherwise than F.linear's), else moe_dispatch.gate's (the same logits as
        the other paths')."""
        if self._takes_grouped_moe(layer, x_TD):
            return moe_grouped.route(x_TD, layer.w_gate_ED, layer.top_k, layer.norm_topk_prob,
                                     torch.zeros_like(layer.hit_counts_E))[0]
        return super().routed_ids(layer, x_TD)

    def gathers(self, device):
        return device.type == "cuda" and launch.ENABLED and moe_ep.ENABLED

    def _takes_grouped_moe(self, layer: MoELayerState, x_TD: Tensor) -> bool:
        """Whether a step of x_TD's tokens runs moe_grouped.grouped_moe: one rank on CUDA holding
        every expert in its slot, more tokens than moe_small.fused_moe takes."""
        if layer.comm.world_size != 1 or not x_TD.is_cuda or layer.slot_map is not None:
            return False
        return launch.ENABLED and moe_grouped.ENABLED and x_TD.shape[0] > moe_small.MOE_MAX_TOKENS

    def _output(self, layer: MoELayerState, x_TD: Tensor, capacity: int | None) -> Tensor:
        if layer.comm.world_size == 1 and x_TD.is_cuda:  # one rank, a small step: fused kernels
            if launch.ENABLED and x_TD.shape[0] <= moe_small.MOE_MAX_TOKENS:
                return moe_small.fused_moe(x_TD, layer.w_gate_ED, layer.w_gate_up_LGD, layer.w_down_LDF,
                                           layer.top_k, layer.norm_topk_prob, layer.hit_counts_E)
        return dispatched_moe(layer, x_TD, capacity, dispatched_experts)


def dispatched_experts(x_PD: Tensor, offsets_L: Tensor, w_gate_up_LGD: Tensor, w_down_LDF: Tensor,
                       row_block: int = 0) -> Tensor:
    """The dispatch path's experts: moe_gemm.sorted_experts' Triton GEMMs with SiLU * up fused (the
    same roundings) on CUDA without row blocks, while launch.ENABLED and moe_gemm.EP_EXPERTS."""
    if x_PD.is_cuda and not row_block and launch.ENABLED and moe_gemm.EP_EXPERTS:
        return moe_gemm.sorted_experts(x_PD, offsets_L, w_gate_up_LGD, w_down_LDF)
    return experts(x_PD, offsets_L, w_gate_up_LGD, w_down_LDF, row_block)


MOE_BACKENDS["triton"] = TritonMoE
