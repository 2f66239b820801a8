"""ExpertService over gRPC: protobuf <-> the step contract (services/step_codec.py), errors -> status codes.

One ExecuteSteps stream at a time: a second stream while one is open gets
FAILED_PRECONDITION (the rank's sequences belong to the open stream, and two
gateways interleaving plans would break the group's lockstep). When a stream
ends, for whatever reason, the rank drops all sequence state, so the next
gateway starts clean; a stream opened while the last one is still dropping
its state waits for that instead of failing.

The steps run through StepExecutor.run (expert_svc/executor.py), which may
launch the next plan before it answers the last one; the answers still go
out one per plan, in order, and a bad plan or failed step ends the stream
after the answers of the steps before it.
"""

import asyncio
import collections
import contextlib
import logging

import grpc

from expert_svc.executor import StepFailedError
from expert_svc.observability import SequenceTracer, observe_step
from expert_svc.runner import StalePlanError
from expert_svc.state import RankState
from moe.expert.v1 import expert_pb2, expert_pb2_grpc
from services import step_codec

log = logging.getLogger("expert_svc")


class ExpertServicer(expert_pb2_grpc.ExpertServiceServicer):
    """The gRPC face of one rank; `state.executor` runs the steps once the rank is ready."""

    def __init__(self, state: RankState):
        self._state = state
        # Set while a stream owns the rank; the event fires once its state is dropped.
        self._stream_closed: asyncio.Event | None = None
        self._is_stream_closing = False

    async def ExecuteSteps(self, request_iterator, context):
        executor = self._state.executor
        if executor is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"rank {self._state.member_id} is not ready (no group or still loading)")
        while self._stream_closed is not None:
            if not self._is_stream_closing:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    "another ExecuteSteps stream is open on this rank; one gateway at a time")
            # The last stream has ended (its client may already know) but is still dropping its state.
            await self._stream_closed.wait()
        closed = self._stream_closed = asyncio.Event()
        self._is_stream_closing = False
        log.info("ExecuteSteps stream opened by %s", context.peer())
        tracer = SequenceTracer.create(self._state)  # None while tracing is off
        unanswered: collections.deque[int] = collections.deque()  # step ids of the plans read

        async def plans():
            async for request in request_iterator:
                unanswered.append(request.plan.step_id)
                plan = step_codec.plan_from_pb(request.plan)
                if tracer is not None:
                    tracer.on_plan(plan)
                yield plan

        try:
            async with contextlib.aclosing(executor.run(plans())) as results:
                async for result in results:
                    unanswered.popleft()
                    observe_step(result.execute_seconds)
                    yield step_codec.result_to_response(result)
        except StalePlanError as error:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        except ValueError as error:  # the oldest unanswered plan is the bad one
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step {unanswered[0]}: {error}")
        except StepFailedError as error:  # the model or a collective failed (e.g. a peer timed out)
            log.exception("%s", error)
            await context.abort(grpc.StatusCode.INTERNAL, str(error))
        finally:
            if tracer is not None:
                tracer.end_all()
            self._is_stream_closing = True
            try:
                await executor.reset()
            finally:
                self._stream_closed = None
                closed.set()
                log.info("ExecuteSteps stream closed; sequence state dropped")

    async def GetRankInfo(self, request, context):
        s = self._state
        return expert_pb2.GetRankInfoResponse(
            member_id=s.member_id, group_id=s.group_id, rank=s.rank, world_size=s.world_size,
            placement_epoch=s.placement_epoch, expert_ids=list(s.expert_ids),
            num_kv_blocks=s.num_kv_blocks, kv_block_size=s.kv_block_size,
            is_ready=s.is_ready, model_name=s.model_name,
        )
