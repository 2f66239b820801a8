"""The rank's calls to the router: hit-count reports as ReportExpertHits, over one reused channel.

The router is looked up (through `resolve_router`, etcd in a running rank)
at the first report and again after a failed call, since it may have moved;
every call has a deadline. A failure is logged and answered False, and the
StatsReporter keeps the counts for the next report.
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

import grpc

from expert_svc.stats_reporter import HitReport
from moe.router.v1 import router_pb2, router_pb2_grpc
from services import grpc_util

log = logging.getLogger("expert_svc.stats")


def hits_request(report: HitReport, *, group_id: str, rank: int,
                 moe_layers: Sequence[int]) -> router_pb2.ReportExpertHitsRequest:
    """The protobuf of a report; layers are the model's MoE layer indices, one per row of counts_LE."""
    return router_pb2.ReportExpertHitsRequest(
        group_id=group_id,
        rank=rank,
        first_step_id=report.first_step_id,
        last_step_id=report.last_step_id,
        layers=[router_pb2.LayerHits(layer=layer, counts=row)
                for layer, row in zip(moe_layers, report.counts_LE.tolist())],
    )


class RouterClient:
    """Sends one rank's hit reports to the router (a HitSink of expert_svc/stats_reporter.py)."""

    def __init__(self, resolve_router: Callable[[], Awaitable[str | None]], *, group_id: str, rank: int,
                 moe_layers: Sequence[int], deadline_s: float):
        self._resolve_router = resolve_router
        self._group_id, self._rank = group_id, rank
        self._moe_layers = list(moe_layers)
        self._deadline_s = deadline_s
        self._channel: grpc.aio.Channel | None = None
        self._router_address: str | None = None

    async def report_hits(self, report: HitReport) -> bool:
        """Sends the report; False if no router is registered or the call failed."""
        stub = await self._router_stub()
        if stub is None:
            log.debug("no router registered; holding hit counts")
            return False
        request = hits_request(report, group_id=self._group_id, rank=self._rank, moe_layers=self._moe_layers)
        try:
            await stub.ReportExpertHits(request, timeout=self._deadline_s)
        except grpc.aio.AioRpcError as error:
            log.warning("ReportExpertHits to %s failed: %s %s", self._router_address,
                        error.code().name, error.details())
            await self.close()
            return False
        return True

    async def _router_stub(self) -> router_pb2_grpc.RouterServiceStub | None:
        if self._channel is None:
            try:
                self._router_address = await asyncio.wait_for(self._resolve_router(), self._deadline_s)
            except (TimeoutError, OSError) as error:
                log.warning("cannot look up the router: %r", error)
                return None
            if self._router_address is None:
                return None
            self._channel = grpc_util.channel(self._router_address, "router")
        return router_pb2_grpc.RouterServiceStub(self._channel)

    async def close(self) -> None:
        """Forgets the router, so the next report looks it up again (it may have moved)."""
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()
