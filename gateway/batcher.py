"""The continuous batcher: which sequences run on which rank in each step.

Pure scheduling (no gRPC, no asyncio): `schedule()` returns one `RankPlan` per
rank for the next step, `apply_results()` feeds a step's sampled tokens back.
Up to two steps may be in flight (the engine plans step k+1 while step k
runs); a sequence's state counts what the steps already sent will compute.

Each rank runs its own batch (data-parallel attention), so the limits are per
rank. Per step and rank, in this order:
1. Decodes: every running sequence past its prefill decodes one token (the
   rank feeds back the token it sampled), oldest first. max_running_requests
   <= max_batch_tokens, so decodes always fit the token budget.
2. Prefill chunks: sequences still prefilling get chunks, oldest first, while
   the step's prefill budget lasts (gateway/step_budget.py): all of
   max_batch_tokens when no interactive request decodes in the group, else
   what the TPOT target (and the decoding requests' slack against it) leaves
   beside the decodes, as the step-cost model (gateway/step_cost.py, its scale
   fit to the ranks' execute times in apply_results) prices it, but at least
   min_prefill_tokens; prefill_chunk_size, if set, caps one sequence's chunk.
3. Admission (admission.py): waiting requests in the policy's order start on
   the rank that fits them, reusing their longest cached prefix.
Priority classes: steps 2 and 3 run for interactive requests first, then for
batch ones with what is left of the budget, so a batch prompt never takes
prefill from an interactive one; batch decodes alone do not limit the budget.

`add()` refuses a request (step_budget.Overloaded: RESOURCE_EXHAUSTED with the
predicted wait and a retry hint) when its predicted time to first token is past
what its class may wait, and (GenerationError) when the waiting queue is full.

KV exhaustion: a sequence that needs a block when none is available (free or
evictable from the prefix cache) preempts the newest running sequence of its
rank not yet scheduled in this step, possibly itself: its blocks are freed
(full ones stay in the prefix cache), the rank forgets it, and it waits at the
front of the queue to be re-prefilled later from its checkpoint (prompt plus
generated tokens); no token reaches the client twice. A rank that preempted
admits nothing in that step. Only a sequence alone on its rank that still
does not fit fails (RESOURCE_EXHAUSTED): the request is larger than the pool.

A finished, aborted or expired sequence is sent in the next plan's
finished_seq_ids, and its blocks are released at that moment.

Jump-forward (gateway/jump_forward.py): where a constraint forces several tokens, a decode is
planned as one chunk of them, whose step's results append them before its sampled token.

Group failure: `detach_live()` hands every live sequence of a batcher whose
group failed, rewound to its checkpoint, to the batcher of the re-formed
group, which `resume()`s each like a preempted one: first in the queue, to
be re-prefilled (prompt plus generated tokens) and continue.
"""

import bisect
import collections
import heapq
import logging
import time
from collections.abc import Callable, Collection, Mapping

from gateway import admission, jump_forward
from gateway.kv_accounting import RankKV
from gateway.plan import RankPlan, SeqEvent, StepBatch
from gateway.policy import SchedulePolicy, make_policy
from gateway.prefix_cache import ROOT_HASH, extend_block_hashes
from gateway.requests import ErrorCode, GenerationError, Sequence, SeqStatus
from gateway.stats import GatewayStats
from gateway.step_budget import BudgetRule, DecodeProgress, Overloaded, StepBudget
from gateway.step_cost import StepCost, StepShape
from services.step import ScheduledSequence, TokenLogprob


log = logging.getLogger("gateway.batcher")
# The step-cost scale is logged when it has moved by this factor since it was last logged.
_SCALE_LOG_STEP = 1.1


def _arrival(seq: Sequence) -> int:
    return seq.seq_id


class Batcher:
    """Waiting and running sequences of one worker group, and its KV accounting."""

    def __init__(
        self,
        ranks: list[RankKV],
        *,
        max_running_requests: int,
        max_batch_tokens: int,
        max_context: int,
        eos_token_ids: Collection[int],
        prefill_chunk_size: int = 512,
        max_waiting_requests: int = 1024,
        tpot_target_ms: float = 0.0,
        ttft_target_ms: float = 0.0,
        min_prefill_tokens: int = 1024,
        policy: str | SchedulePolicy = "fcfs",
        stats: GatewayStats | None = None,
        clock: Callable[[], float] = time.monotonic,
        jump_forward: bool = False,
        jump_forward_min_tokens: int = 1,
    ) -> None:
        if not ranks:
            raise ValueError("a batcher needs at least one rank")
        if not 0 < max_running_requests <= max_batch_tokens:
            raise ValueError(f"need 0 < max_running_requests ({max_running_requests}) <= "
                             f"max_batch_tokens ({max_batch_tokens})")
        if prefill_chunk_size < 0 or max_waiting_requests <= 0:
            raise ValueError(f"prefill_chunk_size ({prefill_chunk_size}) must be >= 0 (0: no cap) and "
                             f"max_waiting_requests ({max_waiting_requests}) positive")
        self.ranks = ranks
        self.max_running_requests = max_running_requests
        self.max_batch_tokens = max_batch_tokens
        self.max_context = max_context
        self.budget_rule = BudgetRule(max_batch_tokens, tpot_target_ms, ttft_target_ms, min_prefill_tokens,
                                      prefill_chunk_size)
        self.cost = StepCost()
        self._logged_scale = self.cost.scale
        self.max_waiting_requests = max_waiting_requests
        self.eos_token_ids = frozenset(eos_token_ids)
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.jump_forward = jump_forward
        # A jump is taken only with at least this many forced tokens (the steps it saves).
        self.jump_forward_min_tokens = jump_forward_min_tokens
        self.stats = stats or GatewayStats()
        self._clock = clock
        # Per rank, oldest (lowest seq_id) first.
        self.running: list[list[Sequence]] = [[] for _ in ranks]
        # Waiting: preempted sequences (oldest first), then new ones in arrival order.
        self._preempted: list[Sequence] = []
        self._queued: dict[int, Sequence] = {}
        # Per rank: sequences to send in the next plan's finished_seq_ids.
        self._to_forget: list[list[Sequence]] = [[] for _ in ranks]
        # Steps sent and not applied, oldest first: (step_id, sampled sequences by id, jump-forward chunks).
        self._in_flight: collections.deque[tuple[int, dict[int, Sequence], dict]] = collections.deque()
        # Aborted or expired since the last schedule(): (sequence, error or None for an abort).
        self._aborted: list[tuple[Sequence, GenerationError | None]] = []
        self._deadlines: list[tuple[float, int, Sequence]] = []
        self._next_seq_id = 1
        self._next_step_id = 1
        # This schedule()'s work per rank (for the cost model) and prefill budgets.
        self._shapes: list[StepShape] = []
        self._budgets: list[StepBudget] = []
        # Steps in flight: their shapes per rank, to fit the cost model to their execute times,
        # and their predicted ms.
        self._step_shapes: dict[int, list[StepShape]] = {}
        self._step_ms: dict[int, float] = {}
        # True when the last step planned carried no prefill while prompts waited for it.
        self._prefill_held = False

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def waiting(self) -> list[Sequence]:
        """Sequences waiting for a rank, in the order fcfs admits them."""
        return [*self._preempted, *self._queued.values()]

    @property
    def num_waiting(self) -> int:
        return len(self._preempted) + len(self._queued)

    @property
    def has_work(self) -> bool:
        """True while a step is needed: something waits, runs, or must be forgotten."""
        return bool(self._queued or self._preempted or self._aborted) or any(self.running) \
            or any(self._to_forget)

    def new_seq_id(self) -> int:
        """A fresh sequence id, unique within this batcher's group."""
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        return seq_id

    def check_fits(self, num_prompt_tokens: int) -> None:
        """Raises GenerationError(INVALID_ARGUMENT) for a prompt no rank's KV pool can hold."""
        largest = max(self.ranks, key=lambda kv: kv.num_blocks)
        if largest.blocks_needed(num_prompt_tokens + 1) > largest.num_blocks:
            raise GenerationError(
                ErrorCode.INVALID_ARGUMENT,
                f"prompt has {num_prompt_tokens} tokens, more than the KV cache of a rank holds "
                f"({largest.num_blocks * largest.block_size - 1} tokens plus the first generated one)")

    def add(self, seq: Sequence) -> None:
        """Queues a new sequence; raises GenerationError if it can never run or the queue is full,
        step_budget.Overloaded if it would wait past what its priority class may (step_budget.py)."""
        assert seq.status is SeqStatus.WAITING and seq.rank is None
        self.check_fits(len(seq.prompt_ids))
        if self.num_waiting >= self.max_waiting_requests:
            self.stats.num_rejected_queue_full += 1
            raise GenerationError(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"the gateway's waiting queue is full ({self.num_waiting} requests wait, "
                f"max_waiting_requests {self.max_waiting_requests}); retry later")
        # A later sample reuses its leader's prompt: nothing of its own to wait for.
        if self.budget_rule.ttft_target_ms and seq.leader is None:
            is_batch = seq.request.is_batch
            try:
                self.budget_rule.check_admission(
                    self.cost, num_tokens_ahead=self.num_prefill_tokens_ahead(include_batch=is_batch),
                    num_prompt_tokens=seq.num_tokens, num_decodes=sum(map(len, self.running)) / self.num_ranks,
                    num_ranks=self.num_ranks, is_batch=is_batch)
            except Overloaded:
                self.stats.num_rejected_overload += 1
                raise
        self._queued[seq.seq_id] = seq
        self.stats.num_requests += 1
        if seq.deadline is not None:
            heapq.heappush(self._deadlines, (seq.deadline, seq.seq_id, seq))

    def step_shapes(self, step_id: int) -> list[StepShape]:
        """The work of each rank in a step in flight, as the step-cost model sees it."""
        return self._step_shapes[step_id]

    def num_prefill_tokens_ahead(self, *, include_batch: bool = True) -> int:
        """Prompt tokens still to prefill (waiting, and the rest of those prefilling) ahead of a new
        request: batch-priority ones only with include_batch (interactive ones overtake them)."""
        def counted(seq: Sequence) -> bool:
            return seq.leader is None and (include_batch or not seq.request.is_batch)

        waiting = sum(seq.num_tokens for seq in self._preempted) + sum(
            seq.num_tokens for seq in self._queued.values() if counted(seq))
        return waiting + sum(seq.num_tokens - seq.num_computed for seqs in self.running for seq in seqs
                             if not seq.is_prefilled and counted(seq))

    def abort(self, seq: Sequence, error: GenerationError | None = None) -> None:
        """Ends a sequence at the next schedule(), which frees its blocks; its last
        event is `error`, or an ABORT output if None."""
        if not seq.is_finished and not seq.is_aborted:
            seq.is_aborted = True
            self._aborted.append((seq, error))

    def schedule(self) -> StepBatch:
        """Plans the next step for every rank; step_id 0 if there is nothing to send."""
        assert len(self._in_flight) < 2, "schedule() with two steps in flight"
        batch = StepBatch(0, [RankPlan(r) for r in range(self.num_ranks)])
        self._expire_deadlines()
        self._drop_aborted(batch)
        step = admission.StepState(self.num_ranks)
        self._shapes = [StepShape() for _ in batch.plans]
        for plan in batch.plans:
            for seq in self._to_forget[plan.rank]:
                self._release(plan, seq)
            self._to_forget[plan.rank].clear()
            self._schedule_decodes(plan, step, batch)
        self._plan_budgets(batch, step)
        is_blocked = False
        for is_batch in (False, True):  # interactive prompts first, batch ones with what is left
            for plan in batch.plans:
                self._schedule_prefills(plan, step, batch, is_batch)
            # A batch request never overtakes an interactive one that fits nowhere yet.
            is_blocked = is_blocked or admission.admit(self, batch, step, is_batch)
        self._publish(step)
        if not batch.is_empty:
            batch.step_id = self._next_step_id
            self._next_step_id += 1
            self._in_flight.append((batch.step_id, step.sampled, step.jumps))
            self._step_shapes[batch.step_id] = self._shapes
            self._step_ms[batch.step_id] = max(self.cost.step_ms(shape) for shape in self._shapes)
        elif self.num_waiting and not self._in_flight and not any(self.running):
            # Unreachable while add() checks fits; keeps the loop from spinning on nothing.
            seq = self.waiting[0]
            self._remove_waiting(seq)
            seq.status = SeqStatus.FINISHED
            batch.events.append((seq, GenerationError(
                ErrorCode.RESOURCE_EXHAUSTED, "the request cannot be scheduled on any rank")))
        # The next step prefills whatever its allowance if this one held waiting prompts back.
        self._prefill_held = not any(shape.num_prefill_tokens for shape in self._shapes) and (
            bool(self.num_waiting) or any(not s.is_prefilled for seqs in self.running for s in seqs))
        return batch

    def apply_results(self, step_id: int, tokens: Mapping[int, int],
                      logprobs: Mapping[int, TokenLogprob] | None = None,
                      forced: Mapping[int, tuple[int, ...]] | None = None,
                      step_seconds: Collection[float] = ()) -> list[SeqEvent]:
        """Appends the oldest in-flight step's sampled tokens (seq_id -> token id, and seq_id ->
        its log-probability for those that asked), after the forced tokens of its jump-forward
        chunks, and returns the outputs; `forced`: the tokens constraints force after sampled
        ones (StepResult.forced); `step_seconds`: the ranks' execute times of the step
        (StepResult.execute_seconds), for the step-cost model. Raises ValueError if they do
        not answer that step's plan."""
        expected_step, sampled, jumps = self._in_flight.popleft() if self._in_flight else (None, {}, {})
        shapes = self._step_shapes.pop(expected_step, ())
        self._step_ms.pop(expected_step, None)
        if step_seconds and shapes:
            # The group steps together: its slowest rank's time is every rank's step.
            shape, measured_ms = max(shapes, key=self.cost.step_ms), 1e3 * max(step_seconds)
            self.stats.record_step_time(shape.num_prefill_tokens, measured_ms, [
                shape.num_prefill_tokens, shape.num_decodes, round(shape.pairs / shape.num_prefill_tokens),
                round(self.cost.step_ms(shape), 1), round(measured_ms, 1)] if shape.num_prefill_tokens else None)
            if self.cost.observe(shape, measured_ms):
                self.stats.step_cost_scale = round(self.cost.scale, 4)
                self.stats.step_floor_ms = round(self.cost.floor_ms, 2)
                self.stats.step_decode_scale = round(self.cost.decode_scale, 3)
                if max(self._logged_scale / self.cost.scale, self.cost.scale / self._logged_scale) >= _SCALE_LOG_STEP:
                    self._logged_scale = self.cost.scale
                    log.info("step-cost scale now %.3f (the ranks' prefill steps against the model's priors), "
                             "floor %.1f ms, decode scale %.2f", self.cost.scale, self.cost.floor_ms,
                             self.cost.decode_scale)
        now = self._clock()
        if step_id != expected_step:
            raise ValueError(f"results of step {step_id}, but the oldest step in flight is {expected_step}")
        if tokens.keys() != sampled.keys():
            missing = sorted(sampled.keys() - tokens.keys())
            extra = sorted(tokens.keys() - sampled.keys())
            raise ValueError(f"step results do not match the plan: missing {missing}, unexpected {extra}")
        events: list[SeqEvent] = []
        next_jumps = self._in_flight[0][2] if self._in_flight else {}
        for seq_id, token_id in tokens.items():
            seq = sampled[seq_id]
            jumped = jumps[seq_id][1] if jumps and seq_id in jumps else ()
            seq.num_in_flight -= 1 + len(jumped)
            if seq.is_aborted or seq.is_finished:
                continue  # a slot planned before the sequence ended: the token is dropped
            if next_jumps and seq_id in next_jumps and next_jumps[seq_id][0] != token_id:
                raise ValueError(f"sequence {seq_id} sampled {token_id}, but its jump-forward chunk in flight "
                                 f"feeds {next_jumps[seq_id][0]}")
            if jumped:  # the chunk's forced tokens come first, each an output of its own
                self.stats.num_jump_forward_tokens += len(jumped)
                if not self._append_forced(seq, jumped, events):
                    continue
            output = seq.append_token(token_id, self.eos_token_ids, self.max_context,
                                      logprobs.get(seq_id) if logprobs else None)
            if seq.first_token_at is None:
                seq.first_token_at = now
            seq.last_token_at = now
            if output.is_final:
                self._finish(seq)
            events.append((seq, output))
            if forced and not seq.is_finished and seq_id in forced and self.jump_forward:
                jump_forward.note(seq, token_id, forced[seq_id], self._in_flight[0][1:] if self._in_flight else None)
        return events

    def _append_forced(self, seq: Sequence, token_ids: tuple[int, ...], events: list[SeqEvent]) -> bool:
        """Appends a jump-forward chunk's forced tokens; False if one of them ended the request."""
        for token_id in token_ids:
            output = seq.append_token(token_id, self.eos_token_ids, self.max_context)
            events.append((seq, output))
            if output.is_final:
                self._finish(seq)
                return False
        return True

    def fail_all(self, error: GenerationError) -> list[SeqEvent]:
        """Fails every waiting and running sequence (the group is gone); the
        batcher is unusable afterwards."""
        seqs = [*self.waiting, *(s for rank in self.running for s in rank)]
        self._preempted.clear()
        self._queued.clear()
        self._aborted.clear()
        self._in_flight.clear()
        self._step_shapes.clear()
        self._step_ms.clear()
        for rank in (*self.running, *self._to_forget):
            rank.clear()
        for seq in seqs:
            seq.status = SeqStatus.FINISHED
        return [(seq, error) for seq in seqs]

    def detach_live(self) -> tuple[list[Sequence], list[SeqEvent]]:
        """Takes every live sequence out (the group failed; the batcher is unusable
        afterwards): the waiting and running ones, oldest first, rewound to their
        checkpoints for resume(), and the events of those aborted meanwhile."""
        events: list[SeqEvent] = []
        for seq, error in self._aborted:
            if not seq.is_finished:
                seq.status = SeqStatus.FINISHED
                events.append((seq, error or seq.abort_output()))
        self._aborted.clear()
        seqs = sorted((s for s in [*self.waiting, *(s for rank in self.running for s in rank)]
                       if not s.is_finished), key=_arrival)
        self.fail_all(GenerationError(ErrorCode.UNAVAILABLE, "detached"))
        for seq in seqs:
            seq.rewind()
        return seqs, events

    def resume(self, seq: Sequence) -> None:
        """Queues a sequence detached from a failed group's batcher (its seq_id
        is this batcher's): it waits first in line to be re-prefilled from its
        checkpoint, whatever the bound on waiting requests."""
        assert seq.status is SeqStatus.WAITING and seq.rank is None and not seq.num_computed
        bisect.insort(self._preempted, seq, key=_arrival)
        if seq.deadline is not None:
            heapq.heappush(self._deadlines, (seq.deadline, seq.seq_id, seq))

    # Internals: sequence state changes.

    def can_sample(self, seq: Sequence) -> bool:
        """True if one more sampled token stays within max_new_tokens and the context."""
        return (len(seq.output_ids) + seq.num_in_flight < seq.request.max_new_tokens
                and seq.num_tokens + seq.num_in_flight < self.max_context)

    def schedule_seq(self, plan: RankPlan, step: "admission.StepState", seq: Sequence, num_tokens: int) -> None:
        """Adds num_tokens prompt tokens of seq (0: a decode) to the plan; its KV counts
        as computed from here on. The caller made room for its blocks."""
        kv = self.ranks[plan.rank]
        start = seq.num_computed
        num_after = start + max(1, num_tokens)
        new_block_ids = kv.grow(seq.seq_id, num_after)
        is_sampled = not num_tokens or num_after == seq.num_tokens
        token_ids = tuple(seq.token_ids[start:num_after]) if num_tokens else ()
        plan.scheduled.append(ScheduledSequence(seq.seq_id, token_ids, tuple(new_block_ids), is_sampled))
        plan.num_tokens += max(1, num_tokens)
        if num_tokens:
            self._shapes[plan.rank].add_chunk(start, num_tokens)
            self._budgets[plan.rank].take(self.cost, start, num_tokens)
        else:
            self._shapes[plan.rank].num_decodes += 1
        seq.num_computed = num_after
        step.scheduled.append(seq)
        step.scheduled_ids.add(seq.seq_id)
        if num_tokens and kv.cache is not None:
            # Full blocks this chunk writes, and the tokens of the block it ends in: admission defers
            # requests waiting for them.
            bs = kv.block_size
            last = min(-(-num_after // bs), seq.num_tokens // bs)
            extend_block_hashes(seq.block_hashes, seq.token_ids, bs, last)
            step.computing[plan.rank].update(seq.block_hashes[start // bs:last])
            end = (num_after - 1) // bs
            parent = seq.block_hashes[end - 1] if end else ROOT_HASH
            step.chunk_ends[plan.rank].setdefault(parent, []).append(tuple(seq.token_ids[end * bs:num_after]))
            step.prefilled.append(seq)
        if is_sampled:
            seq.is_prefilled = True
            seq.num_in_flight += 1
            step.sampled[seq.seq_id] = seq

    def start(self, plan: RankPlan, seq: Sequence) -> None:
        """Moves a waiting sequence to the running list of the plan's rank."""
        self._remove_waiting(seq)
        seq.rank = plan.rank
        seq.status = SeqStatus.RUNNING
        bisect.insort(self.running[plan.rank], seq, key=_arrival)

    def _release(self, plan: RankPlan, seq: Sequence) -> None:
        """Caches the sequence's full blocks and its last partly filled one, frees the rest, tells
        the rank to forget it."""
        kv = self.ranks[plan.rank]
        num_computed = min(seq.num_computed, seq.num_tokens)
        kv.publish(seq.seq_id, seq.token_ids, seq.block_hashes, num_computed)
        kv.keep_tail(seq.seq_id, seq.token_ids, num_computed)
        kv.release(seq.seq_id)
        plan.finished_seq_ids.append(seq.seq_id)

    def _retire(self, seq: Sequence) -> None:
        """Moves a running sequence to its rank's forget list."""
        self.running[seq.rank].remove(seq)
        seq.status = SeqStatus.FINISHED
        self._to_forget[seq.rank].append(seq)

    def _finish(self, seq: Sequence) -> None:
        if seq.status is SeqStatus.RUNNING:
            self._retire(seq)
        else:  # preempted with its last token in flight: the rank forgot it already
            self._remove_waiting(seq)
            seq.status = SeqStatus.FINISHED

    def _remove_waiting(self, seq: Sequence) -> None:
        if self._queued.pop(seq.seq_id, None) is None:
            self._preempted.remove(seq)

    def _preempt(self, plan: RankPlan, step: "admission.StepState", seq: Sequence) -> None:
        self._release(plan, seq)
        self.running[plan.rank].remove(seq)
        seq.status = SeqStatus.WAITING
        seq.rank = None
        seq.num_computed = 0
        seq.is_prefilled = False
        seq.jump = None
        seq.num_preemptions += 1
        bisect.insort(self._preempted, seq, key=_arrival)
        self.stats.num_preemptions += 1
        step.is_preempting[plan.rank] = True

    def _fail(self, plan: RankPlan, batch: StepBatch, seq: Sequence) -> None:
        kv = self.ranks[plan.rank]
        self._release(plan, seq)
        self.running[plan.rank].remove(seq)
        seq.status = SeqStatus.FINISHED
        batch.events.append((seq, GenerationError(
            ErrorCode.RESOURCE_EXHAUSTED,
            f"the request alone needs more than the KV cache of rank {plan.rank} holds "
            f"({kv.num_blocks} blocks of {kv.block_size} tokens) after {seq.num_tokens} tokens")))

    def _expire_deadlines(self) -> None:
        num_live = self.num_waiting + sum(len(seqs) for seqs in self.running)
        if len(self._deadlines) > 64 + 2 * num_live:
            # Most entries belong to finished requests: drop them rather than hold their tokens.
            self._deadlines = [entry for entry in self._deadlines if not entry[2].is_finished]
            heapq.heapify(self._deadlines)
        now = self._clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, seq = heapq.heappop(self._deadlines)
            if not seq.is_finished and not seq.is_aborted:
                self.stats.num_deadline_exceeded += 1
                self.abort(seq, GenerationError(
                    ErrorCode.DEADLINE_EXCEEDED,
                    f"the request's deadline passed after {len(seq.output_ids)} generated tokens"))

    def _drop_aborted(self, batch: StepBatch) -> None:
        for seq, error in self._aborted:
            if seq.status is SeqStatus.WAITING:
                self._remove_waiting(seq)
                seq.status = SeqStatus.FINISHED
            elif seq.status is SeqStatus.RUNNING:
                self._retire(seq)
            else:
                continue  # finished meanwhile (its last token, or failed)
            if error is None:
                self.stats.num_aborted += 1
            batch.events.append((seq, error or seq.abort_output()))
        self._aborted.clear()

    # Internals: the running sequences of one rank.

    def _schedule_decodes(self, plan: RankPlan, step: "admission.StepState", batch: StepBatch) -> None:
        seqs = self.running[plan.rank]
        i = 0
        while i < len(seqs):
            seq = seqs[i]
            jump, seq.jump = seq.jump, None
            if seq.is_prefilled and self.can_sample(seq):
                # A jump's chunk leaves room in the step for the rank's decodes still to plan.
                num_forced = jump_forward.chunk_length(
                    seq, jump[1], max_context=self.max_context,
                    token_budget=self.max_batch_tokens - plan.num_tokens - (len(seqs) - i - 1)) if jump else 0
                if num_forced < self.jump_forward_min_tokens:
                    num_forced = 0   # a plain decode: the rank still emits the next forced token
                if not self._make_room(plan, step, batch, seq, seq.num_computed + 1 + num_forced):
                    continue  # seq left the list: seqs[i] is the next one
                if num_forced:
                    jump_forward.schedule(plan, step, self.ranks[plan.rank], seq, jump[0], jump[1][:num_forced])
                else:
                    self.schedule_seq(plan, step, seq, 0)
            i += 1

    def _plan_budgets(self, batch: StepBatch, step: "admission.StepState") -> None:
        """Each rank's prefill budget, once every rank's decodes are planned: only interactive
        decodes limit it (batch traffic never holds an interactive prompt back)."""
        interactive = [seq for seq in step.scheduled if not seq.request.is_batch]
        decodes = [len(plan.scheduled) if interactive else 0 for plan in batch.plans]
        allowance_ms = None
        if interactive:
            progress = []
            for seq in interactive:
                in_flight = seq.num_in_flight - 1   # this step's token counts already
                remaining = seq.request.max_new_tokens - len(seq.output_ids) - seq.num_in_flight
                if seq.first_token_at is None:
                    progress.append(DecodeProgress(0, 0.0, remaining, has_first_token=False))
                else:
                    progress.append(DecodeProgress(len(seq.output_ids) - 1,
                                                   1e3 * (seq.last_token_at - seq.first_token_at),
                                                   remaining, in_flight))
            in_flight_ms = self._step_ms.get(self._in_flight[-1][0], 0.0) if self._in_flight else 0.0
            allowance_ms = self.budget_rule.allowance_ms(
                progress, decode_step_ms=self.cost.decode_step_ms(max(decodes)), in_flight_ms=in_flight_ms)
        self._budgets = self.budget_rule.plan_budgets(self.cost, decodes, [p.num_tokens for p in batch.plans],
                                                      allowance_ms=allowance_ms, is_forced=self._prefill_held)

    def prefill_chunk(self, rank: int, start: int, num_remaining: int) -> int:
        """The prompt tokens from position start (num_remaining left) that rank's step may
        still prefill: its prefill budget; 0 if none."""
        return self._budgets[rank].chunk(self.cost, start, num_remaining)

    def has_prefill_budget(self, rank: int) -> bool:
        """True while rank's step may take more prefill."""
        return not self._budgets[rank].is_spent

    def _schedule_prefills(self, plan: RankPlan, step: "admission.StepState", batch: StepBatch,
                           is_batch: bool) -> None:
        kv = self.ranks[plan.rank]
        for seq in list(self.running[plan.rank]):
            if not self.has_prefill_budget(plan.rank):
                break
            if seq.is_prefilled or seq.status is not SeqStatus.RUNNING or seq.request.is_batch != is_batch:
                continue
            num_tokens = self.prefill_chunk(plan.rank, seq.num_computed, seq.num_tokens - seq.num_computed)
            if not num_tokens:
                break  # the budget's time is spent: a chunk deeper into a prompt costs more
            # Leave a few blocks for the decodes of the next steps, so a chunk does not
            # force their preemption right away.
            reserve = admission.watermark(kv) if len(self.running[plan.rank]) > 1 else 0
            num_fitting = kv.capacity(seq.seq_id, reserve) - seq.num_computed
            if num_fitting < 1:
                if not self._make_room(plan, step, batch, seq, seq.num_computed + 1):
                    continue
                num_fitting = kv.capacity(seq.seq_id, 0) - seq.num_computed
            self.schedule_seq(plan, step, seq, min(num_tokens, num_fitting))

    def _make_room(self, plan: RankPlan, step: "admission.StepState", batch: StepBatch,
                   seq: Sequence, num_tokens: int) -> bool:
        """Preempts the newest unscheduled sequences of the rank until seq's table can
        cover num_tokens; False if seq itself had to go (preempted, or failed if alone)."""
        kv = self.ranks[plan.rank]
        seqs = self.running[plan.rank]
        while not kv.can_grow(seq.seq_id, num_tokens):
            victim = next(s for s in reversed(seqs) if s.seq_id not in step.scheduled_ids)
            if victim is not seq:
                self._preempt(plan, step, victim)
            elif len(seqs) > 1:
                self._preempt(plan, step, seq)
                return False
            else:
                self._fail(plan, batch, seq)
                return False
        return True

    def _publish(self, step: "admission.StepState") -> None:
        """Caches the full blocks the step's sequences have computed and shares the partly filled
        block of those that prefilled (once the step is sent)."""
        for seq in step.scheduled:
            kv = self.ranks[seq.rank]
            if kv.cache is not None:
                kv.publish(seq.seq_id, seq.token_ids, seq.block_hashes, min(seq.num_computed, seq.num_tokens))
        for seq in step.prefilled:
            if seq.status is SeqStatus.RUNNING and (kv := self.ranks[seq.rank]).cache is not None:
                kv.share_tail(seq.seq_id, seq.token_ids, min(seq.num_computed, seq.num_tokens))
