"""SchedulerService over gRPC: protobuf to the scheduler's domain and back, nothing else.

GetClusterState answers from the replica's ClusterView
(scheduler_svc/cluster_view.py); ProposePlacement hands the proposal to the
leader's commit (scheduler_svc/placement.py) and maps its errors to status
codes.
"""

from collections.abc import Callable

import grpc

from moe.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc import placement
from scheduler_svc.cluster_view import ClusterView
from scheduler_svc.election import Leadership
from services.cluster import ClusterClient, ClusterSnapshot, ClusterUnavailableError
from services.placement import Placement

_ROLES = {
    "scheduler": scheduler_pb2.MEMBER_ROLE_SCHEDULER,
    "gateway": scheduler_pb2.MEMBER_ROLE_GATEWAY,
    "expert": scheduler_pb2.MEMBER_ROLE_EXPERT,
    "router": scheduler_pb2.MEMBER_ROLE_ROUTER,
}


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
        try:
            snapshot = await self._view.read()
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
