"""moe.gateway.v1.GenerationService: protobuf <-> the gateway's Frontend.

The Frontend (frontend.py) validates, submits, streams and aborts, for this
servicer and the HTTP endpoint alike; here its errors become gRPC statuses,
and nowhere else. Generate is an async generator (not context.write: the
OpenTelemetry interceptor breaks that). When the client goes away the
generator is closed, and the Frontend aborts the request. The call's gRPC
deadline becomes the request's deadline in the batcher.

Abort ends the live requests with the given request id exactly as a client's
cancellation does, except that their streams end with an ABORT message.
GetModelInfo answers from the ModelInfo fixed at start, plus the ranks of the
engine that takes requests (0 while there is none).

A Generate stream whose client stops reading is ended with RESOURCE_EXHAUSTED
by the gateway's slow-reader watch (gateway/slow_readers.py). Status details
are the Frontend's messages, never an exception's class or stack: whatever
else escapes a handler is INTERNAL "internal error" (services/grpc_limits.py).
"""

import logging
import time
from collections.abc import Callable

import grpc

from gateway.auth import caller_key_name
from gateway.engine import Engine
from gateway.frontend import Frontend
from gateway.model_info import ModelInfo
from gateway.observability import observe_generate
from gateway.slow_readers import SlowReaders
from gateway.requests import ErrorCode, FinishReason, GenerationError, RequestOutput
from gateway.step_budget import Overloaded
from gateway.validation import RequestError, RequestLimits
from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from services.constraints import Compiler

log = logging.getLogger("gateway.servicer")

# Trailing metadata of a request refused under load: milliseconds before a retry may succeed.
RETRY_AFTER_KEY = "retry-after-ms"
SLOW_READER_MESSAGE = "the client did not read its stream in time (--slow-reader-timeout-s); the request was aborted"
SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name

_STATUS = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
}
_FINISH_REASON = {
    None: gateway_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: gateway_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: gateway_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: gateway_pb2.FINISH_REASON_ABORT,
}


def output_to_proto(output: RequestOutput) -> gateway_pb2.GenerateResponse:
    """One stream message; the last one carries the finish reason and the usage."""
    response = gateway_pb2.GenerateResponse(
        request_id=output.request_id, token_ids=output.token_ids, text=output.text, index=output.index)
    if output.logprobs:
        _logprobs_to_proto(output.logprobs, response.logprobs)
    if output.prompt_logprobs:
        _logprobs_to_proto(output.prompt_logprobs, response.prompt_logprobs)
    if output.is_final:
        response.finish_reason = _FINISH_REASON[output.finish_reason]
        response.usage.prompt_tokens = output.prompt_tokens
        response.usage.completion_tokens = output.completion_tokens
        response.usage.cached_tokens = output.cached_tokens
        response.matched_stop = output.matched_stop
    return response


def _logprobs_to_proto(logprobs, field) -> None:
    """Appends TokenLogprob messages to a repeated field, in place (one message per token)."""
    add = field.add
    for lp in logprobs:
        entry = add(token_id=lp.token_id, logprob=lp.logprob)
        for token_id, logprob in lp.top:
            entry.top.add(token_id=token_id, logprob=logprob)


class GenerationServicer(gateway_pb2_grpc.GenerationServiceServicer):
    """The public gRPC API over a Frontend (built from the same arguments)."""

    def __init__(self, *, tokenizer, limits: RequestLimits, model_info: ModelInfo,
                 get_engine: Callable[[], Engine | None], coalesce_outputs: bool = True,
                 compiler: Compiler | None = None, slow_readers: SlowReaders | None = None,
                 no_group_reason: Callable[[], str | None] = lambda: None) -> None:
        self.frontend = Frontend(tokenizer=tokenizer, limits=limits, model_info=model_info,
                                 get_engine=get_engine, coalesce_outputs=coalesce_outputs, compiler=compiler,
                                 slow_readers=slow_readers, no_group_reason=no_group_reason)

    @observe_generate
    async def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            validated = await self.frontend.validate(request)
        except RequestError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error.message)
        remaining_s = context.time_remaining()
        deadline = None if remaining_s is None else time.monotonic() + remaining_s

        async def end_call() -> None:
            # From the slow-reader watch's task, while this handler is stuck in a write. The
            # headers went out first (below): an abort adds them to its batch otherwise, which
            # gRPC refuses while the stuck write's batch still holds them.
            try:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, SLOW_READER_MESSAGE)
            except grpc.aio.AbortError:
                pass

        await context.send_initial_metadata(())
        try:
            async for output in self.frontend.generate(validated, deadline=deadline, end_call=end_call,
                                                       owner=caller_key_name.get()):
                yield output_to_proto(output)
        except GenerationError as error:
            if isinstance(error, Overloaded):  # refused under load: when to try again
                context.set_trailing_metadata(((RETRY_AFTER_KEY, str(error.retry_after_ms)),))
            await context.abort(_STATUS[error.code], error.message)

    async def Abort(self, request: gateway_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> gateway_pb2.AbortResponse:
        try:
            num_aborted = self.frontend.abort(request.request_id, caller_key_name.get())
        except RequestError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error.message)
        if not num_aborted:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no live request has request_id {request.request_id!r}")
        log.info("aborted %d request(s) with request_id %r", num_aborted, request.request_id)
        return gateway_pb2.AbortResponse(num_aborted=num_aborted)

    async def GetModelInfo(self, request: gateway_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> gateway_pb2.ModelInfo:
        info = self.frontend.model_info
        return gateway_pb2.ModelInfo(
            model_name=info.model_name, architecture=info.architecture, context_length=info.context_length,
            vocab_size=info.vocab_size, dtype=info.dtype, num_experts=info.num_experts,
            num_experts_per_tok=info.num_experts_per_tok, num_ranks=self.frontend.num_ranks,
            features=info.features)

    async def Tokenize(self, request: gateway_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> gateway_pb2.TokenizeResponse:
        kind = request.WhichOneof("input")
        if kind is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "input must be set to one of text, messages")
        try:
            if kind == "text":
                token_ids = await self.frontend.tokenize(text=request.text)
            else:
                token_ids = await self.frontend.tokenize(
                    messages=[(m.role, m.content) for m in request.messages.messages])
        except RequestError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error.message)
        return gateway_pb2.TokenizeResponse(token_ids=token_ids)
