"""The step loop of one worker group: schedule, execute on every rank, apply.

`Engine` owns the batcher of its group and one ExecuteSteps stream per rank
(gateway/rank_client.py holds the wire: the engine sends StepPlans and reads
StepResults; the tests use in-process fakes). Each step
sends one plan to every rank (idle plans included, so that the ranks'
collectives line up), reads all their results, feeds the sampled tokens to
the batcher and pushes the outputs to the requests' handles.

Overlap (on by default): the plan of step k+1 is made and sent before the
results of step k are read, so the ranks find the next plan waiting when they
finish a step and the gateway's host work hides behind the ranks' compute.
This is safe because a rank runs its plans in order and feeds back its own
sampled tokens; the price is that a sequence ending in step k (EOS or a stop
string) occupies one wasted slot in step k+1. Once the results of step k are
applied, the plan of step k+2 is written before their outputs are delivered,
and the streams the outputs wake are woken _WAKE_BATCH per event-loop turn:
each stream's gRPC write runs on this event loop too (tens of microseconds),
and hundreds of them at once would hold the next plan, and the reading of the
next results, back while the ranks idle. A stream that falls behind then
finds several outputs queued and sends them as one message (servicer.py), so
under load the gateway spends less per token instead of slowing the steps.
The host time of each step (planning, applying results) is recorded in
GatewayStats.

A broken stream (the first rank that fails is enough: the others are not
waited for), a late or malformed result, or a step that exceeds
step_timeout_s ends the loop with GroupFailure, but fails no request: each
one keeps its checkpoint (prompt plus the ids already streamed) and waits.
The GroupManager then builds an engine on the re-formed group, which
`adopt`s every live request of the failed one: each is re-prefilled from its
checkpoint (chunked like any prompt) and goes on with the rest of its budget,
its detokenizer and stop-string state intact; no token reaches its client
twice. Requests submitted to the failed engine meanwhile wait in its bounded
queue and move too.
"""

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Sequence as Seq

from gateway.batcher import Batcher
from gateway.observability import EngineObserver
from gateway.plan import SeqEvent, StepBatch
from gateway.requests import ErrorCode, GenerationError, RequestHandle, Sequence
from gateway.rank_client import RankStream, StepStream, StreamClosed
from services.step import StepPlan, StepResult, TokenLogprob

log = logging.getLogger("gateway.engine")

_RETRY_PLAN_S = 0.05
# Request streams woken per event-loop turn: the step loop's reads of rank
# results wait behind at most this many streams' gRPC writes.
_WAKE_BATCH = 32


class GroupFailure(Exception):
    """The worker group can no longer execute steps."""


class Engine:
    """Runs the steps of one worker group for every request submitted to it."""

    def __init__(
        self,
        batcher: Batcher,
        rank_streams: Seq[RankStream],
        *,
        make_detokenizer: Callable[[], object],
        group_id: str = "",
        placement_epoch: int = 0,
        step_timeout_s: float = 120.0,
        overlap: bool = True,
        observer: "EngineObserver | None" = None,
        stream_interval: int = 1,
    ) -> None:
        if len(rank_streams) != batcher.num_ranks:
            raise ValueError(f"{len(rank_streams)} rank streams for {batcher.num_ranks} ranks")
        self.batcher = batcher
        self.stats = batcher.stats
        self.group_id = group_id
        self.placement_epoch = placement_epoch
        # The expert placement the ranks run (gateway/placement_watch.py sets it once all staged it).
        self.expert_placement_epoch = 0
        self._streams = [StepStream(call) for call in rank_streams]
        self._make_detokenizer = make_detokenizer
        self._step_timeout_s = step_timeout_s
        # Steps on the wire at once: 2 plans step k+1 while step k runs.
        self._max_in_flight = 2 if overlap else 1
        self._handles: dict[int, RequestHandle] = {}
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        # Set once the engine takes no new requests: why, as the error submit() raises.
        self._closed: GenerationError | None = None
        self.num_steps = 0
        # Once adopt()ed by the engine of a re-formed group: where this one's requests went.
        self._moved_to: Engine | None = None
        # Metrics and traces of steps and requests (gateway/observability.py); None in unit tests.
        self._observer = observer
        # Handles given outputs by the step loop whose streams are still to be woken
        # (each once, in order), and their id()s.
        self._to_wake: collections.deque[RequestHandle] = collections.deque()
        self._to_wake_ids: set[int] = set()
        self._has_to_wake = asyncio.Event()
        # A decoding stream is woken once this many of its outputs are queued (GatewayConfig).
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be positive, got {stream_interval}")
        self._stream_interval = stream_interval

    @property
    def num_active(self) -> int:
        """Requests submitted and not yet finished."""
        return len(self._handles)

    def submit(self, request, deadline: float | None = None, *, leader: RequestHandle | None = None) -> RequestHandle:
        """Queues a validated request (deadline: time.monotonic() by which it must be
        done, or None); raises GenerationError if it cannot run here. `leader`: the
        request's first sample, for a later one (Sequence.leader)."""
        if self._closed is not None:
            raise self._closed
        seq = Sequence(self.batcher.new_seq_id(), request, self._make_detokenizer(), deadline=deadline,
                       leader=None if leader is None else leader.seq)
        self.batcher.add(seq)
        handle = RequestHandle(seq)
        self._handles[seq.seq_id] = handle
        if self._observer is not None:
            self._observer.on_submit(seq)
        self._idle.clear()
        self._wake.set()
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Aborts a request (its client went away); its blocks are freed at the next step.
        A request that moved to another engine (see adopt) is aborted there."""
        engine = self
        while engine._moved_to is not None:
            engine = engine._moved_to
        if not handle.is_done:
            engine.batcher.abort(handle.seq)
            engine._wake.set()

    def adopt(self, failed: "Engine") -> int:
        """Takes over every live request of a failed engine (this one is new and
        has run no step): each is resumed from its checkpoint, oldest first,
        ahead of anything submitted here. Returns how many were taken."""
        seqs, events = failed.batcher.detach_live()
        failed._deliver(events)
        failed._closed = GenerationError(ErrorCode.UNAVAILABLE, "the worker group was re-formed")
        failed._moved_to = self
        for seq in seqs:
            handle = failed._handles.pop(seq.seq_id, None)
            if handle is None:  # never expected: nobody would read its outputs
                continue
            seq.seq_id = self.batcher.new_seq_id()
            self.batcher.resume(seq)
            self._handles[seq.seq_id] = handle
        failed._handles.clear()
        failed._idle.set()
        if seqs:
            self._idle.clear()
            self._wake.set()
        return len(seqs)

    def stop_accepting(self, message: str = "the gateway is shutting down") -> None:
        """New submits fail with UNAVAILABLE; requests in flight run to completion."""
        if self._closed is None:
            self._closed = GenerationError(ErrorCode.UNAVAILABLE, message)

    async def wait_idle(self) -> None:
        """Returns once no request is in flight."""
        await self._idle.wait()

    def fail_all(self, message: str) -> None:
        """Fails every request in flight with UNAVAILABLE and takes no more."""
        error = GenerationError(ErrorCode.UNAVAILABLE, message)
        self._closed = error
        self._deliver(self.batcher.fail_all(error))
        for handle in self._handles.values():
            handle.put(error)
        self._handles.clear()
        self._idle.set()

    async def run(self) -> None:
        """The step loop; runs until cancelled, or raises GroupFailure (the
        requests in flight stay, for adopt())."""
        in_flight: collections.deque[tuple[StepBatch, list]] = collections.deque()
        waker = asyncio.create_task(self._wake_streams())
        try:
            while True:
                if len(in_flight) < self._max_in_flight and self.batcher.has_work:
                    if await self._plan_and_send(in_flight, []):
                        continue
                if in_flight:
                    events = await self._receive(in_flight.popleft())
                    # The next plan is written before these outputs wake their streams
                    # (hundreds of them at high concurrency): the ranks get it while they
                    # still run the step in flight, and the streams run meanwhile.
                    if len(in_flight) < self._max_in_flight and self.batcher.has_work:
                        await self._plan_and_send(in_flight, events)
                    else:
                        self._deliver(events, is_paced=True)
                    continue
                self._wake.clear()
                # Work that could not be planned (never expected) is looked at again soon.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_RETRY_PLAN_S if self.batcher.has_work else None):
                        await self._wake.wait()
        except GroupFailure as failure:
            log.error("worker group %s epoch %d failed: %s; %d requests wait to resume", self.group_id,
                      self.placement_epoch, failure, len(self._handles))
            raise
        except Exception:
            # A bug: no request may hang on it.
            log.exception("step loop of worker group %s crashed", self.group_id)
            self.fail_all(f"the gateway's step loop for group {self.group_id!r} crashed")
            raise
        finally:
            waker.cancel()
            self._wake_now()

    async def _plan_and_send(self, in_flight: collections.deque, events: list[SeqEvent]) -> bool:
        """Plans the next step and writes it to every rank; False if there was nothing
        to send. `events` (the outputs of the step just applied), then the
        scheduler's, are delivered once the writes are queued."""
        batch, plans = self._plan()
        events = [*events, *batch.events]
        if batch.is_empty:
            self._deliver(events, is_paced=True)
            return False
        writes = self._start_on_every_rank(lambda stream, i: stream.send(plans[i]))
        in_flight.append((batch, plans))
        # The writes' tasks were queued first: they run before any stream woken here.
        self._deliver(events, is_paced=True)
        await self._wait_every_rank(writes, "write its plan")
        return True

    def _plan(self) -> tuple[StepBatch, list[StepPlan]]:
        """Schedules the next step: the batch and its plan per rank (none if it is empty)."""
        start = time.perf_counter()
        batch = self.batcher.schedule()
        if batch.is_empty:
            return batch, []
        if self._observer is not None:  # may stamp traceparents on the new sequences
            self._observer.on_step_planned(batch)
        plans = [p.to_step_plan(batch.step_id, self.group_id, self.placement_epoch,
                                max_tokens_per_rank=batch.max_tokens_per_rank,
                                expert_placement_epoch=self.expert_placement_epoch)
                 for p in batch.plans]
        self.stats.record_step(sum(p.num_tokens for p in batch.plans), time.perf_counter() - start)
        return batch, plans

    async def _receive(self, planned: tuple[StepBatch, list[StepPlan]]) -> list[SeqEvent]:
        """Reads one result per rank for the step and applies them: the outputs, to deliver."""
        batch, _ = planned
        read = self._observer.read if self._observer is not None else (lambda stream, i: stream.receive())
        results: list[StepResult] = await self._wait_every_rank(self._start_on_every_rank(read), "answer")
        start = time.perf_counter()
        tokens: dict[int, int] = {}
        logprobs: dict[int, TokenLogprob] = {}
        forced: dict[int, tuple[int, ...]] = {}
        for rank, result in enumerate(results):
            if result.step_id != batch.step_id:
                raise GroupFailure(f"rank {rank} answered step {result.step_id}, expected {batch.step_id}")
            tokens.update(result.tokens)
            if result.logprobs:
                self._route_logprobs(result.logprobs, tokens, logprobs)
            forced.update(result.forced)
        try:
            events = self.batcher.apply_results(batch.step_id, tokens, logprobs, forced,
                                                step_seconds=[r.execute_seconds for r in results])
        except ValueError as error:
            raise GroupFailure(str(error)) from error
        self.num_steps += 1
        self.stats.apply_s.append(time.perf_counter() - start)
        if self._observer is not None:
            self._observer.on_step_done(batch, results)
        return events

    def _route_logprobs(self, scored, tokens: dict[int, int], sampled: dict[int, TokenLogprob]) -> None:
        """Hands a result's prompt log-probabilities to their sequences; a sampled token's
        (at the position past the sequence's tokens) goes into `sampled`, for apply_results."""
        for seq_id, position, logprob in scored:
            handle = self._handles.get(seq_id)
            if handle is None:
                continue  # finished meanwhile
            if seq_id in tokens and position >= handle.seq.num_tokens:
                sampled[seq_id] = logprob
            else:
                handle.seq.add_prompt_logprob(position, logprob)

    def _start_on_every_rank(self, call) -> list[asyncio.Future]:
        """call(stream, rank) on every rank at once, as tasks (queued now, in rank order)."""
        return [asyncio.ensure_future(call(s, i)) for i, s in enumerate(self._streams)]

    async def _wait_every_rank(self, tasks: list[asyncio.Future], what: str) -> list:
        """The tasks' results within step_timeout_s; GroupFailure naming the first
        rank that failed, as soon as one has (a hung rank must not keep the
        failure of another one waiting)."""
        try:
            async with asyncio.timeout(self._step_timeout_s):
                pending = set(tasks)
                while pending:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                    for task in done:
                        if task.exception() is not None:
                            await self._raise_failure(tasks.index(task), task.exception())
        except TimeoutError as error:
            raise GroupFailure(f"a rank did not {what} within {self._step_timeout_s} s") from error
        finally:
            for task in tasks:
                task.cancel()
        return [task.result() for task in tasks]

    async def _raise_failure(self, rank: int, error: BaseException) -> None:
        if not isinstance(error, Exception):
            raise error
        if isinstance(error, StreamClosed):
            raise GroupFailure(f"rank {rank} {error}") from error
        reason = await self._streams[rank].failure_reason(error)
        raise GroupFailure(f"rank {rank} step stream broke: {reason}") from error

    def _deliver(self, events: list[SeqEvent], *, is_paced: bool = False) -> None:
        """Hands the events to their requests' handles. Paced (the step loop's
        outputs): the streams are woken _WAKE_BATCH per event-loop turn by
        _wake_streams, so the next results of the ranks are read and the next
        plan sent without waiting for hundreds of streams; a stream woken late
        finds several outputs queued and sends them as one message. A stream
        is woken for its first output, its last, or once stream_interval of
        its outputs are queued."""
        for seq, item in events:
            handle = self._handles.get(seq.seq_id)
            if handle is None:
                continue
            handle.put(item, wake=not is_paced)
            if is_paced and id(handle) not in self._to_wake_ids and handle.is_due(self._stream_interval):
                self._to_wake_ids.add(id(handle))
                self._to_wake.append(handle)
            if handle.is_done:
                del self._handles[seq.seq_id]
        if self._to_wake:
            self._has_to_wake.set()
        if not self._handles:
            self._idle.set()

    async def _wake_streams(self) -> None:
        """Wakes the streams of the step loop's outputs, _WAKE_BATCH per event-loop turn."""
        while True:
            await self._has_to_wake.wait()
            self._has_to_wake.clear()
            while self._to_wake:
                for _ in range(min(_WAKE_BATCH, len(self._to_wake))):
                    self._wake_next()
                await asyncio.sleep(0)

    def _wake_now(self) -> None:
        """Wakes every stream still to be woken (the step loop ended)."""
        while self._to_wake:
            self._wake_next()

    def _wake_next(self) -> None:
        handle = self._to_wake.popleft()
        self._to_wake_ids.discard(id(handle))
        handle.wake()
