"""The router's view of expert load: hit reports in, per-layer loads out. Pure.

Combines the cumulative statistics (router_svc/stats.py), the recent
windows (router_svc/windows.py) and each group's placement as last read
(the autoscaler's), so the servicer only converts to and from protobuf.
"""

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from router_svc.policy import imbalance
from router_svc.stats import ExpertStats, hit_rates
from router_svc.windows import SlidingWindows
from services.placement import Placement


@dataclasses.dataclass(frozen=True, slots=True)
class LayerLoad:
    """The load of one MoE layer; rank loads only under a known placement of as many experts."""

    layer: int
    counts: Sequence[int]
    hit_rates: Sequence[float]
    # Tokens each rank computes (each expert's hits spread over its replicas); empty if unknown.
    rank_loads: Sequence[float] = ()
    # The largest rank load over the mean; 0.0 if rank_loads is empty.
    rank_load_imbalance: float = 0.0


def group_placement(group_id: str, placements: Mapping[str, Placement], windows: SlidingWindows,
                    stats: ExpertStats) -> Placement | None:
    """The group's placement as last read (placements), else its primaries over the ranks that
    reported; None if nothing reported, or the experts do not split evenly over those ranks."""
    if group_id in placements:
        return placements[group_id]
    num_ranks = windows.num_reporting_ranks(group_id)
    layers = stats.layer_stats(group_id)
    if not num_ranks or not layers or len(layers[0].counts) % num_ranks:
        return None
    return Placement(len(layers[0].counts), num_ranks, 0)


class ExpertLoad:
    """Accepts the ranks' hit reports and answers the load of a group (or of all)."""

    def __init__(self, stats: ExpertStats, *, windows: SlidingWindows | None = None,
                 placement_of: Callable[[str], Placement | None] = lambda group_id: None,
                 on_report: Callable[[str, int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.stats = stats
        # Called with (group_id, rank) for each accepted report (the metrics learn the ranks).
        self._on_report = on_report
        self._windows, self._placement_of, self._clock = windows, placement_of, clock

    def add_report(self, group_id: str, rank: int, layers: Iterable[tuple[int, Sequence[int]]]) -> None:
        """One rank's hits, (layer, counts per global expert id) pairs; ValueError (nothing added) if bad."""
        layers = list(layers)
        self.stats.add_report(group_id, layers)
        if self._windows is not None:
            self._windows.add(group_id, rank, layers, self._clock())
        if self._on_report is not None:
            self._on_report(group_id, rank)

    def layer_loads(self, group_id: str, window_s: float) -> list[LayerLoad]:
        """Per layer, the hits of one group ('' all groups) since the start (window_s 0) or over
        the last window_s seconds (a group's only); ValueError for a bad window."""
        if window_s < 0:
            raise ValueError(f"window_s must be >= 0, got {window_s}")
        if window_s > 0:
            if self._windows is None or not group_id:
                raise ValueError("window_s needs a group_id")
            counts = self._windows.counts(group_id, window_s, self._clock())
            per_layer = [(layer, c, hit_rates(c)) for layer, c in counts.items()]
        else:
            per_layer = [(s.layer, s.counts, s.hit_rates) for s in self.stats.layer_stats(group_id)]
        placement = self._placement_of(group_id) if group_id else None
        loads = []
        for layer, counts, rates in per_layer:
            if placement is not None and placement.num_experts == len(counts):
                rank_loads = placement.rank_loads(layer, counts)
                loads.append(LayerLoad(layer, counts, rates, rank_loads, imbalance(rank_loads)))
            else:
                loads.append(LayerLoad(layer, counts, rates))
        return loads

    def num_reports(self, group_id: str = "") -> int:
        """Reports accepted from one group, or from all if ''."""
        return self.stats.num_reports(group_id)
