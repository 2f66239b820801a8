"""What every spare expert slot of a group holds: the `Placement`. Pure data, no torch.

Each rank of a group of N ranks has Q = L + S physical slots per MoE layer
(E logical experts, L = E / N primaries per rank, S spares): slot q < L of
rank r always holds expert r * L + q; the spares hold a replica of some
expert, or nothing (EMPTY). A placement is the value of the group's
placement key in etcd (services/placement_store.py): the router proposes
one, the scheduler leader commits it, every rank loads it
(services/model/expert_map.py turns it into device tables).
"""

import dataclasses
import json
from collections.abc import Mapping, Sequence

EMPTY = -1


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """What every spare slot of every MoE layer holds, for one group. Pure.

    `layers` maps a model layer index to its N * S spare entries, rank-major
    (rank r's spares are entries r*S .. r*S+S-1), each a logical expert id or
    EMPTY; a layer that is absent has all spares empty. `epoch` counts the
    committed placements of the group (0: none yet).
    """

    num_experts: int
    num_ranks: int
    num_spare_slots: int
    layers: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    epoch: int = 0

    def __post_init__(self) -> None:
        if self.num_ranks <= 0 or self.num_experts % self.num_ranks:
            raise ValueError(f"{self.num_experts} experts do not split evenly over {self.num_ranks} ranks")
        if self.num_spare_slots < 0:
            raise ValueError(f"num_spare_slots must be >= 0, got {self.num_spare_slots}")
        object.__setattr__(self, "layers", {int(k): tuple(int(e) for e in v) for k, v in self.layers.items()})
        for layer, spares in self.layers.items():
            if len(spares) != self.num_ranks * self.num_spare_slots:
                raise ValueError(f"layer {layer}: {len(spares)} spare entries, expected "
                                 f"{self.num_ranks} ranks x {self.num_spare_slots} spares")
            if bad := [e for e in spares if not EMPTY <= e < self.num_experts]:
                raise ValueError(f"layer {layer}: expert {bad[0]} outside [0, {self.num_experts})")
            for rank in range(self.num_ranks):
                held = [e for e in self.rank_experts(layer, rank)]
                if len(set(held)) != len(held):
                    raise ValueError(f"layer {layer}: rank {rank} holds an expert twice: {held}")

    @property
    def num_local_experts(self) -> int:
        """L: primary slots per rank."""
        return self.num_experts // self.num_ranks

    @property
    def slots_per_rank(self) -> int:
        """Q = L + S."""
        return self.num_local_experts + self.num_spare_slots

    def spares(self, layer: int) -> tuple[int, ...]:
        """The N * S spare entries of a layer (all EMPTY if the layer is absent)."""
        return self.layers.get(layer, (EMPTY,) * (self.num_ranks * self.num_spare_slots))

    def slot_experts(self, layer: int) -> list[int]:
        """The logical expert of every global slot (N * Q entries; EMPTY for an empty spare)."""
        L, S, spares = self.num_local_experts, self.num_spare_slots, self.spares(layer)
        return [e for r in range(self.num_ranks)
                for e in (*range(r * L, (r + 1) * L), *spares[r * S:(r + 1) * S])]

    def rank_experts(self, layer: int, rank: int) -> list[int]:
        """The experts rank holds in a layer: its primaries, then its non-empty spares."""
        L, S = self.num_local_experts, self.num_spare_slots
        spares = self.spares(layer)[rank * S:(rank + 1) * S]
        return [*range(rank * L, (rank + 1) * L), *(e for e in spares if e != EMPTY)]

    def replica_slots(self, layer: int) -> list[list[int]]:
        """Per expert, the global slots holding it, in increasing order (primary included)."""
        out: list[list[int]] = [[] for _ in range(self.num_experts)]
        for slot, expert in enumerate(self.slot_experts(layer)):
            if expert != EMPTY:
                out[expert].append(slot)
        return out

    def num_replicas(self, layer: int) -> list[int]:
        """Per expert, how many slots hold it (>= 1)."""
        return [len(slots) for slots in self.replica_slots(layer)]

    def rank_loads(self, layer: int, counts: Sequence[float]) -> list[float]:
        """Tokens each rank computes for per-expert `counts`, each expert's
        tokens spread evenly over its replicas (what SlotMap does)."""
        Q, loads = self.slots_per_rank, [0.0] * self.num_ranks
        for expert, slots in enumerate(self.replica_slots(layer)):
            for slot in slots:
                loads[slot // Q] += counts[expert] / len(slots)
        return loads

    def with_layer(self, layer: int, spares: Sequence[int]) -> "Placement":
        """A copy with one layer's spares replaced (epoch unchanged)."""
        return dataclasses.replace(self, layers={**self.layers, layer: tuple(spares)})

    def same_slots(self, other: "Placement") -> bool:
        """True if both put the same experts in the same slots (epochs aside)."""
        layers = set(self.layers) | set(other.layers)
        return ((self.num_experts, self.num_ranks, self.num_spare_slots)
                == (other.num_experts, other.num_ranks, other.num_spare_slots)
                and all(self.spares(l) == other.spares(l) for l in layers))

    def loads_needed(self, new: "Placement", rank: int) -> dict[int, list[tuple[int, int]]]:
        """What rank must load to go from this placement to `new`: per layer,
        (spare index s, expert) for each of its spares whose expert changes to a real one."""
        S, out = self.num_spare_slots, {}
        for layer in sorted(set(self.layers) | set(new.layers)):
            old_spares = self.spares(layer)[rank * S:(rank + 1) * S]
            new_spares = new.spares(layer)[rank * S:(rank + 1) * S]
            changes = [(s, e) for s, (o, e) in enumerate(zip(old_spares, new_spares)) if e != o and e != EMPTY]
            if changes:
                out[layer] = changes
        return out

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "num_experts": self.num_experts, "num_ranks": self.num_ranks,
                "num_spare_slots": self.num_spare_slots,
                "layers": {str(k): list(v) for k, v in sorted(self.layers.items())}}

    @classmethod
    def from_dict(cls, value: Mapping) -> "Placement":
        """The inverse of to_dict; ValueError for a malformed value."""
        try:
            return cls(int(value["num_experts"]), int(value["num_ranks"]), int(value["num_spare_slots"]),
                       {int(k): tuple(v) for k, v in value.get("layers", {}).items()}, int(value.get("epoch", 0)))
        except (KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"malformed placement {value!r}: {error!r}") from error

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict()).encode()
