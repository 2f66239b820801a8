"""The gateway's connection to the ranks of its worker group: their status and their step streams.

The one module of the gateway that speaks moe.expert.v1 (as mini-sglang
keeps its sockets in one file). `GroupConnection` opens one channel per rank
of an assignment, asks each rank what it runs (GetRankInfo, as a
`RankStatus`), opens the ExecuteSteps streams the engine drives, and closes
it all. The group manager (gateway/group.py) decides from the statuses
whether the group is usable. `StepStream` is the engine's end of one
ExecuteSteps stream, in the step contract's types (services/step.py): plans
out, results back, failures as one line. It wraps any `RankStream` (a
grpc.aio stream-stream call, or a test's in-process fake).
"""

import asyncio
import dataclasses
from typing import Protocol

import grpc

from moe.expert.v1 import expert_pb2, expert_pb2_grpc
from services import grpc_util, step_codec
from services.cluster import GroupAssignment
from services.step import StepPlan, StepResult


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
        self._channels = [grpc_util.channel(r.address, "expert") for r in group.ranks]
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


class RankStream(Protocol):
    """One rank's ExecuteSteps stream, as grpc.aio's StreamStreamCall exposes it."""

    async def write(self, request: expert_pb2.ExecuteStepsRequest) -> None: ...

    async def read(self) -> "expert_pb2.ExecuteStepsResponse | object": ...


class StreamClosed(Exception):
    """The rank ended its step stream (no result will come)."""


class StepStream:
    """Plans out to one rank and its results back, in the step contract's types."""

    __slots__ = ("_call",)

    def __init__(self, call: RankStream) -> None:
        self._call = call

    async def send(self, plan: StepPlan) -> None:
        """Writes the plan."""
        await self._call.write(step_codec.plan_to_request(plan))

    async def receive(self) -> StepResult:
        """The next result; StreamClosed once the rank has closed the stream."""
        response = await self._call.read()
        if not isinstance(response, expert_pb2.ExecuteStepsResponse):  # grpc.aio.EOF
            raise StreamClosed("closed its step stream")
        return step_codec.result_from_pb(response.result)

    async def failure_reason(self, error: Exception) -> str:
        """Why the stream failed: its gRPC status once the call has ended (a write
        after the end only says "RPC already finished"), else the error."""
        call = self._call
        if isinstance(call, grpc.aio.Call) and call.done():
            return f"{(await call.code()).name}: {await call.details()}"
        return error_text(error)


def error_text(error: BaseException) -> str:
    """One line for a log or a status message; a gRPC error as CODE: details."""
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return str(error) or repr(error)
