"""Per-request state on the gateway: the sequence, its outputs and its errors.

A `Sequence` is one generation request placed in the batcher: its prompt, the
ids generated so far (its checkpoint), how much of it the rank has computed,
and the text state (incremental detokenizer, stop-string matcher) that turns
each sampled token into the `RequestOutput` streamed to the client.
`RequestHandle` is the consumer side: an async iterator over those outputs.

Domain types only: the servicer maps them to protobuf and gRPC status codes.
"""

import asyncio
import collections
import dataclasses
import enum
from collections.abc import Collection

from services.step import TokenLogprob
from services.text import StopStringMatcher


class FinishReason(enum.Enum):
    """Why generation ended (the public API's FinishReason, minus UNSPECIFIED)."""

    STOP = 1
    LENGTH = 2
    ABORT = 3


class ErrorCode(enum.Enum):
    """How a failed request maps to a status at the edge."""

    INVALID_ARGUMENT = "invalid_argument"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    DEADLINE_EXCEEDED = "deadline_exceeded"


class GenerationError(Exception):
    """A request failed; `code` says which status the client gets."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclasses.dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step added to a request: its new tokens and new text."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    prompt_tokens: int
    completion_tokens: int
    # Set on the last output only.
    finish_reason: FinishReason | None = None
    matched_stop: str = ""
    # Prompt tokens whose KV came from the prefix cache when the request first started.
    cached_tokens: int = 0
    # With the request's logprobs: one per token of token_ids, in order.
    logprobs: tuple[TokenLogprob, ...] = ()
    # With its prompt_logprobs: on its first output, one per prompt token after the first (from
    # its prompt_logprobs_start on).
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    index: int = 0

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request in the batcher: token state, KV progress and text state.

    request: a validation.ValidatedRequest (request_id, prompt_ids,
    max_new_tokens, temperature, top_p, top_k, seed, stops, ignore_eos).
    detokenizer: an object with push(ids) -> str and flush() -> str
    (services.text.IncrementalDetokenizer).
    deadline: time.monotonic() by which the request must be done, or None.
    leader: the first sample of the same request (n > 1), whose prompt KV this
    one reuses through the prefix cache (admission.py); None for the first.

    The checkpoint of a request is token_ids (prompt plus every token sampled
    so far): a preempted or interrupted sequence is re-prefilled from it and
    continues without emitting any token twice.
    """

    __slots__ = (
        "seq_id", "request", "prompt_ids", "output_ids", "token_ids", "rank", "status",
        "num_computed", "num_in_flight", "is_prefilled", "is_aborted", "finish_reason", "deadline",
        "block_hashes", "num_preemptions", "num_cached_tokens", "jump", "_detokenizer", "_stops", "_has_stops",
        "leader", "prompt_logprobs", "_is_first_output", "first_token_at", "last_token_at",
    )

    def __init__(self, seq_id: int, request, detokenizer, *, deadline: float | None = None,
                 leader: "Sequence | None" = None) -> None:
        self.seq_id = seq_id
        self.request = request
        self.prompt_ids: list[int] = list(request.prompt_ids)
        self.output_ids: list[int] = []
        # Prompt plus generated tokens: the checkpoint.
        self.token_ids: list[int] = list(self.prompt_ids)
        self.rank: int | None = None
        self.status = SeqStatus.WAITING
        # Tokens whose KV the rank has computed, or will have once the steps in flight ran.
        self.num_computed = 0
        # Tokens the steps in flight will add to the output (results not applied yet): one per
        # sampling step, plus a jump-forward chunk's forced tokens.
        self.num_in_flight = 0
        # True once the step that samples after the (re-)prefill is planned: from then on the
        # rank feeds back its own sampled token (decode steps with no input tokens).
        self.is_prefilled = False
        self.is_aborted = False
        self.finish_reason: FinishReason | None = None
        self.deadline = deadline
        # Chained hashes of the full blocks of token_ids (prefix_cache.extend_block_hashes).
        self.block_hashes: list[int] = []
        self.num_preemptions = 0
        # Prompt tokens served from the prefix cache at the first start on a rank (None
        # before it): what the client's usage reports. Later re-prefills (preemption,
        # a re-formed group) do not change it, as vLLM's num_cached_tokens.
        self.num_cached_tokens: int | None = None
        self.leader = leader
        # Jump-forward (gateway/batcher.py): (the token to feed back, the output tokens its
        # constraint forces after it), for the next schedule() only; None if there are none.
        self.jump: tuple[int, tuple[int, ...]] | None = None
        self._detokenizer = detokenizer
        self._stops = StopStringMatcher(list(request.stops))
        # Without stop strings the matcher releases every text at once: skipped (per token, per step).
        self._has_stops = bool(request.stops)
        # With prompt_logprobs: those of prompt positions first_scored_position, ... received so far (the
        # first output carries them).
        self.prompt_logprobs: list[TokenLogprob] = []
        self._is_first_output = True
        # The batcher's clock when the results carrying its first and its latest output token
        # were applied (None before the first): its time per output token so far, which the
        # step budget (gateway/step_budget.py) weighs against the TPOT target.
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens (known to the gateway)."""
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def first_scored_position(self) -> int:
        """The first prompt position whose log-probability the request reports (position 0 has none)."""
        return max(1, self.request.prompt_logprobs_start)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True while the request's prompt log-probabilities are still to come from a rank."""
        return (self.request.logprobs.prompt_logprobs and self._is_first_output
                and self.first_scored_position + len(self.prompt_logprobs) < len(self.prompt_ids))

    @property
    def max_cached_tokens(self) -> int:
        """The most prompt tokens the next (re-)prefill may take from the prefix cache.

        While prompt log-probabilities are still to come, the prefill must start at or before
        the position whose logits score the next missing one (a rank scores the positions of
        the chunks it computes, from the first after the cached prefix); otherwise no limit.
        """
        if not self.wants_prompt_logprobs:
            return len(self.token_ids)
        return self.first_scored_position + len(self.prompt_logprobs) - 1

    def add_prompt_logprob(self, position: int, logprob: TokenLogprob) -> None:
        """Records a prompt token's log-probability from a step result. The rank scores every
        position of a prefill from the first after its cached prefix, and a re-prefill (after a
        preemption or a failover) scores positions again: only the next missing one is taken."""
        if position == self.first_scored_position + len(self.prompt_logprobs) and self.wants_prompt_logprobs:
            self.prompt_logprobs.append(logprob)

    def append_token(self, token_id: int, eos_token_ids: Collection[int], max_context: int,
                     logprob: TokenLogprob | None = None) -> RequestOutput:
        """Records a sampled token (and its log-probability, if the request asked) and returns
        the output it produces, final if it ends the request."""
        assert not self.is_finished, self.seq_id
        self.output_ids.append(token_id)
        self.token_ids.append(token_id)
        matched = None
        if token_id in eos_token_ids and not self.request.ignore_eos:
            # The EOS id is reported and counted, its text is not emitted.
            text, matched = self._drain_text()
            reason = FinishReason.STOP
        else:
            text = self._detokenizer.push((token_id,))
            if self._has_stops:
                text, matched = self._stops.push(text)
            reason = FinishReason.STOP if matched is not None else None
            if reason is None and (len(self.output_ids) >= self.request.max_new_tokens
                                   or self.num_tokens >= max_context):
                more, matched = self._drain_text()
                text += more
                reason = FinishReason.STOP if matched is not None else FinishReason.LENGTH
        if reason is not None:
            self.finish_reason = reason
        return self._output((token_id,), text, reason, matched or "", (logprob,) if logprob else ())

    def rewind(self) -> None:
        """Back to waiting with nothing computed, keeping the checkpoint (token_ids)
        and the text state: a resumed sequence is re-prefilled and continues."""
        self.status = SeqStatus.WAITING
        self.rank = None
        self.num_computed = 0
        self.num_in_flight = 0
        self.is_prefilled = False
        self.jump = None
        self.block_hashes = []  # the next group's block size may differ

    def abort_output(self) -> RequestOutput:
        """The final output of an aborted request (no new tokens or text)."""
        self.finish_reason = FinishReason.ABORT
        return self._output((), "", FinishReason.ABORT, "")

    def _drain_text(self) -> tuple[str, str | None]:
        """Flushes held-back text at the end: the detokenizer's tail through the
        stop matcher, then whatever the matcher still holds."""
        text, matched = self._stops.push(self._detokenizer.flush())
        if matched is None:
            text += self._stops.flush()
        return text, matched

    def _output(self, token_ids, text, reason, matched_stop, logprobs=()) -> RequestOutput:
        prompt_logprobs = tuple(self.prompt_logprobs) if self._is_first_output else ()
        self._is_first_output = False
        return RequestOutput(
            request_id=self.request_id,
            token_ids=tuple(token_ids),
            text=text,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.output_ids),
            cached_tokens=self.num_cached_tokens or 0,
            finish_reason=reason,
            matched_stop=matched_stop,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )


class RequestHandle:
    """The consumer side of a request: `async for output in handle` yields its
    outputs until the final one, or raises the GenerationError that failed it.

    A deque and one waiter rather than an asyncio.Queue: the engine puts one
    output per request and step, hundreds per step at high concurrency, and
    the consumer usually finds its output already there.
    """

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self._items: collections.deque[RequestOutput | GenerationError] = collections.deque()
        # The consumer's future while it waits for an item.
        self._waiter: asyncio.Future | None = None
        # True once the final output or an error has been queued.
        self.is_done = False
        # True once the consumer has taken the final output or the error.
        self._is_consumed = False
        self._num_put = 0

    def put(self, item: RequestOutput | GenerationError, *, wake: bool = True) -> None:
        """Queues an output or an error; nothing after the final one. With wake
        False the consumer sleeps on until wake() (the engine paces wake-ups)."""
        if self.is_done:
            return
        self.is_done = isinstance(item, GenerationError) or item.is_final
        self._items.append(item)
        self._num_put += 1
        if wake:
            self.wake()

    def is_due(self, interval: int) -> bool:
        """Whether the consumer should be woken now: the first item, the last, or
        `interval` items queued."""
        return self.is_done or self._num_put == 1 or len(self._items) >= interval

    def wake(self) -> None:
        """Lets a waiting consumer take what is queued."""
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def __aiter__(self) -> "RequestHandle":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._is_consumed:
            raise StopAsyncIteration
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        self._is_consumed = isinstance(item, GenerationError) or item.is_final
        if isinstance(item, GenerationError):
            raise item
        return item

    def take_ready(self) -> list[RequestOutput]:
        """The outputs queued already, without waiting, up to the final one or an
        error (an error stays queued: the next __anext__ raises it)."""
        taken = []
        while self._items and not self._is_consumed and not isinstance(self._items[0], GenerationError):
            taken.append(self._items.popleft())
            self._is_consumed = taken[-1].is_final
        return taken


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one: their tokens, text and log-probabilities in
    order (the first's prompt log-probabilities), the counts and finish of the last."""
    last = outputs[-1]
    assert all(o.index == last.index for o in outputs), "outputs of different samples (index) never merge"
    if len(outputs) == 1:
        return last
    return dataclasses.replace(last, token_ids=tuple(t for o in outputs for t in o.token_ids),
                               text="".join(o.text for o in outputs),
                               logprobs=tuple(lp for o in outputs for lp in o.logprobs),
                               prompt_logprobs=outputs[0].prompt_logprobs)
