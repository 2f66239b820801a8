"""Expert load statistics: hit counts per (group, layer, expert). Pure.

A hit is one token routed to one expert (a token counts top-k times). The
hit rate of an expert is its count over the layer's total, so the rates of
a layer sum to 1 (all zeros while the layer has no hits). The counts of
`layer_stats` saturate at MAX_COUNT, the wire's uint64: real traffic never
gets there, but reports with absurd counts must not break the replies.
"""

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

MAX_COUNT = 2**64 - 1


@dataclasses.dataclass(frozen=True, slots=True)
class LayerStats:
    """The load of one MoE layer, indexed by global expert id."""

    layer: int
    counts: list[int]
    hit_rates: list[float]


def hit_rates(counts: Sequence[int]) -> list[float]:
    """Each count's share of the total; zeros if the total is zero."""
    total = sum(counts)
    return [c / total if total else 0.0 for c in counts]


class ExpertStats:
    """Accumulates the reports of every rank of every group."""

    def __init__(self) -> None:
        self._counts: dict[str, dict[int, list[int]]] = {}  # group -> layer -> per expert
        self._num_reports: dict[str, int] = {}

    def add_report(self, group_id: str, layers: Iterable[tuple[int, Sequence[int]]]) -> None:
        """Adds one rank's counts: (layer, counts per global expert id) pairs.

        Raises ValueError (nothing added) for an empty group id, a negative
        count, or a layer whose number of experts differs from earlier reports.
        """
        if not group_id:
            raise ValueError("group_id must be set, got ''")
        layers = [(layer, list(counts)) for layer, counts in layers]
        known = self._counts.get(group_id, {})
        for layer, counts in layers:
            if any(c < 0 for c in counts):
                raise ValueError(f"layer {layer}: counts must be >= 0, got {counts}")
            if layer in known and len(known[layer]) != len(counts):
                raise ValueError(
                    f"layer {layer} of group {group_id!r} has {len(known[layer])} experts, "
                    f"the report has {len(counts)}"
                )
        group = self._counts.setdefault(group_id, {})
        for layer, counts in layers:
            totals = group.setdefault(layer, [0] * len(counts))
            if len(totals) != len(counts):  # the same layer twice in one report, sizes differ
                raise ValueError(f"layer {layer} appears with {len(totals)} and {len(counts)} experts")
            group[layer] = [t + c for t, c in zip(totals, counts)]
        self._num_reports[group_id] = self._num_reports.get(group_id, 0) + 1

    def layer_stats(self, group_id: str = "") -> list[LayerStats]:
        """Per-layer counts and hit rates of one group, or of all groups summed if ''."""
        per_layer: dict[int, list[int]] = {}
        for layer, counts in self._select(self._counts, group_id):
            totals = per_layer.setdefault(layer, [])
            totals.extend([0] * (len(counts) - len(totals)))
            for expert, count in enumerate(counts):
                totals[expert] += count
        return [LayerStats(layer, [min(c, MAX_COUNT) for c in per_layer[layer]], hit_rates(per_layer[layer]))
                for layer in sorted(per_layer)]

    def num_reports(self, group_id: str = "") -> int:
        """Reports received from one group, or from all if ''."""
        if group_id:
            return self._num_reports.get(group_id, 0)
        return sum(self._num_reports.values())

    @staticmethod
    def _select(counts: Mapping[str, Mapping[int, list[int]]], group_id: str):
        groups = [group_id] if group_id else list(counts)
        for group in groups:
            yield from counts.get(group, {}).items()
