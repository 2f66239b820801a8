"""MoE backends: how a rank computes a step of an MoE layer, picked by name from a registry.

A backend gets the layer's weights and state (MoELayerState) and a step's
tokens and returns the layer's output; every backend gives the dispatch
path's result (moe_dispatch.py, moe_experts.py) to within fp32 summation
order. Backends: "torch" (this module's TorchMoE: gate -> dispatch ->
experts -> combine in torch, on any device and any number of ranks),
"triton" (kernels/moe_triton.py: Triton kernels on CUDA, a kernel family
picked per step; registered when its module is imported, which needs triton,
so it is loaded only when asked for) and "auto" (triton for layers on CUDA,
torch otherwise). Layers of quantized experts (services/model/quant/experts.py)
asking for "auto" or "triton" on CUDA get "triton-quant" instead
(kernels/quant_moe.py: the FP8 and AWQ expert kernels on the stored layouts);
the torch backend computes them on their dequantized weights (the CPU's
reference path).

Legend as in moe_dispatch.py: T tokens of this rank, D hidden, E experts, K experts per token.
"""

import abc
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from services.model.backends import registered
from services.model.exchange.comm import ExpertComm
from services.model.expert_map import SlotMap
from services.model.layers import AddNorm
from services.model.moe_dispatch import combine, dispatch, gate
from services.model.moe_experts import experts


class MoELayerState(Protocol):
    """What a backend reads of a layer (moe.MoELayer) and adds its routed experts to."""

    w_gate_ED: Tensor
    w_gate_up_LGD: Tensor  # with spare slots Q = L + S rows, spares last
    w_down_LDF: Tensor
    top_k: int
    norm_topk_prob: bool
    comm: ExpertComm
    hit_counts_E: Tensor  # tokens this rank routed to each (logical) expert
    slot_map: SlotMap | None
    row_block: int  # moe_experts.experts' row_block


class MoEBackend(abc.ABC):
    """One way to compute a step of an MoE layer on this rank."""

    @abc.abstractmethod
    def forward(self, layer: MoELayerState, x_TD: Tensor, capacity: int | None,
                add_norm: AddNorm | None) -> Tensor:
        """The layer's output for this rank's x_TD (with add_norm, add_norm(the output)); adds
        the routed experts to layer.hit_counts_E. `capacity` (the same on every rank) picks
        the dispatch mode, see moe_dispatch.dispatch."""

    def routed_ids(self, layer: MoELayerState, x_TD: Tensor) -> Tensor:
        """Each token's experts as a step of forward routes them, not counted anywhere
        (the order within a row is not kept): moe_dispatch.gate's."""
        return gate(x_TD, layer.w_gate_ED, layer.top_k, layer.norm_topk_prob)[0]

    def gathers(self, device: torch.device) -> bool:
        """Whether expert-parallel layers on `device` take every step at a fixed capacity (a
        gather and a reduce-scatter, kernels/moe_ep.py), so bigger steps than the decode
        buckets too, at exactly their largest rank's tokens."""
        return False


def dispatched_moe(layer: MoELayerState, x_TD: Tensor, capacity: int | None,
                   experts_fn: Callable[[Tensor, Tensor, Tensor, Tensor, int], Tensor] = experts,
                   everywhere: bool = False) -> Tensor:
    """gate -> dispatch -> experts (experts_fn) -> combine: out_TD; adds the routed experts
    to layer.hit_counts_E. everywhere: the gather design (moe_dispatch.dispatch's)."""
    ids_TK, weights_TK, counts_E = gate(x_TD, layer.w_gate_ED, layer.top_k, layer.norm_topk_prob)
    layer.hit_counts_E += counts_E
    x_PD, meta = dispatch(x_TD, ids_TK, weights_TK, counts_E, layer.comm, capacity, layer.slot_map, everywhere)
    y_PD = experts_fn(x_PD, meta.offsets_L, layer.w_gate_up_LGD, layer.w_down_LDF, layer.row_block)
    return combine(y_PD, meta, layer.comm)


def step_copies(layer: MoELayerState) -> int:
    """min(K, L): the copies one token sends one rank at most (capacity = rows per rank * this)."""
    num_slots = layer.slot_map.num_slots if layer.slot_map is not None else layer.w_gate_ED.shape[0]
    return min(layer.top_k, num_slots // layer.comm.world_size)


def torch_design(layer: MoELayerState, x_TD: Tensor, capacity: int | None) -> tuple[bool, int | None]:
    """(everywhere, capacity) of a step in torch by the group's dispatch plan (comm.plan,
    exchange/cost_model.py): the gather design at a fixed capacity, or the all-to-all at the
    capacity given. Without a plan, the all-to-all. A host-split step (capacity None) does not
    know its largest rank's tokens: it takes the plan's design for every step above the fixed
    capacity, the all-to-all where that depends on the size (learning the size would cost a
    collective a layer, what the gather saves), and a forced gather learns the size (one
    all_reduce, as every rank does)."""
    plan, comm = layer.comm.plan, layer.comm
    if plan is None or comm.world_size == 1:
        return False, capacity
    copies = step_copies(layer)
    if capacity is not None:
        rows_per_rank = capacity // copies
        if plan.design(rows_per_rank) == "gather":
            return True, capacity
        # CUDA's models pad every step to a capacity (moe_backend.gathers_on): the all-to-all
        # sends exactly the rows of a step too big for the fixed capacity.
        return False, capacity if plan.is_fixed(rows_per_rank) else None
    if plan.splits_design() != "gather":
        return False, None
    return True, max(comm.max_over_ranks(x_TD.shape[0], x_TD.device), 1) * copies


class TorchMoE(MoEBackend):
    """The dispatch path in torch, on any device and any number of ranks: the all-to-all, or
    the gather design where the group's plan picks it."""

    def forward(self, layer, x_TD, capacity, add_norm):
        everywhere, capacity = torch_design(layer, x_TD, capacity)
        out_TD = dispatched_moe(layer, x_TD, capacity, everywhere=everywhere)
        return out_TD if add_norm is None else add_norm(out_TD)


MOE_BACKENDS: dict[str, type[MoEBackend]] = {"torch": TorchMoE}
# Backends whose module registers them on import (it needs triton, which CPU installs lack).
# Not a name to ask for: what "auto" and "triton" become for layers of quantized experts on CUDA.
QUANTIZED_TRITON = "triton-quant"
_LAZY_BACKEND_MODULES = {"triton": "services.model.kernels.moe_triton",
                         QUANTIZED_TRITON: "services.model.kernels.quant_moe"}
MOE_BACKEND_NAMES = ("auto", "torch", "triton")


def make_moe_backend(name: str, device: torch.device | str, *, quantized: bool = False) -> MoEBackend:
    """The registered backend called `name` (one of MOE_BACKEND_NAMES) for layers on `device`
    (`quantized`: layers of quantized experts, whose Triton backend is "triton-quant")."""
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    if quantized and name == "triton":
        name = QUANTIZED_TRITON
    return registered("MoE", name, MOE_BACKENDS, _LAZY_BACKEND_MODULES, MOE_BACKEND_NAMES)()


def gathers_on(device: torch.device | str) -> bool:
    """Whether expert-parallel layers on `device` take every step at a fixed capacity: the
    "auto" backend's MoEBackend.gathers (the Triton backend's on CUDA, while it is enabled)."""
    device = torch.device(device)
    return make_moe_backend("auto", device).gathers(device)
