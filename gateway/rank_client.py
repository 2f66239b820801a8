"""The gateway's connection to the ranks of its worker group: their status and their step streams.

`GroupConnection` opens one channel per rank of an assignment, asks each
rank what it runs (GetRankInfo, as a `RankStatus`), opens the ExecuteSteps
streams the engine drives, and closes it all. The group manager
(gateway/group.py) decides from the statuses whether the group is usable;
this module is where its protobufs and gRPC errors stay.
"""

import asyncio
import dataclasses

import grpc

from moe.expert.v1 import expert_pb2, expert_pb2_grpc
from services import grpc_util
from services.cluster import GroupAssignment


@dataclasses.dataclass(frozen=True, slots=True)
class RankStatus:
    """What a rank says it runs: its place in a group and its KV pool."""

    member_id: str
    group_id: str
    placement_epoch: int
    rank: int
    world_size: int
    is_ready: bool
    num_kv_blocks: int
    kv_block_size: int


class RankCallError(Exception):
    """A call to a rank failed (unreachable, or it answered with an error status)."""


def status_from_proto(info: expert_pb2.GetRankInfoResponse) -> RankStatus:
    """The RankStatus of a GetRankInfo answer."""
    return RankStatus(member_id=info.member_id, group_id=info.group_id, placement_epoch=info.placement_epoch,
                      rank=info.rank, world_size=info.world_size, is_ready=info.is_ready,
                      num_kv_blocks=info.num_kv_blocks, kv_block_size=info.kv_block_size)


class GroupConnection:
    """Channels to the ranks of one assignment, by rank; close() ends its streams and channels."""

    def __init__(self, group: GroupAssignment):
        self._channels = [grpc_util.channel(r.address) for r in group.ranks]
        self._streams: list = []

    async def rank_statuses(self, timeout_s: float) -> list[RankStatus]:
        """GetRankInfo on every rank (waiting for it to be reachable, up to timeout_s); RankCallError
        if a call fails."""
        calls = [
            expert_pb2_grpc.ExpertServiceStub(c).GetRankInfo(
                expert_pb2.GetRankInfoRequest(), timeout=timeout_s, wait_for_ready=True)
            for c in self._channels
        ]
        try:
            infos = await asyncio.gather(*calls)
        except grpc.aio.AioRpcError as error:
            raise RankCallError(f"GetRankInfo failed: {error.code().name}: {error.details()}") from error
        return [status_from_proto(info) for info in infos]

    def open_step_streams(self) -> list:
        """One ExecuteSteps stream per rank, by rank (the engine writes plans and reads results)."""
        self._streams = [expert_pb2_grpc.ExpertServiceStub(c).ExecuteSteps() for c in self._channels]
        return list(self._streams)

    async def close(self) -> None:
        """Cancels the streams and closes the channels."""
        for stream in self._streams:
            stream.cancel()
        await asyncio.gather(*(c.close() for c in self._channels), return_exceptions=True)
