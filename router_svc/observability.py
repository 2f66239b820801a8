"""The router's expert-load metrics, read from its ExpertStats when Prometheus scrapes.

Per group, layer and expert: the hits (tokens routed to the expert, summed
over the group's ranks) and the hit ratio (the expert's share of its
layer's hits). Per group, layer and rank: the rank load, the hits of the
experts the rank holds, and per group and layer the imbalance, the largest
rank load over the mean (1.0 = perfectly even). A rank holds the contiguous
slice [r*E/N, (r+1)*E/N) of experts (docs/internals.md), N being the
number of ranks that reported for the group (the highest rank seen plus
one); a layer whose experts N does not divide gets no rank series.
All values are cumulative since the router started.

With expert scaling (router_svc/autoscaler.py), per group: the placement
epoch last read, and per layer the imbalance over the scale-up window under
that placement (each expert's hits spread over its replicas), which is
what the policy acts on.
"""

import time

from router_svc.policy import imbalance
from router_svc.stats import ExpertStats
from services import metrics


def rank_loads(counts: list[int], world_size: int) -> list[int] | None:
    """Hits per rank of a layer's per-expert counts, None if the experts do not split evenly."""
    if world_size <= 0 or len(counts) % world_size:
        return None
    per_rank = len(counts) // world_size
    return [sum(counts[r * per_rank:(r + 1) * per_rank]) for r in range(world_size)]


class RouterStatsCollector:
    """Scrape-time collector over the router's ExpertStats; `on_report` learns the ranks."""

    def __init__(self, stats: ExpertStats | None, *, windows=None, placement_of=None,
                 window_s: float = 0.0, clock=time.monotonic) -> None:
        self._stats = stats
        self._world_sizes: dict[str, int] = {}
        # Recent hits (SlidingWindows) and the group's placement (or None), for the windowed series.
        self._windows, self._placement_of, self._window_s, self._clock = windows, placement_of, window_s, clock

    def on_report(self, group_id: str, rank: int) -> None:
        """A report of group_id's rank was accepted."""
        self._world_sizes[group_id] = max(self._world_sizes.get(group_id, 0), rank + 1)

    def collect(self):
        reports = metrics.counter_family("router_reports", "Hit-count reports accepted.", ["group"])
        hits = metrics.counter_family("router_expert_hits", "Tokens routed to the expert in the layer, "
                                      "summed over the group's ranks.", ["group", "layer", "expert"])
        ratio = metrics.gauge_family("router_expert_hit_ratio", "The expert's share of its layer's hits.",
                                     ["group", "layer", "expert"])
        rank_hits = metrics.counter_family("router_rank_hits", "Hits of the experts a rank holds.",
                                           ["group", "layer", "rank"])
        balance = metrics.gauge_family("router_rank_load_imbalance_ratio",
                                       "Largest rank load over the mean rank load of the layer.", ["group", "layer"])
        epoch = metrics.gauge_family("router_placement_epoch", "The group's expert placement epoch as last read.",
                                     ["group"])
        window = metrics.gauge_family("router_window_rank_load_imbalance_ratio",
                                      "Largest rank load over the mean over the scale-up window, under the "
                                      "group's placement.", ["group", "layer"])
        for group_id, world_size in sorted(self._world_sizes.items()):
            self._collect_window(group_id, epoch, window)
            reports.add_metric([group_id], self._stats.num_reports(group_id))
            for layer in self._stats.layer_stats(group_id):
                layer_label = str(layer.layer)
                for expert, (count, rate) in enumerate(zip(layer.counts, layer.hit_rates)):
                    hits.add_metric([group_id, layer_label, str(expert)], count)
                    ratio.add_metric([group_id, layer_label, str(expert)], rate)
                loads = rank_loads(layer.counts, world_size)
                if loads is None:
                    continue
                for rank, load in enumerate(loads):
                    rank_hits.add_metric([group_id, layer_label, str(rank)], load)
                balance.add_metric([group_id, layer_label], imbalance(loads))
        yield from (reports, hits, ratio, rank_hits, balance, epoch, window)

    def _collect_window(self, group_id: str, epoch, window) -> None:
        placement = None if self._placement_of is None else self._placement_of(group_id)
        if placement is None or self._windows is None:
            return
        epoch.add_metric([group_id], placement.epoch)
        for layer, counts in self._windows.counts(group_id, self._window_s, self._clock()).items():
            if len(counts) == placement.num_experts:
                window.add_metric([group_id, str(layer)], imbalance(placement.rank_loads(layer, counts)))
