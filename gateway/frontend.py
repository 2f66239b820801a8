"""What every public transport of the gateway shares: validate, submit, stream, abort.

The gRPC servicer (servicer.py) and the HTTP endpoint both hold one Frontend, so
a request is validated by one set of rules and served by one engine, whichever
way it came in: HTTP translates its JSON into a moe.gateway.v1 GenerateRequest
and calls the same methods. Errors are raised, never mapped, here: RequestError
for bad input (naming the field) and GenerationError for the rest (with an
ErrorCode); each transport turns them into its own status.

A request is validated in a thread when its input is large (tokenizing a huge
prompt takes seconds; with a GilFreeTokenizer the event loop runs on
meanwhile) or when it has a constraint (a cold compile takes milliseconds,
without the GIL). Its outputs are streamed until the last one; whatever ends the
stream early (the client went away, a transport error) aborts the request, so
its blocks are freed at the next step. A stream that falls behind (the engine
paces the wake-ups of hundreds of streams so that its steps are not held up by
them) gets the outputs it finds queued merged into one: the contract is the
tokens and text since the previous message, and every message costs the event
loop tens of microseconds in the transport. Live requests are kept by id from
submit to the end of their stream, for Abort. A stream whose client stops reading
(its write does not return) is cut off by the gateway's SlowReaders
(gateway/slow_readers.py), which aborts its requests.

A request for n > 1 samples is n sequences (gateway/samples.py), all live
under its request id (so Abort, a cancelled stream or a failed sample ends
every one) and streamed interleaved, each output with its sample's index.
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from gateway.engine import Engine
from gateway.live_requests import LiveRequests
from gateway.model_info import ModelInfo
from gateway.requests import ErrorCode, GenerationError, RequestHandle, RequestOutput, merge_outputs
from gateway.samples import interleave, sample_requests
from gateway.slow_readers import SlowReaders
from gateway.validation import (LARGE_INPUT_SIZE, RequestError, RequestLimits, ValidatedRequest, has_constraint,
                                input_size, validate_request)
from moe.gateway.v1 import gateway_pb2
from services.constraints import Compiler

log = logging.getLogger("gateway.frontend")

NO_GROUP_MESSAGE = "no worker group is ready"


class Frontend:
    """The gateway's public operations; get_engine returns the engine taking requests, or None."""

    def __init__(self, *, tokenizer, limits: RequestLimits, model_info: ModelInfo,
                 get_engine: Callable[[], Engine | None], coalesce_outputs: bool = True,
                 compiler: Compiler | None = None, slow_readers: SlowReaders | None = None,
                 no_group_reason: Callable[[], str | None] = lambda: None) -> None:
        self.tokenizer = tokenizer
        # Why there is no engine, when the gateway knows (its group serves another model).
        self._no_group_reason = no_group_reason
        self.limits = limits
        self.model_info = model_info
        # Compiles requests' constraints (None: constrained requests are refused).
        self._compiler = compiler
        self._get_engine = get_engine
        self.live_requests = LiveRequests()
        # False: one output per message (tests that check the framing).
        self._coalesce_outputs = coalesce_outputs
        # Every stream's writes are watched; with a timeout of 0 none is ever cut off.
        self.slow_readers = slow_readers or SlowReaders(0.0)

    async def validate(self, request: gateway_pb2.GenerateRequest) -> ValidatedRequest:
        """validate_request, in a thread for a large input or a constraint; raises RequestError."""
        args = (request, self.limits, self.tokenizer, self._compiler)
        if input_size(request) < LARGE_INPUT_SIZE and not has_constraint(request):
            return validate_request(*args)
        return await asyncio.to_thread(validate_request, *args)

    async def generate(self, validated: ValidatedRequest, *, deadline: float | None = None,
                       end_call: Callable[[], Awaitable[None]] | None = None,
                       owner: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit `validated` and yield its outputs until the last of each sample
        (interleaved, each with its index); raises GenerationError.

        `deadline` (time.monotonic()) ends the request with DEADLINE_EXCEEDED in
        the batcher, which frees its blocks even if the transport's cancellation
        never reaches the gateway. `end_call`: how the transport ends a call whose client
        stopped reading (gateway/slow_readers.py). `owner`: the name of the caller's API key
        (None without keys): only the same owner's Abort ends the request.
        """
        engine = self._get_engine()
        if engine is None:
            reason = self._no_group_reason()
            raise GenerationError(ErrorCode.UNAVAILABLE,
                                  f"{NO_GROUP_MESSAGE}: {reason}" if reason else NO_GROUP_MESSAGE)
        handles: list[RequestHandle] = []

        def abort_all() -> None:
            for handle in handles:
                engine.abort(handle)

        watch = self.slow_readers.open(validated.request_id, abort_all, end_call)
        try:
            for request in sample_requests(validated):
                handles.append(engine.submit(request, deadline=deadline, leader=handles[0] if handles else None))
                self.live_requests.add(validated.request_id, engine, handles[-1], owner)
                log.debug("request %s: %d prompt tokens, seq %d", validated.request_id,
                          len(validated.prompt_ids), handles[-1].seq.seq_id)
            if len(handles) > 1:
                outputs = interleave(handles, coalesce_outputs=self._coalesce_outputs)
                async with contextlib.aclosing(outputs):
                    async for output in outputs:
                        watch.start_write()
                        yield output
                        watch.end_write()
                return
            async for output in handles[0]:
                ready = handles[0].take_ready() if self._coalesce_outputs else None
                watch.start_write()
                yield merge_outputs([output, *ready]) if ready else output
                watch.end_write()
        finally:
            self.slow_readers.close(watch)
            for handle in handles:
                self.live_requests.remove(validated.request_id, handle)
                # A no-op once the request finished; otherwise the stream was left early.
                engine.abort(handle)

    def abort(self, request_id: str, owner: str | None = None) -> int:
        """End every live request with `request_id` that `owner` (an API key's name, None
        without keys) sent (FINISH_REASON_ABORT); how many there were."""
        if not request_id:
            raise RequestError("request_id", "request_id must not be empty")
        return self.live_requests.abort(request_id, owner)

    @property
    def num_ranks(self) -> int:
        """Ranks of the worker group that takes requests; 0 while there is none."""
        engine = self._get_engine()
        return 0 if engine is None else engine.batcher.num_ranks

    async def tokenize(self, *, text: str | None = None,
                       messages: Sequence[tuple[str, str]] | None = None) -> list[int]:
        """The token ids of `text`, or of `messages` (role, content) through the chat template."""
        field = "text" if messages is None else "messages"
        num_chars = len(text or "") if messages is None else sum(len(c) for _, c in messages)
        if num_chars > self.limits.max_prompt_chars:
            raise RequestError(field, f"{field} must be at most {self.limits.max_prompt_chars} characters, "
                                      f"got {num_chars}")

        def encode() -> list[int]:
            if messages is None:
                return self.tokenizer.encode(text or "")
            try:
                return self.tokenizer.encode_chat(list(messages))
            except ValueError as error:  # an unknown chat role
                raise RequestError("messages", f"messages: {error}") from error

        return encode() if num_chars < LARGE_INPUT_SIZE else await asyncio.to_thread(encode)
