"""RouterService over gRPC: expert hit reports in, statistics out."""

import grpc

from moe.router.v1 import router_pb2, router_pb2_grpc
from router_svc.stats import ExpertStats


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    """Converts between protobuf and ExpertStats."""

    def __init__(self, stats: ExpertStats, on_report=None):
        self._stats = stats
        # Called with (group_id, rank) for each accepted report (the metrics learn the ranks).
        self._on_report = on_report

    async def ReportExpertHits(self, request, context):
        try:
            self._stats.add_report(request.group_id, [(l.layer, l.counts) for l in request.layers])
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if self._on_report is not None:
            self._on_report(request.group_id, request.rank)
        return router_pb2.ReportExpertHitsResponse()

    async def GetExpertStats(self, request, context):
        return router_pb2.GetExpertStatsResponse(
            layers=[
                router_pb2.LayerStats(layer=s.layer, counts=s.counts, hit_rates=s.hit_rates)
                for s in self._stats.layer_stats(request.group_id)
            ],
            num_reports=self._stats.num_reports(request.group_id),
        )
