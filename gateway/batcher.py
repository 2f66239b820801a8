"""The continuous batcher: which sequences run on which rank in each step.

Pure scheduling (no gRPC, no asyncio): `schedule()` returns one `RankPlan`
per rank for the next step, `apply_results()` feeds the sampled tokens back.

Policy of the walking skeleton:
- Admission is first come, first served: the head of the waiting queue is
  admitted while some rank has room for it (fewer than max_running_requests
  running, max_batch_tokens not used up this step, free KV blocks for the
  prompt plus the first generated token); otherwise everyone behind it waits
  too, so a long prompt is never starved by short ones.
- Both limits are per rank: each rank runs its own batch (data-parallel
  attention), and the step's buffers on a rank are sized by its tokens.
- Placement: the rank with the fewest running tokens, then the most free blocks.
- Every running sequence decodes one token per step (decodes are scheduled
  before admissions, and max_running_requests <= max_batch_tokens, so they
  always fit the budget). A sequence whose rank has no free block for its next
  token sits the step out; if no running sequence of a rank can move, the
  newest one is failed with RESOURCE_EXHAUSTED so the others continue
  (preemption by recompute will replace this).
- The whole prompt is prefilled in one step; the plan's fields (token_ids,
  is_sampled) already carry chunks, for chunked prefill later.
- A finished or aborted sequence is sent in the next plan's
  finished_seq_ids, and its blocks are freed at that moment.
"""

import collections
import dataclasses
from collections.abc import Collection, Mapping

from gateway.kv_accounting import BlockAllocator
from gateway.requests import ErrorCode, GenerationError, RequestOutput, Sequence, SeqStatus


@dataclasses.dataclass(frozen=True, slots=True)
class NewSequencePlan:
    """A sequence a rank sees for the first time, in full."""

    seq_id: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    block_ids: tuple[int, ...]
    num_cached_tokens: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class ScheduledSequencePlan:
    """One sequence's work in a step: new input tokens ([] = decode) and appended blocks."""

    seq_id: int
    token_ids: tuple[int, ...]
    new_block_ids: tuple[int, ...]
    is_sampled: bool


@dataclasses.dataclass(slots=True)
class RankPlan:
    """One rank's step: diffs against the rank's state. Empty = an idle step."""

    rank: int
    new_sequences: list[NewSequencePlan] = dataclasses.field(default_factory=list)
    scheduled: list[ScheduledSequencePlan] = dataclasses.field(default_factory=list)
    finished_seq_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Input tokens of the step (a decode counts one)."""
        return sum(max(1, len(s.token_ids)) for s in self.scheduled)


# What a step produced for one request: an output or the error that failed it.
SeqEvent = tuple[Sequence, RequestOutput | GenerationError]


@dataclasses.dataclass(slots=True)
class StepBatch:
    """The plans of one step, one per rank, and the events scheduling produced
    (aborted requests' final outputs, requests failed for lack of KV blocks)."""

    step_id: int
    plans: list[RankPlan]
    events: list[SeqEvent] = dataclasses.field(default_factory=list)

    @property
    def num_sampled(self) -> int:
        return sum(s.is_sampled for p in self.plans for s in p.scheduled)


class Batcher:
    """Waiting and running sequences of one worker group, and its KV accounting."""

    def __init__(
        self,
        allocators: list[BlockAllocator],
        *,
        max_running_requests: int,
        max_batch_tokens: int,
        max_context: int,
        eos_token_ids: Collection[int],
    ) -> None:
        if not allocators:
            raise ValueError("a batcher needs at least one rank")
        if not 0 < max_running_requests <= max_batch_tokens:
            raise ValueError(
                f"need 0 < max_running_requests ({max_running_requests}) <= "
                f"max_batch_tokens ({max_batch_tokens})")
        self.allocators = allocators
        self.max_running_requests = max_running_requests
        self.max_batch_tokens = max_batch_tokens
        self.max_context = max_context
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[list[Sequence]] = [[] for _ in allocators]
        # Per rank: sequences to send in the next plan's finished_seq_ids.
        self._to_forget: list[list[Sequence]] = [[] for _ in allocators]
        # Sequences sampled in the step in flight, by id.
        self._in_flight: dict[int, Sequence] = {}
        # Aborted since the last schedule(), waiting or running.
        self._aborted: list[Sequence] = []
        self._next_seq_id = 1
        self._next_step_id = 1

    @property
    def num_ranks(self) -> int:
        return len(self.allocators)

    def new_seq_id(self) -> int:
        """A fresh sequence id, unique within this batcher's group."""
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        return seq_id

    def check_fits(self, num_prompt_tokens: int) -> None:
        """Raises GenerationError(INVALID_ARGUMENT) for a prompt no step could ever admit."""
        if num_prompt_tokens > self.max_batch_tokens:
            raise GenerationError(
                ErrorCode.INVALID_ARGUMENT,
                f"prompt has {num_prompt_tokens} tokens, more than the gateway's "
                f"max_batch_tokens {self.max_batch_tokens}")
        largest = max(self.allocators, key=lambda a: a.num_blocks)
        if largest.blocks_needed(num_prompt_tokens + 1) > largest.num_blocks:
            capacity = largest.num_blocks * largest.block_size - 1
            raise GenerationError(
                ErrorCode.INVALID_ARGUMENT,
                f"prompt has {num_prompt_tokens} tokens, more than the KV cache of a rank holds "
                f"({capacity} tokens plus the first generated one)")

    def add(self, seq: Sequence) -> None:
        """Queues a new sequence; raises GenerationError if it can never be admitted."""
        assert seq.status is SeqStatus.WAITING and seq.rank is None
        self.check_fits(len(seq.prompt_ids))
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        """Marks a sequence aborted; the next schedule() drops it and frees its blocks."""
        if not seq.is_finished and not seq.is_aborted:
            seq.is_aborted = True
            self._aborted.append(seq)

    @property
    def has_work(self) -> bool:
        """True while a step is needed: something waits, runs, or must be forgotten."""
        return bool(self.waiting or self._aborted) or any(self.running) or any(self._to_forget)

    def schedule(self) -> StepBatch:
        """Plans the next step for every rank (idle plans included)."""
        assert not self._in_flight, "schedule() called before apply_results()"
        batch = StepBatch(self._next_step_id, [RankPlan(r) for r in range(self.num_ranks)])
        self._next_step_id += 1
        self._drop_aborted(batch)
        for plan in batch.plans:
            self._forget(plan)
        for plan in batch.plans:
            self._schedule_running(plan, batch)
        self._admit(batch)
        return batch

    def apply_results(self, tokens: Mapping[int, int]) -> list[SeqEvent]:
        """Appends the step's sampled tokens (seq_id -> token id) and returns the outputs.

        Raises ValueError if the ranks did not answer exactly the sampled sequences.
        """
        in_flight, self._in_flight = self._in_flight, {}
        if tokens.keys() != in_flight.keys():
            missing = sorted(in_flight.keys() - tokens.keys())
            extra = sorted(tokens.keys() - in_flight.keys())
            raise ValueError(f"step results do not match the plan: missing {missing}, unexpected {extra}")
        events: list[SeqEvent] = []
        for seq_id, token_id in tokens.items():
            seq = in_flight[seq_id]
            if seq.is_aborted or seq.is_finished:
                continue  # aborted while the step ran; the next schedule() drops it
            output = seq.append_token(token_id, self.eos_token_ids, self.max_context)
            if output.is_final:
                self._retire(seq)
            events.append((seq, output))
        return events

    def fail_all(self, error: GenerationError) -> list[SeqEvent]:
        """Fails every waiting and running sequence (the group is gone); the
        batcher is unusable afterwards."""
        seqs = [*self.waiting, *(s for rank in self.running for s in rank)]
        self.waiting.clear()
        self._aborted.clear()
        self._in_flight.clear()
        for rank in (*self.running, *self._to_forget):
            rank.clear()
        for seq in seqs:
            seq.status = SeqStatus.FINISHED
        return [(seq, error) for seq in seqs]

    # Internals.

    def _drop_aborted(self, batch: StepBatch) -> None:
        for seq in self._aborted:
            if seq.status is SeqStatus.WAITING:
                self.waiting.remove(seq)
                seq.status = SeqStatus.FINISHED
            elif seq.status is SeqStatus.RUNNING:
                self._retire(seq)
            else:
                continue  # finished meanwhile (its last token, or failed)
            batch.events.append((seq, seq.abort_output()))
        self._aborted.clear()

    def _retire(self, seq: Sequence) -> None:
        """Moves a running sequence to the rank's forget list."""
        self.running[seq.rank].remove(seq)
        seq.status = SeqStatus.FINISHED
        self._to_forget[seq.rank].append(seq)

    def _forget(self, plan: RankPlan) -> None:
        allocator = self.allocators[plan.rank]
        for seq in self._to_forget[plan.rank]:
            if allocator.has_sequence(seq.seq_id):
                allocator.release(seq.seq_id)
            plan.finished_seq_ids.append(seq.seq_id)
        self._to_forget[plan.rank].clear()

    def _schedule_running(self, plan: RankPlan, batch: StepBatch) -> None:
        allocator = self.allocators[plan.rank]
        seqs = self.running[plan.rank]
        num_stalled = 0
        for seq in seqs:
            input_ids = seq.next_input_ids()
            num_after = seq.num_computed + max(1, len(input_ids))
            if not allocator.can_grow(seq.seq_id, num_after):
                num_stalled += 1
                continue
            new_block_ids = allocator.grow(seq.seq_id, num_after)
            self._schedule(plan, seq, input_ids, new_block_ids, num_after)
        if seqs and num_stalled == len(seqs):
            victim = seqs[-1]
            self._retire(victim)
            self._forget(plan)
            batch.events.append((victim, GenerationError(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"the KV cache of rank {plan.rank} is full ({allocator.num_blocks} blocks of "
                f"{allocator.block_size} tokens) after {victim.num_tokens} tokens of this request")))

    def _admit(self, batch: StepBatch) -> None:
        used_tokens = [plan.num_tokens for plan in batch.plans]
        running_tokens = [sum(s.num_tokens for s in seqs) for seqs in self.running]
        while self.waiting:
            seq = self.waiting[0]
            rank = self._place(seq, used_tokens, running_tokens)
            if rank is None:
                break
            self.waiting.popleft()
            self._start(seq, batch.plans[rank])
            used_tokens[rank] += len(seq.prompt_ids)
            running_tokens[rank] += len(seq.prompt_ids)
        if self.waiting and not any(self.running) and not any(p.scheduled for p in batch.plans):
            # Unreachable while add() checks fits; guards the loop against spinning on idle steps.
            seq = self.waiting.popleft()
            seq.status = SeqStatus.FINISHED
            batch.events.append((seq, GenerationError(
                ErrorCode.RESOURCE_EXHAUSTED, "the request cannot be scheduled on any rank")))

    def _place(self, seq: Sequence, used_tokens: list[int], running_tokens: list[int]) -> int | None:
        """The least-loaded rank with room for the sequence's prefill, or None."""
        num_prompt = len(seq.prompt_ids)
        fitting = [
            r for r, allocator in enumerate(self.allocators)
            if len(self.running[r]) < self.max_running_requests
            and used_tokens[r] + num_prompt <= self.max_batch_tokens
            and allocator.blocks_needed(num_prompt + 1) <= allocator.num_free
        ]
        if not fitting:
            return None
        return min(fitting, key=lambda r: (running_tokens[r], -self.allocators[r].num_free, r))

    def _start(self, seq: Sequence, plan: RankPlan) -> None:
        seq.rank = plan.rank
        seq.status = SeqStatus.RUNNING
        self.running[plan.rank].append(seq)
        input_ids = seq.next_input_ids()
        block_ids = self.allocators[plan.rank].grow(seq.seq_id, len(input_ids))
        request = seq.request
        plan.new_sequences.append(NewSequencePlan(
            seq.seq_id, request.temperature, request.top_p, request.top_k, request.seed, tuple(block_ids)))
        self._schedule(plan, seq, input_ids, [], len(input_ids))

    def _schedule(self, plan: RankPlan, seq: Sequence, input_ids: list[int],
                  new_block_ids: list[int], num_after: int) -> None:
        """Adds the sequence's work to the plan; its KV counts as computed from here on."""
        is_sampled = num_after == seq.num_tokens
        plan.scheduled.append(ScheduledSequencePlan(
            seq.seq_id, tuple(input_ids), tuple(new_block_ids), is_sampled))
        seq.num_computed = num_after
        if is_sampled:
            self._in_flight[seq.seq_id] = seq
