"""The gateway's calls to its group's ranks (gateway/rank_client.py), over real gRPC on port 0: a
rank's answer as a RankStatus, and a rank that answers with an error as RankCallError."""

import asyncio

import grpc
import pytest

from gateway.rank_client import GroupConnection, RankCallError, RankStatus
from moe.expert.v1 import expert_pb2, expert_pb2_grpc
from services import grpc_util
from services.cluster import GroupAssignment, RankInfo


class FakeRank(expert_pb2_grpc.ExpertServiceServicer):
    def __init__(self, rank: int, *, is_broken: bool = False):
        self.rank, self.is_broken = rank, is_broken

    async def GetRankInfo(self, request, context):
        if self.is_broken:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no group yet")
        return expert_pb2.GetRankInfoResponse(
            member_id=f"e{self.rank}", group_id="g1", rank=self.rank, world_size=2, placement_epoch=3,
            num_kv_blocks=16, kv_block_size=4, is_ready=True)


async def _statuses(broken_rank: int | None):
    servers = [await grpc_util.start_server(
        [lambda s, r=r: expert_pb2_grpc.add_ExpertServiceServicer_to_server(FakeRank(r, is_broken=r == broken_rank),
                                                                            s)], [])
        for r in range(2)]
    group = GroupAssignment(group_id="g1", epoch=3, term=1, world_size=2, rendezvous_address="",
                            ranks=[RankInfo(r, f"e{r}", f"127.0.0.1:{s.port}") for r, s in enumerate(servers)],
                            gateway_id="gw0")
    connection = GroupConnection(group)
    try:
        return await connection.rank_statuses(timeout_s=5)
    finally:
        await connection.close()
        for server in servers:
            await server.stop(0)


def test_each_rank_answers_with_its_status_by_rank():
    statuses = asyncio.run(_statuses(broken_rank=None))
    assert statuses == [RankStatus(member_id=f"e{r}", group_id="g1", placement_epoch=3, rank=r, world_size=2,
                                   is_ready=True, num_kv_blocks=16, kv_block_size=4) for r in range(2)]


def test_a_rank_that_answers_with_an_error_is_a_rank_call_error():
    with pytest.raises(RankCallError, match="FAILED_PRECONDITION: no group yet"):
        asyncio.run(_statuses(broken_rank=1))
