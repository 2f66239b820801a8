"""The MoE feed-forward of one rank: its slice of the experts, computed by an MoE backend.

MoELayer holds the layer's gate, its rank's expert weights (plus spare slots
for replicas, expert_map.py) and the group its experts are spread over; each
step it hands to the backend it was built with (moe_backend.py: "torch", the
dispatch path of moe_dispatch.py in torch; "triton", kernels/moe_triton.py on
CUDA; quantized experts (services/model/quant/experts.py), which keep their
stored layouts, "triton-quant" on CUDA, kernels/quant_moe.py). The torch path
reads quantized experts dequantized. Every rank runs every
step of every MoE layer, even with no tokens, so that the collectives of all
ranks line up.

Legend as in moe_dispatch.py: T tokens of this rank, D hidden, F expert width, G = 2F,
E experts, L local experts (Q = L + S slots with spares).
"""

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from services.model.exchange.comm import ExpertComm
from services.model.expert_map import SlotMap
from services.model.layers import AddNorm
from services.model.moe_backend import make_moe_backend
from services.model.moe_experts import CPU_REPLICA_ROW_BLOCK
from services.model.quant.experts import QuantExperts
from services.model.quant.linear import QuantWeight


class MoELayer:
    """One MoE feed-forward holding its rank's slice of experts; `backend` names the registered
    MoE backend that computes its steps (moe_backend.MOE_BACKEND_NAMES)."""

    def __init__(self, w_gate_ED: Tensor, w_gate_up_LGD: Tensor | QuantExperts, w_down_LDF: Tensor | None, *,
                 top_k: int, norm_topk_prob: bool, comm: ExpertComm, hit_counts_E: Tensor,
                 slot_map: SlotMap | None = None, backend: str = "auto"):
        # With spare slots (slot_map set) the expert weights have Q = L + S rows, spares last.
        # Quantized experts come as one QuantExperts (and w_down_LDF None).
        self.quant_experts = w_gate_up_LGD if isinstance(w_gate_up_LGD, QuantExperts) else None
        self.w_gate_ED, self._w_gate_up_LGD, self._w_down_LDF = w_gate_ED, w_gate_up_LGD, w_down_LDF
        self.top_k, self.norm_topk_prob, self.comm = top_k, norm_topk_prob, comm
        # A view into the model's hit_counts_LE: tokens this rank routed to each (logical) expert.
        self.hit_counts_E = hit_counts_E
        self.slot_map = slot_map
        # With replicas on the CPU: fixed-size row blocks, so outputs do not depend on the replica.
        self.row_block = CPU_REPLICA_ROW_BLOCK if slot_map is not None and w_gate_ED.device.type == "cpu" else 0
        self.backend = make_moe_backend(backend, w_gate_ED.device, quantized=self.quant_experts is not None)

    @property
    def w_gate_up_LGD(self) -> Tensor:
        """The gate|up weights of the slots (quantized ones dequantized: the torch path's)."""
        return self._w_gate_up_LGD if self.quant_experts is None else self.quant_experts.dense()[0]

    @property
    def w_down_LDF(self) -> Tensor:
        """The down weights of the slots (quantized ones dequantized: the torch path's)."""
        return self._w_down_LDF if self.quant_experts is None else self.quant_experts.dense()[1]

    @classmethod
    def from_weights(cls, weights: Mapping[str, Tensor], prefix: str, expert_ids: Sequence[int], *,
                     num_spare_slots: int = 0, **kwargs) -> "MoELayer":
        """Stacks the hub's per-expert tensors under `prefix` (`model.layers.N.mlp.`),
        plus `num_spare_slots` zero slots for replicas (kwargs then need a slot_map).
        Quantized expert weights (QuantWeight) are stacked in their stored layouts."""
        w_gate_ED = weights[f"{prefix}gate.weight"]
        first = weights[f"{prefix}experts.{expert_ids[0]}.gate_proj.weight"]
        if isinstance(first, QuantWeight):
            gate, up, down = (QuantWeight.stack([weights[f"{prefix}experts.{e}.{proj}.weight"] for e in expert_ids],
                                                num_spare_slots) for proj in ("gate_proj", "up_proj", "down_proj"))
            experts = QuantExperts(gate, up, down, dtype=w_gate_ED.dtype, cache_dense=first.cache_dense)
            return cls(w_gate_ED, experts, None, **kwargs)

        def stack(proj: str) -> Tensor:
            w_LOI = torch.stack([weights[f"{prefix}experts.{e}.{proj}.weight"] for e in expert_ids])
            if not num_spare_slots:
                return w_LOI
            return torch.cat((w_LOI, w_LOI.new_zeros(num_spare_slots, *w_LOI.shape[1:])))

        w_gate_up_LGD = torch.cat((stack("gate_proj"), stack("up_proj")), dim=1)
        return cls(w_gate_ED, w_gate_up_LGD, stack("down_proj"), **kwargs)

    def load_slot(self, slot: int, weights: Mapping[str, Tensor], expert_prefix: str) -> None:
        """Copies one expert's hub tensors (`expert_prefix` = `...mlp.experts.E.`) into local slot `slot`
        (quantized: its stored tensors and scales)."""
        if self.quant_experts is not None:
            self.quant_experts.load_slot(slot, *(weights[f"{expert_prefix}{p}.weight"]
                                                 for p in ("gate_proj", "up_proj", "down_proj")))
            return
        w_gate_up_GD = torch.cat((weights[expert_prefix + "gate_proj.weight"],
                                  weights[expert_prefix + "up_proj.weight"]))
        self.w_gate_up_LGD[slot].copy_(w_gate_up_GD)
        self.w_down_LDF[slot].copy_(weights[expert_prefix + "down_proj.weight"])

    def __call__(self, x_TD: Tensor, capacity: int | None = None, add_norm: AddNorm | None = None) -> Tensor:
        """The layer on this rank's tokens; `capacity` picks the dispatch mode (see
        moe_dispatch.dispatch). With add_norm, add_norm(the output) (the Triton backend may fuse
        it into its last kernel)."""
        return self.backend.forward(self, x_TD, capacity, add_norm)

    def routed_ids(self, x_TD: Tensor) -> Tensor:
        """Each token's experts as a step of the layer routes them, not counted anywhere (the
        backend's own routing: a fused kernel's logits may round otherwise than F.linear's,
        which a near tie shows). The order within a row is not kept."""
        return self.backend.routed_ids(self, x_TD)
