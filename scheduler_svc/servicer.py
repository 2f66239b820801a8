"""SchedulerService over gRPC: the cluster state from etcd as protobuf.

GetClusterState answers from the replica's watch of the whole prefix
(ClusterView), not from an etcd read per call: during a failover the new
leader's first answers would otherwise queue behind the new term's start-up
reads, and a client polling the replicas would add a read of everything per
poll. A replica whose etcd session is not live (etcd unreachable, or the
keepalive failing) reads etcd instead, so it answers UNAVAILABLE rather
than from a view it cannot vouch for.
"""

import asyncio
import contextlib
from collections.abc import Callable

import grpc

from moe.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc import placement
from scheduler_svc.election import Leadership
from services.cluster import ClusterClient, ClusterSnapshot, ClusterUnavailableError
from services.placement import Placement

_ROLES = {
    "scheduler": scheduler_pb2.MEMBER_ROLE_SCHEDULER,
    "gateway": scheduler_pb2.MEMBER_ROLE_GATEWAY,
    "expert": scheduler_pb2.MEMBER_ROLE_EXPERT,
    "router": scheduler_pb2.MEMBER_ROLE_ROUTER,
}


class ClusterView:
    """The cluster state as this replica's watch of the prefix last saw it
    (ClusterClient.watch_snapshot): one revision, milliseconds behind etcd."""

    def __init__(self, client: ClusterClient, on_change: Callable[[ClusterSnapshot], None] = lambda _: None):
        self._client = client
        self._on_change = on_change
        self._snapshot: ClusterSnapshot | None = None
        self._is_warm = asyncio.Event()  # the first snapshot is in

    async def run(self) -> None:
        """Follows the prefix until cancelled (or the client is closed)."""
        async with contextlib.aclosing(self._client.watch_snapshot()) as snapshots:
            async for snapshot in snapshots:
                self._snapshot = snapshot
                self._on_change(snapshot)
                self._is_warm.set()

    async def wait_warm(self, running: asyncio.Task) -> None:
        """Returns once the first snapshot is in; `running` is this view's
        run(), whose error is raised if it ends first. The replica registers
        (and may be handed a term) only then: a new leader never answers late
        because its view is still being built."""
        warm = asyncio.create_task(self._is_warm.wait(), name="cluster-view-warm")
        try:
            await asyncio.wait([warm, running], return_when=asyncio.FIRST_COMPLETED)
        finally:
            warm.cancel()
        if not self._is_warm.is_set():
            running.result()  # raises what run() raised
            raise RuntimeError("the cluster view ended before its first snapshot")

    def current(self) -> ClusterSnapshot | None:
        """The watched snapshot; None before the first one, and while this
        replica's session is not live (its watch may be cut off as well)."""
        session = self._client.session
        if session is None or session.lost.is_set() or self._client.is_closed:
            return None
        return self._snapshot


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    """Answers reads on every replica, from the view (else one etcd snapshot).

    `leadership` says which term this replica's election holds now (None: it
    follows): a replica is the leader only once it acts as one, not merely
    because etcd names it."""

    def __init__(self, client: ClusterClient, replica_id: str, leadership: Callable[[], Leadership | None],
                 view: ClusterView):
        self._client = client
        self._replica_id = replica_id
        self._leadership = leadership
        self._view = view

    async def GetClusterState(self, request, context):
        snapshot = self._view.current()
        if snapshot is None:
            try:
                snapshot = await self._client.snapshot()
            except ClusterUnavailableError as error:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd unreachable: {error}")
        held = self._leadership()
        return cluster_state_pb(snapshot, self._replica_id, None if held is None else held.term)

    async def ProposePlacement(self, request, context):
        try:
            proposed = Placement(request.num_experts, request.num_ranks, request.num_spare_slots,
                                 {layer.layer: tuple(layer.spare_experts) for layer in request.layers})
            committed, term = await placement.commit_proposal(
                self._client, self._replica_id, request.group_id, request.expected_epoch, request.term, proposed)
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except (placement.NotLeaderError, placement.LeaderTermError) as error:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        except placement.StaleProposalError as error:
            await context.abort(grpc.StatusCode.ABORTED, str(error))
        except ClusterUnavailableError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd unreachable: {error}")
        return scheduler_pb2.ProposePlacementResponse(epoch=committed.epoch, term=term)


def cluster_state_pb(snapshot: ClusterSnapshot, replica_id: str,
                     held_term: int | None) -> scheduler_pb2.GetClusterStateResponse:
    """The response for a snapshot as seen by replica_id, whose election holds
    held_term (None: none); it is the leader if etcd agrees on that term."""
    leader = snapshot.leader
    response = scheduler_pb2.GetClusterStateResponse(
        replica_id=replica_id,
        is_leader=leader is not None and leader.member_id == replica_id and leader.term == held_term,
    )
    if snapshot.leader is not None:
        response.leader.CopyFrom(scheduler_pb2.Leader(
            member_id=snapshot.leader.member_id, address=snapshot.leader.address,
            term=snapshot.leader.term, elected_at_unix=snapshot.leader.elected_at,
        ))
    for member in snapshot.members:
        response.members.add(member_id=member.member_id, address=member.address,
                             role=_ROLES.get(member.role, scheduler_pb2.MEMBER_ROLE_UNSPECIFIED))
    for group in snapshot.groups:
        group_pb = response.groups.add(
            group_id=group.group_id, placement_epoch=group.epoch, term=group.term,
            rendezvous_address=group.rendezvous_address, gateway_id=group.gateway_id or "",
        )
        for rank in group.ranks:
            group_pb.ranks.add(rank=rank.rank, member_id=rank.member_id, address=rank.address,
                               is_ready=snapshot.is_rank_ready(group, rank.rank))
    return response
