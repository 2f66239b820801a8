"""moe.gateway.v1.GenerationService: protobuf <-> the gateway's domain objects.

Generate validates the request (a large input or a constraint in a thread, so
that a huge prompt being tokenized or a schema being compiled does not stall
the other streams), submits it to the
engine of the ready worker group and streams its outputs; every gateway
error becomes a gRPC status here and nowhere else. Generate is an async generator (not context.write: the
OpenTelemetry interceptor breaks that). When the client goes away the
generator is closed, and the request is aborted: its blocks are freed at the
next step. A stream that falls behind (the engine paces the wake-ups of
hundreds of streams so that its steps are not held up by them) sends the
outputs it finds queued as one message: the contract is the tokens and text
since the previous message, and every message costs the event loop tens of
microseconds in gRPC. The call's gRPC deadline becomes the request's deadline in the
batcher, which ends it with DEADLINE_EXCEEDED and frees its blocks even if the
cancellation never reached the gateway.

Abort ends the live requests with the given request id (gateway/live_requests.py
keeps them by id, from submit to the end of their Generate call) exactly as a
client's cancellation does, except that their streams end with an ABORT
message. GetModelInfo answers from the ModelInfo fixed at start, plus the
ranks of the engine that takes requests (0 while there is none).
"""

import asyncio
import functools
import logging
import time
from collections.abc import Callable

import grpc

from gateway.engine import Engine
from gateway.live_requests import LiveRequests
from gateway.model_info import ModelInfo
from gateway.observability import observe_generate
from gateway.requests import ErrorCode, FinishReason, GenerationError, RequestOutput, merge_outputs
from gateway.validation import (LARGE_INPUT_SIZE, RequestError, RequestLimits, ValidatedRequest, has_constraint,
                                input_size, validate_request)
from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from services.constraints import Compiler

log = logging.getLogger("gateway.servicer")

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
NO_GROUP_MESSAGE = "no worker group is ready"

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
        request_id=output.request_id, token_ids=output.token_ids, text=output.text)
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
    """The public API. get_engine returns the engine taking requests, or None."""

    def __init__(self, *, tokenizer, limits: RequestLimits, model_info: ModelInfo,
                 get_engine: Callable[[], Engine | None], coalesce_outputs: bool = True,
                 compiler: Compiler | None = None) -> None:
        self._tokenizer = tokenizer
        self._limits = limits
        # Compiles requests' constraints (None: constrained requests are refused).
        self._compiler = compiler
        self._model_info = model_info
        self._get_engine = get_engine
        self.live_requests = LiveRequests()
        # False: one message per output (tests that check the framing).
        self._coalesce_outputs = coalesce_outputs

    @observe_generate
    async def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            validated = await self._validate(request)
        except RequestError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error.message)
        engine = self._get_engine()
        if engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, NO_GROUP_MESSAGE)
        remaining_s = context.time_remaining()
        deadline = None if remaining_s is None else time.monotonic() + remaining_s
        try:
            handle = engine.submit(validated, deadline=deadline)
        except GenerationError as error:
            await context.abort(_STATUS[error.code], error.message)
        log.debug("request %s: %d prompt tokens, seq %d",
                  validated.request_id, len(validated.prompt_ids), handle.seq.seq_id)
        self.live_requests.add(validated.request_id, engine, handle)
        try:
            async for output in handle:
                ready = handle.take_ready() if self._coalesce_outputs else None
                yield output_to_proto(merge_outputs([output, *ready]) if ready else output)
        except GenerationError as error:
            await context.abort(_STATUS[error.code], error.message)
        finally:
            self.live_requests.remove(validated.request_id, handle)
            # A no-op once the request finished; otherwise the client went away.
            engine.abort(handle)

    async def Abort(self, request: gateway_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> gateway_pb2.AbortResponse:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id must not be empty")
        num_aborted = self.live_requests.abort(request.request_id)
        if not num_aborted:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no live request has request_id {request.request_id!r}")
        log.info("aborted %d request(s) with request_id %r", num_aborted, request.request_id)
        return gateway_pb2.AbortResponse(num_aborted=num_aborted)

    async def GetModelInfo(self, request: gateway_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> gateway_pb2.ModelInfo:
        engine = self._get_engine()
        info = self._model_info
        return gateway_pb2.ModelInfo(
            model_name=info.model_name, architecture=info.architecture, context_length=info.context_length,
            vocab_size=info.vocab_size, dtype=info.dtype, num_experts=info.num_experts,
            num_experts_per_tok=info.num_experts_per_tok,
            num_ranks=0 if engine is None else engine.batcher.num_ranks, features=info.features)

    async def _validate(self, request: gateway_pb2.GenerateRequest) -> ValidatedRequest:
        """validate_request, in a thread for a large input (tokenizing one takes
        seconds; with a GilFreeTokenizer the event loop runs on meanwhile) or a
        constraint (a cold compile takes milliseconds, without the GIL)."""
        args = (request, self._limits, self._tokenizer, self._compiler)
        if input_size(request) < LARGE_INPUT_SIZE and not has_constraint(request):
            return validate_request(*args)
        return await asyncio.to_thread(validate_request, *args)

    async def Tokenize(self, request: gateway_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> gateway_pb2.TokenizeResponse:
        kind = request.WhichOneof("input")
        if kind is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "input must be set to one of text, messages")
        messages = [(m.role, m.content) for m in request.messages.messages]
        num_chars = len(request.text) if kind == "text" else sum(len(c) for _, c in messages)
        if num_chars > self._limits.max_prompt_chars:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{kind} must be at most {self._limits.max_prompt_chars} characters, "
                                f"got {num_chars}")
        if kind == "text":
            encode = functools.partial(self._tokenizer.encode, request.text)
        else:
            encode = functools.partial(self._tokenizer.encode_chat, messages)
        try:
            token_ids = encode() if num_chars < LARGE_INPUT_SIZE else await asyncio.to_thread(encode)
        except ValueError as error:  # an unknown chat role
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"messages: {error}")
        return gateway_pb2.TokenizeResponse(token_ids=token_ids)
