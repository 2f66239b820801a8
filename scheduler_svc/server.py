"""A scheduler replica's lifecycle: start, register, campaign, lead or follow, hand over, stop.

Connects to etcd, serves SchedulerService (health SERVING once etcd
answered), builds its view of the cluster (GetClusterState answers from
it), then registers as a scheduler member and campaigns for leadership;
the leader forms worker groups and health-checks the gateways (a dead one
loses its lease at once) and the expert services (a dead or hung rank loses
its lease at once, and its group is re-formed: scheduler_svc/member_probe.py), the followers
health-check the leader and depose it when it stops answering
(scheduler_svc/election.py).
SIGTERM/SIGINT: a leader first hands its term to a live follower
(Election.hand_over: one etcd transaction; the follower leads within
milliseconds, without an election); then the lease is revoked (a leader
that found no follower loses /leader with it, and the followers campaign),
then the server stops.
"""

import asyncio
import contextlib
import logging
from collections.abc import Awaitable

from moe.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.cluster_view import ClusterView
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.election import Election, LeaderProbe
from scheduler_svc.member_probe import MemberProbe, probe_members
from scheduler_svc.health_client import HealthCheck
from scheduler_svc.observability import LeaderWatch
from scheduler_svc.servicer import SchedulerServicer
from scheduler_svc.state import RepairState, lead_groups
from services import http_probes, process
from services.cluster import ClusterClient, cancel_and_wait
from services.grpc_util import start_server

ROLE = "scheduler"
log = logging.getLogger(ROLE)
SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name
# On SIGTERM, how long the leader may take to hand its term to a follower
# before it just revokes its lease (etcd unreachable).
_HANDOVER_BUDGET_S = 2.0


async def serve(config: SchedulerConfig, stop: asyncio.Event) -> None:
    """Runs the replica until stop is set."""
    client = ClusterClient(config.etcd, prefix=config.key_prefix, reach_timeout_s=config.etcd_connect_timeout_s)
    leader_watch = LeaderWatch(client, config.member_id)  # leadership metrics and /readyz
    probes = await http_probes.start_probes(ROLE, config, leader_watch.readiness)
    # GetClusterState's view of the prefix; it also feeds the leadership metrics.
    view = ClusterView(client, on_change=lambda snapshot: leader_watch.observe(snapshot.leader))
    election: Election | None = None  # needs the server's address, and the servicer needs the election
    servicer = SchedulerServicer(client, config.member_id, lambda: None if election is None else election.leadership,
                                 view)
    server = await start_server(
        [lambda s: scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, s)],
        [SERVICE_NAME], host=config.host, port=config.port,
    )
    campaign = watch = None
    health_check = HealthCheck(config.leader_probe_timeout_s)
    try:
        await client.connect(wait_s=None)
        address = config.address(server.port)
        # The view first: a registered replica may be handed the term at once
        # (the longest registered is the heir), and must answer from it then.
        watch = asyncio.create_task(view.run(), name="cluster-view")
        await view.wait_warm(watch)
        await client.register(ROLE, config.member_id, address, ttl=config.lease_ttl_s)
        election = Election(client, config.member_id, address, probe=leader_probe(config, health_check))
        campaign = asyncio.create_task(election.run(lambda leadership: with_member_probes(
            client, config, lead_groups(client, leadership, config.group_size, RepairState(
                reform_wait_s=config.reform_wait_s, reform_settle_s=config.reform_settle_s)))))
        await server.set_serving(True)
        process.announce_port(ROLE, config, server.port)
        await stop.wait()
    finally:
        # First of all: a leader hands its term to a follower (which leads
        # within milliseconds, without an election); then revoking the lease
        # deletes our member key (and /leader, if still ours: no follower
        # took it), so the followers campaign. The election and the watch
        # end on the closed client; a write of ours still in flight is fenced off.
        log.info("stopping")
        if election is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_HANDOVER_BUDGET_S):
                    await election.hand_over(campaign)
        await client.close()
        log.info("deregistered")
        await server.set_serving(False)
        await cancel_and_wait([campaign, watch], what="the election and the cluster view")
        await health_check.close()
        await server.stop(grace_s=1.0)
        await probes.close()
        log.info("stopped")


async def with_member_probes(client: ClusterClient, config: SchedulerConfig, lead: Awaitable[None]) -> None:
    """Runs the leader's work, and meanwhile its probes of the gateways and the ranks
    (scheduler_svc/member_probe.py)."""
    probes = []
    if config.gateway_probe_interval_s:
        probes.append(MemberProbe("gateway", config.gateway_probe_interval_s, config.leader_probe_misses))
    if config.rank_probe_interval_s:
        probes.append(MemberProbe("expert", config.rank_probe_interval_s, config.rank_probe_misses,
                                  silent_s=config.rank_probe_silent_s))
    probing = [asyncio.create_task(probe_members(client, probe, lambda deadline_s, role=probe.role: HealthCheck(
        deadline_s, role)), name=f"{probe.role}-probe") for probe in probes]
    try:
        await lead
    finally:
        await cancel_and_wait(probing, what="the member probes")


def leader_probe(config: SchedulerConfig, check: HealthCheck) -> LeaderProbe | None:
    """How this replica probes the leader while it follows; None if probing is off."""
    if config.leader_probe_interval_s == 0:
        return None
    return LeaderProbe(check, interval_s=config.leader_probe_interval_s, misses=config.leader_probe_misses,
                       max_answer_s=3 * config.leader_probe_timeout_s, silent_s=config.leader_probe_silent_s)
