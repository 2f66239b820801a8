"""Entry point of a scheduler replica: python -m scheduler_svc.main --member-id s0 ...

Connects to etcd, serves SchedulerService (health SERVING once etcd
answered), registers as a scheduler member and campaigns for leadership;
the leader forms worker groups. SIGTERM/SIGINT: revoke the lease first (the
leader key goes with it, so another replica takes over within
milliseconds), then stop the server.
"""

import asyncio
import sys

from moe.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.election import Election
from scheduler_svc.observability import LeaderWatch
from scheduler_svc.servicer import SchedulerServicer
from scheduler_svc.state import lead_groups
from services import http_probes, settings
from services.cluster import ClusterClient, cancel_and_wait
from services.grpc_util import start_server

ROLE = "scheduler"
SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name


async def serve(config: SchedulerConfig, stop: asyncio.Event) -> None:
    """Runs the replica until stop is set."""
    client = ClusterClient(config.etcd, prefix=config.key_prefix)
    leader_watch = LeaderWatch(client, config.member_id)  # leadership metrics and /readyz
    probes = await http_probes.start_probes(ROLE, config, leader_watch.readiness)
    servicer = SchedulerServicer(client, config.member_id)
    server = await start_server(
        [lambda s: scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, s)],
        [SERVICE_NAME], host=config.host, port=config.port,
    )
    campaign = watch = None
    try:
        await client.connect(wait_s=None)
        address = config.address(server.port)
        await client.register(ROLE, config.member_id, address, ttl=config.lease_ttl_s)
        watch = asyncio.create_task(leader_watch.run(), name="leader-metrics")
        election = Election(client, config.member_id, address)
        campaign = asyncio.create_task(election.run(
            lambda leadership: lead_groups(client, leadership, config.group_size)))
        await server.set_serving(True)
        settings.announce_port(ROLE, config, server.port)
        await stop.wait()
        await server.set_serving(False)
    finally:
        if campaign is not None:
            campaign.cancel()
            await asyncio.gather(campaign, return_exceptions=True)
        await cancel_and_wait([watch], what="the leader metrics watch")
        await client.close()  # revokes the lease: /leader and our member key go now
        await server.stop(grace_s=1.0)
        await probes.close()


def main(argv: list[str] | None = None) -> None:
    settings.run_role(ROLE, SchedulerConfig, serve, argv, prog="python -m scheduler_svc.main")


if __name__ == "__main__":
    main(sys.argv[1:])
