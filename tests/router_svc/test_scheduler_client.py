"""The router's gRPC client of the scheduler leader: the proposal on the wire, one channel, errors as ProposalError."""

import grpc
import pytest

from moe.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from router_svc.autoscaler import Committed, Proposal, ProposalError
from router_svc.scheduler_client import SchedulerClient
from services.grpc_util import start_server
from services.placement import EMPTY, Placement
from tests.bounded import run

SERVICE = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name


class FakeLeader(scheduler_pb2_grpc.SchedulerServiceServicer):
    """Commits every proposal for group g0 as the next epoch; refuses others as stale."""

    def __init__(self):
        self.requests: list[scheduler_pb2.ProposePlacementRequest] = []
        self.peers: list[str] = []

    async def ProposePlacement(self, request, context):
        self.requests.append(request)
        self.peers.append(context.peer())
        if request.group_id != "g0":
            await context.abort(grpc.StatusCode.ABORTED, f"group {request.group_id!r} moved on")
        return scheduler_pb2.ProposePlacementResponse(epoch=request.expected_epoch + 1, term=request.term)


async def serve_leader(leader: FakeLeader):
    server = await start_server([lambda s: scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(leader, s)],
                                [SERVICE])
    await server.set_serving(True)
    return server


def test_proposals_go_out_on_one_channel_and_come_back_as_committed():
    placement = Placement(4, 2, 1, {3: (2, EMPTY), 1: (EMPTY, 1)})

    async def body():
        leader = FakeLeader()
        server = await serve_leader(leader)
        client = SchedulerClient(deadline_s=5)
        try:
            address = f"127.0.0.1:{server.port}"
            first = await client.propose(address, Proposal("g0", 4, 9, placement))
            second = await client.propose(address, Proposal("g0", 5, 9, placement))
            with pytest.raises(ProposalError, match="ABORTED: group 'g1' moved on"):
                await client.propose(address, Proposal("g1", 1, 9, placement))
        finally:
            await client.close()
            await server.stop(grace_s=0)
        return leader, first, second

    leader, first, second = run(body())
    assert (first, second) == (Committed(5, 9), Committed(6, 9))
    request = leader.requests[0]
    assert (request.group_id, request.expected_epoch, request.term) == ("g0", 4, 9)
    assert (request.num_experts, request.num_ranks, request.num_spare_slots) == (4, 2, 1)
    assert [(l.layer, list(l.spare_experts)) for l in request.layers] == [(1, [EMPTY, 1]), (3, [2, EMPTY])]
    assert len(set(leader.peers)) == 1, leader.peers  # one connection: the channel is reused


def test_an_unreachable_leader_is_a_proposal_error():
    async def body():
        client = SchedulerClient(deadline_s=0.5)
        try:
            with pytest.raises(ProposalError, match="UNAVAILABLE"):
                await client.propose("127.0.0.1:1", Proposal("g0", 0, 1, Placement(2, 1, 0)))
        finally:
            await client.close()

    run(body())
