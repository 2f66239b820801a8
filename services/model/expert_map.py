"""Physical expert slots, replicas, and which replica serves each routed token.

Legend: E logical experts, N ranks, L = E / N primary slots per rank, S spare
slots per rank, Q = L + S slots per rank, X the widest replica list
(1 + N * S), T tokens, K experts per token.

Each rank has Q physical slots per MoE layer: global slot r * Q + q. Slot
q < L of rank r always holds logical expert r * L + q (its primary); slots
L..Q-1 are spares that hold a replica of some expert, or nothing (EMPTY). A
`Placement` says, per MoE layer, what every spare holds; it is the value of
the group's placement key in etcd. The gates never move: every rank routes
with the full gate, and a `SlotMap` then sends each token-copy of expert e
to one of e's replicas.

Replica choice is deterministic and needs no host sync: a rank numbers the
copies it routes to expert e in token order (0, 1, 2, ...) and sends copy i
to replica i mod n_e of a list that starts with the rank's own replica when
it has one. Every rank so spreads e's tokens evenly over e's replicas, and a
rank's own replica gets the rounding remainder (a single token stays local).
Which replica ran changes a token's output by fp32 rounding at most: each rank
sums its weighted outputs of a token in increasing logical expert order in fp32
and the token's rank adds the ranks' partial sums (moe.py); the result is bit for
bit the same whenever the token's experts that ran on one rank stay on one rank
(always with K <= 2).
"""

from collections.abc import Mapping

import torch
from torch import Tensor

from services.placement import Placement


class SlotMap:
    """One rank's device tables for one MoE layer: each expert's replica slots, its own first.

    The tensors keep their shapes for the life of the layer and `update`
    rewrites them in place, so a captured CUDA graph stays valid.
    """

    def __init__(self, num_experts: int, num_ranks: int, num_spare_slots: int, rank: int, device):
        self.num_experts, self.num_ranks, self.rank = num_experts, num_ranks, rank
        self.num_slots = num_ranks * (num_experts // num_ranks + num_spare_slots)
        width = 1 + num_ranks * num_spare_slots
        self.replicas_EX = torch.zeros(num_experts, width, dtype=torch.int64, device=device)
        self.num_replicas_E = torch.ones(num_experts, dtype=torch.int64, device=device)
        self.update(Placement(num_experts, num_ranks, num_spare_slots), 0)

    def update(self, placement: Placement, layer: int) -> None:
        """Takes the layer's replicas from a placement (in place)."""
        Q = placement.slots_per_rank
        rows = []
        for slots in placement.replica_slots(layer):
            local = [i for i, s in enumerate(slots) if s // Q == self.rank]
            start = local[0] if local else 0
            rows.append(slots[start:] + slots[:start])
        width = self.replicas_EX.shape[1]
        table = [row + [row[0]] * (width - len(row)) for row in rows]
        self.replicas_EX.copy_(torch.tensor(table, dtype=torch.int64))
        self.num_replicas_E.copy_(torch.tensor([len(r) for r in rows], dtype=torch.int64))

    def route(self, ids_TK: Tensor, counts_E: Tensor) -> Tensor:
        """The global slot of each token-copy (slots_TK); counts_E counts ids_TK per expert."""
        ids_R = ids_TK.flatten()
        order_R = ids_R.argsort(stable=True)
        starts_E = counts_E.cumsum(0) - counts_E
        # Copy i of expert e (in token order) goes to replica i mod n_e.
        index_sorted_R = torch.arange(ids_R.shape[0], device=ids_R.device) - starts_E[ids_R[order_R]]
        index_R = torch.empty_like(index_sorted_R).scatter_(0, order_R, index_sorted_R)
        choice_R = index_R % self.num_replicas_E[ids_R]
        return self.replicas_EX[ids_R, choice_R].view(ids_TK.shape)


def replica_tensor_names(base: Placement, target: Placement, rank: int) -> set[str]:
    """The hub tensors rank must read to go from base to target."""
    return {f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
            for layer, changes in base.loads_needed(target, rank).items() for _, e in changes
            for proj in ("gate_proj", "up_proj", "down_proj")}


def apply_placement(model, base: Placement, target: Placement, rank: int, weights: Mapping[str, Tensor]) -> None:
    """Model thread: copies the replicas going from base to target adds into their
    spare slots (`weights` holds at least replica_tensor_names) and rewrites every
    MoE layer's slot map, in place."""
    num_local = base.num_local_experts
    for layer, changes in base.loads_needed(target, rank).items():
        moe = model.layers[layer].feed_forward
        for s, expert in changes:
            moe.load_slot(num_local + s, weights, f"model.layers.{layer}.mlp.experts.{expert}.")
    for layer in model.config.moe_layers:
        model.layers[layer].feed_forward.slot_map.update(target, layer)
