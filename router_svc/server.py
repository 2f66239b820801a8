"""The router service's lifecycle: start, register, scale, drain.

Serves RouterService, registers in etcd as role `router` (health SERVING
once registered) and, unless --policy-interval-s is 0, runs the expert
scaling loop (router_svc/autoscaler.py). SIGTERM/SIGINT drains: the
scaling loop stops first (no proposal is cut off half way: a proposal in
flight finishes within its deadline), then the lease is revoked and the
server stops.
"""

import asyncio
import contextlib
import logging

from moe.router.v1 import router_pb2, router_pb2_grpc
from router_svc.autoscaler import Autoscaler
from router_svc.config import RouterConfig
from router_svc.load import ExpertLoad, group_placement
from router_svc.observability import RouterStatsCollector
from router_svc.scheduler_client import SchedulerClient
from router_svc.servicer import RouterServicer
from router_svc.stats import ExpertStats
from router_svc.windows import SlidingWindows
from services import cluster, http_probes, process
from services.grpc_util import start_server
from services.placement import Placement

ROLE = "router"
SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name
log = logging.getLogger("router_svc")


async def serve(config: RouterConfig, stop: asyncio.Event) -> None:
    """Runs the router until stop is set."""
    stats = ExpertStats()
    windows = SlidingWindows(config.window_horizon_s)
    is_registered = False
    autoscaler: Autoscaler | None = None

    def placement_of(group_id: str) -> Placement | None:
        return group_placement(group_id, {} if autoscaler is None else autoscaler.placements, windows, stats)

    collector = RouterStatsCollector(stats, windows=windows, placement_of=placement_of,
                                     window_s=config.scale_up_window_s)
    probes = await http_probes.start_probes(ROLE, config, lambda: {"ready": is_registered})
    probes.add_collector(collector)
    servicer = RouterServicer(ExpertLoad(stats, windows=windows, placement_of=placement_of,
                                         on_report=collector.on_report))
    server = await start_server(
        [lambda s: router_pb2_grpc.add_RouterServiceServicer_to_server(servicer, s)],
        [SERVICE_NAME], host=config.host, port=config.port,
    )
    scaling: asyncio.Task | None = None
    scheduler = SchedulerClient(config.propose_deadline_s)
    try:
        async with cluster.registered(config.etcd, ROLE, config.member_id, config.address(server.port),
                                      ttl=config.lease_ttl_s, prefix=config.key_prefix,
                                      reach_timeout_s=config.etcd_connect_timeout_s) as client:
            await server.set_serving(True)
            is_registered = True
            process.announce_port(ROLE, config, server.port)
            if config.policy_interval_s > 0:
                autoscaler = Autoscaler(config, windows, client, scheduler)
                scaling = asyncio.create_task(autoscaler.run(), name="autoscaler")
            await stop.wait()
            log.info("stopping: the scaling loop first, then the server")
            is_registered = False
            if autoscaler is not None:
                autoscaler.stop()
                await asyncio.wait([scaling], timeout=config.propose_deadline_s + 1.0)
            await server.set_serving(False)
    finally:
        if scaling is not None and not scaling.done():
            scaling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await scaling
        await scheduler.close()
        await server.stop(grace_s=1.0)
        await probes.close()
