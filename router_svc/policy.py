"""The expert scaling policy: replicate hot experts, drop cold replicas, rebalance. Pure.

Inputs are a group's current `Placement` and its hit counts per layer over
sliding windows; the output is the next placement (or the same one). Rank
loads follow `Placement.rank_loads`: each expert's hits spread evenly over
its replicas, which is what the dispatch's replica choice does.

- Scale up: an expert whose hit rate (share of its layer's hits) over the
  last `scale_up_window_s` is above `scale_up_hit_rate` gets one more
  replica, up to `max_replicas` (primary included), in a free spare of the
  least loaded rank that does not hold it yet.
- Scale down: an expert with replicas whose hit rate over the last
  `scale_down_window_s` is below `scale_down_hit_rate` loses one, the one on
  the most loaded rank. Primaries never move, so the last copy never goes.
- Rebalance (periodic): the spares of a layer are planned afresh in the
  style of expert-parallel load balancers: greedily, each replica (an
  expert and a rank with a free spare) is the one that lowers the largest
  rank load most (ties: the sum of squared loads), while that lowers
  anything. A replica that stays on its rank keeps its slot, so it is not
  loaded again.

A window counts only once the group has been observed for that long.
"""

import dataclasses
from collections.abc import Mapping, Sequence

from router_svc.stats import hit_rates
from services.placement import EMPTY, Placement


@dataclasses.dataclass(frozen=True, slots=True)
class ScalingPolicy:
    """The thresholds; RouterConfig.policy gives them (and their defaults, docs/configuration.md)."""

    scale_up_hit_rate: float
    scale_up_window_s: float
    scale_down_hit_rate: float
    scale_down_window_s: float
    max_replicas: int

    def __post_init__(self) -> None:
        if not 0 <= self.scale_down_hit_rate < self.scale_up_hit_rate <= 1:
            raise ValueError(f"need 0 <= scale_down_hit_rate < scale_up_hit_rate <= 1, got "
                             f"{self.scale_down_hit_rate}, {self.scale_up_hit_rate}")
        if self.scale_up_window_s <= 0 or self.scale_down_window_s <= 0:
            raise ValueError(f"windows must be positive, got {self.scale_up_window_s}, {self.scale_down_window_s}")
        if self.max_replicas < 1:
            raise ValueError(f"max_replicas must be >= 1, got {self.max_replicas}")


def imbalance(loads: Sequence[float]) -> float:
    """The largest load over the mean; 1.0 for no load."""
    total = sum(loads)
    return max(loads) * len(loads) / total if total else 1.0


def scale(placement: Placement, up_counts: Mapping[int, Sequence[int]] | None,
          down_counts: Mapping[int, Sequence[int]] | None, policy: ScalingPolicy) -> Placement:
    """One round of scale down (from down_counts) then scale up (from up_counts);
    None skips a direction (its window is not full yet)."""
    for layer, counts in sorted((down_counts or {}).items()):
        rates = hit_rates(counts)
        for expert in range(placement.num_experts):
            if rates[expert] < policy.scale_down_hit_rate and placement.num_replicas(layer)[expert] > 1:
                placement = _drop_replica(placement, layer, expert, counts)
    for layer, counts in sorted((up_counts or {}).items()):
        rates = hit_rates(counts)
        for expert in sorted(range(placement.num_experts), key=lambda e: -rates[e]):
            if rates[expert] <= policy.scale_up_hit_rate:
                break
            if placement.num_replicas(layer)[expert] < policy.max_replicas:
                placement = _add_replica(placement, layer, expert, counts)
    return placement


def _spare_index(placement: Placement, rank: int, s: int) -> int:
    return rank * placement.num_spare_slots + s


def _add_replica(placement: Placement, layer: int, expert: int, counts: Sequence[int]) -> Placement:
    loads = placement.rank_loads(layer, counts)
    spares = list(placement.spares(layer))
    candidates = [r for r in range(placement.num_ranks)
                  if expert not in placement.rank_experts(layer, r)
                  and EMPTY in spares[r * placement.num_spare_slots:(r + 1) * placement.num_spare_slots]]
    if not candidates:
        return placement
    rank = min(candidates, key=lambda r: (loads[r], r))
    s = spares[rank * placement.num_spare_slots:(rank + 1) * placement.num_spare_slots].index(EMPTY)
    spares[_spare_index(placement, rank, s)] = expert
    return placement.with_layer(layer, spares)


def _drop_replica(placement: Placement, layer: int, expert: int, counts: Sequence[int]) -> Placement:
    loads = placement.rank_loads(layer, counts)
    spares = list(placement.spares(layer))
    held = [i for i, e in enumerate(spares) if e == expert]
    index = max(held, key=lambda i: (loads[i // placement.num_spare_slots], i))
    spares[index] = EMPTY
    return placement.with_layer(layer, spares)


def rebalance(placement: Placement, counts_by_layer: Mapping[int, Sequence[int]], max_replicas: int) -> Placement:
    """Each layer's spares planned afresh to minimise the largest rank load (see the module doc)."""
    for layer, counts in sorted(counts_by_layer.items()):
        plan = _greedy_replicas(placement, layer, counts, max_replicas)
        placement = placement.with_layer(layer, _keep_slots(placement, layer, plan))
    return placement


def _greedy_replicas(placement: Placement, layer: int, counts: Sequence[int], max_replicas: int) -> list[list[int]]:
    """The experts each rank's spares should hold (unordered), chosen greedily."""
    N, L, S = placement.num_ranks, placement.num_local_experts, placement.num_spare_slots
    holders = [[e // L] for e in range(placement.num_experts)]  # ranks holding each expert
    loads = [float(sum(counts[r * L:(r + 1) * L])) for r in range(N)]
    chosen: list[list[int]] = [[] for _ in range(N)]
    while True:
        best, best_key = None, (max(loads), sum(x * x for x in loads))
        for expert, count in enumerate(counts):
            n = len(holders[expert])
            if not count or n >= max_replicas:
                continue
            for rank in range(N):
                if rank in holders[expert] or len(chosen[rank]) >= S:
                    continue
                trial = list(loads)
                for r in holders[expert]:
                    trial[r] -= count / n - count / (n + 1)
                trial[rank] += count / (n + 1)
                key = (max(trial), sum(x * x for x in trial))
                if key < best_key:
                    best, best_key = (expert, rank, trial), key
        if best is None:
            return chosen
        expert, rank, loads = best
        holders[expert].append(rank)
        chosen[rank].append(expert)


def _keep_slots(placement: Placement, layer: int, chosen: list[list[int]]) -> list[int]:
    """Spare entries for the chosen experts, keeping an expert in its current slot if it stays."""
    S, old = placement.num_spare_slots, placement.spares(layer)
    spares = [EMPTY] * (placement.num_ranks * S)
    for rank, experts in enumerate(chosen):
        mine = old[rank * S:(rank + 1) * S]
        rest = [e for e in experts if e not in mine]
        for s in range(S):
            if mine[s] in experts:
                spares[rank * S + s] = mine[s]
        for s in range(S):
            if spares[rank * S + s] == EMPTY and rest:
                spares[rank * S + s] = rest.pop(0)
    return spares


def max_imbalance(placement: Placement, counts_by_layer: Mapping[int, Sequence[int]]) -> float:
    """The worst layer's max/mean rank load under a placement (1.0 with no hits)."""
    return max((imbalance(placement.rank_loads(layer, counts)) for layer, counts in counts_by_layer.items()),
               default=1.0)
