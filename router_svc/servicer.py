"""RouterService over gRPC: protobuf to the router's ExpertLoad and back, nothing else."""

import grpc

from moe.router.v1 import router_pb2, router_pb2_grpc
from router_svc.load import ExpertLoad


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    """Hit reports in, statistics out; a ValueError of the domain is INVALID_ARGUMENT."""

    def __init__(self, load: ExpertLoad):
        self._load = load

    async def ReportExpertHits(self, request, context):
        try:
            self._load.add_report(request.group_id, request.rank, [(l.layer, l.counts) for l in request.layers])
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return router_pb2.ReportExpertHitsResponse()

    async def GetExpertStats(self, request, context):
        try:
            loads = self._load.layer_loads(request.group_id, request.window_s)
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        layers = [router_pb2.LayerStats(layer=l.layer, counts=l.counts, hit_rates=l.hit_rates,
                                        rank_loads=l.rank_loads, rank_load_imbalance=l.rank_load_imbalance)
                  for l in loads]
        return router_pb2.GetExpertStatsResponse(layers=layers, num_reports=self._load.num_reports(request.group_id))
