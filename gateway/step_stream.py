"""The gateway's end of one rank's ExecuteSteps stream: the step contract on the wire.

Every protobuf and every gRPC detail of the step loop lives here, so
gateway/engine.py deals in StepPlan and StepResult only (as mini-sglang
keeps its sockets in one module). A `RankStream` is anything with
`async write(ExecuteStepsRequest)` and `async read()`, as a grpc.aio
stream-stream call has; the tests drive in-process fakes through it.
"""

from typing import Protocol

import grpc

from moe.expert.v1 import expert_pb2
from services import step_codec
from services.step import StepPlan, StepResult


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
