"""RouterService over gRPC: expert hit reports in, statistics out."""

import time
from collections.abc import Callable

import grpc

from moe.router.v1 import router_pb2, router_pb2_grpc
from router_svc.policy import imbalance
from router_svc.stats import ExpertStats, hit_rates
from router_svc.windows import SlidingWindows
from services.placement import Placement


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    """Converts between protobuf and ExpertStats (cumulative) and SlidingWindows (recent)."""

    def __init__(self, stats: ExpertStats, on_report=None, *, windows: SlidingWindows | None = None,
                 placement_of: Callable[[str], Placement | None] = lambda group_id: None,
                 clock: Callable[[], float] = time.monotonic):
        self._stats = stats
        # Called with (group_id, rank) for each accepted report (the metrics learn the ranks).
        self._on_report = on_report
        self._windows, self._placement_of, self._clock = windows, placement_of, clock

    async def ReportExpertHits(self, request, context):
        layers = [(l.layer, l.counts) for l in request.layers]
        try:
            self._stats.add_report(request.group_id, layers)
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if self._windows is not None:
            self._windows.add(request.group_id, request.rank, layers, self._clock())
        if self._on_report is not None:
            self._on_report(request.group_id, request.rank)
        return router_pb2.ReportExpertHitsResponse()

    async def GetExpertStats(self, request, context):
        group_id = request.group_id
        if request.window_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"window_s must be >= 0, got {request.window_s}")
        if request.window_s > 0:
            if self._windows is None or not group_id:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "window_s needs a group_id")
            counts = self._windows.counts(group_id, request.window_s, self._clock())
            per_layer = [(layer, c, hit_rates(c)) for layer, c in counts.items()]
        else:
            per_layer = [(s.layer, s.counts, s.hit_rates) for s in self._stats.layer_stats(group_id)]
        placement = self._placement_of(group_id) if group_id else None
        layers = []
        for layer, layer_counts, rates in per_layer:
            stats = router_pb2.LayerStats(layer=layer, counts=layer_counts, hit_rates=rates)
            if placement is not None and placement.num_experts == len(layer_counts):
                loads = placement.rank_loads(layer, layer_counts)
                stats.rank_loads.extend(loads)
                stats.rank_load_imbalance = imbalance(loads)
            layers.append(stats)
        return router_pb2.GetExpertStatsResponse(layers=layers, num_reports=self._stats.num_reports(group_id))
