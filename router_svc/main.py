"""Entry point of the router service: python -m router_svc.main --member-id r0 ...

Serves RouterService, registers in etcd as role `router` (health SERVING
once registered); SIGTERM/SIGINT revokes the lease and stops the server.
"""

import asyncio
import sys

from moe.router.v1 import router_pb2, router_pb2_grpc
from router_svc.config import RouterConfig
from router_svc.observability import RouterStatsCollector
from router_svc.servicer import RouterServicer
from router_svc.stats import ExpertStats
from services import cluster, http_probes, settings
from services.grpc_util import start_server

ROLE = "router"
SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name


async def serve(config: RouterConfig, stop: asyncio.Event) -> None:
    """Runs the router until stop is set."""
    stats = ExpertStats()
    collector = RouterStatsCollector(stats)
    is_registered = False
    probes = await http_probes.start_probes(ROLE, config, lambda: {"ready": is_registered})
    probes.add_collector(collector)
    servicer = RouterServicer(stats, on_report=collector.on_report)
    server = await start_server(
        [lambda s: router_pb2_grpc.add_RouterServiceServicer_to_server(servicer, s)],
        [SERVICE_NAME], host=config.host, port=config.port,
    )
    try:
        async with cluster.registered(config.etcd, ROLE, config.member_id, config.address(server.port),
                                      ttl=config.lease_ttl_s, prefix=config.key_prefix):
            await server.set_serving(True)
            is_registered = True
            settings.announce_port(ROLE, config, server.port)
            await stop.wait()
            is_registered = False
            await server.set_serving(False)
    finally:
        await server.stop(grace_s=1.0)
        await probes.close()


def main(argv: list[str] | None = None) -> None:
    settings.run_role(ROLE, RouterConfig, serve, argv, prog="python -m router_svc.main")


if __name__ == "__main__":
    main(sys.argv[1:])
