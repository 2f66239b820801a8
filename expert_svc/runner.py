"""Step execution on one rank: step plans in, sampled tokens out. No gRPC here.

`StepRunner` keeps the state the step protocol gives each sequence (block
table, tokens whose KV is computed, the last sampled token, the sampling spec
and its generator), applies a plan's diffs, runs one forward and samples.
`StepExecutor` runs those steps on the rank's single model thread so the
event loop stays responsive. See docs/internals.md, "The step protocol".
"""

import asyncio
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable

import torch

from services.kv_pool import KVPool
from services.model.batch import SeqInput, build_forward_batch
from services.model.sampling import SamplingSpec, sample


@dataclasses.dataclass(frozen=True, slots=True)
class NewSequence:
    """A sequence introduced to the rank, in full."""

    seq_id: int
    sampling: SamplingSpec
    block_ids: tuple[int, ...]
    # Tokens whose KV is already in the blocks (a cached prefix).
    num_cached_tokens: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class ScheduledSequence:
    """One sequence's work in a step."""

    seq_id: int
    # A prompt chunk; empty for a decode step (the last sampled token is fed back).
    token_ids: tuple[int, ...] = ()
    # Blocks appended to the block table before the step.
    new_block_ids: tuple[int, ...] = ()
    is_sampled: bool = True


@dataclasses.dataclass(frozen=True, slots=True)
class StepPlan:
    """One step: diffs against the rank's state (finished, then new, then scheduled)."""

    step_id: int
    group_id: str
    placement_epoch: int
    new_sequences: tuple[NewSequence, ...] = ()
    scheduled: tuple[ScheduledSequence, ...] = ()
    finished_seq_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class StepResult:
    """The outcome of one step: (seq_id, token_id) per sampled sequence, in plan order."""

    step_id: int
    tokens: tuple[tuple[int, int], ...]
    execute_seconds: float


class StalePlanError(ValueError):
    """A plan for another group or placement epoch than the one this rank runs."""


@dataclasses.dataclass(slots=True)
class _Sequence:
    block_table: list[int]
    num_computed: int
    sampling: SamplingSpec
    generator: torch.Generator
    # Sampled in the last step and not yet in the KV cache: the next decode input.
    pending_token: int | None = None


class StepRunner:
    """Executes step plans against a model and its KV pool (one rank, one thread)."""

    def __init__(self, model, kv_pool: KVPool, block_size: int, *, vocab_size: int,
                 group_id: str = "", placement_epoch: int = 0, device="cpu"):
        if block_size != kv_pool.block_size:
            raise ValueError(f"block_size {block_size} differs from the KV pool's {kv_pool.block_size}")
        self.model = model
        self.kv_pool = kv_pool
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.group_id = group_id
        self.placement_epoch = placement_epoch
        self.device = torch.device(device)
        self.num_steps = 0  # steps run since construction, idle and rejected ones included
        self._last_step_id = 0
        self._seqs: dict[int, _Sequence] = {}

    @property
    def seq_ids(self) -> list[int]:
        """The sequences the rank currently knows."""
        return list(self._seqs)

    def reset(self) -> None:
        """Forgets every sequence and restarts step numbering (a new gateway stream)."""
        self._seqs.clear()
        self._last_step_id = 0

    def run_step(self, plan: StepPlan) -> StepResult:
        """Applies the plan, runs one forward, samples; raises ValueError for a bad plan.

        A rejected plan still runs an idle step, so the other ranks of the
        group do not hang in the step's collectives; the state is unchanged.
        """
        start = time.perf_counter()
        try:
            self._check_plan(plan)
        except ValueError:
            self._forward([])
            raise
        self._last_step_id = plan.step_id
        self._apply_diffs(plan)
        seqs = [self._seq_input(s) for s in plan.scheduled]
        logits_SV = self._forward(seqs)
        tokens = self._sample(plan.scheduled, logits_SV)
        for seq in seqs:
            self._seqs[seq.seq_id].num_computed += len(seq.token_ids)
        return StepResult(plan.step_id, tokens, time.perf_counter() - start)

    def _forward(self, seqs: list[SeqInput]) -> torch.Tensor:
        batch = build_forward_batch(seqs, self.block_size, self.device)
        self.num_steps += 1
        return self.model.forward(batch, self.kv_pool)

    def _sample(self, scheduled, logits_SV: torch.Tensor) -> tuple[tuple[int, int], ...]:
        sampled = [self._seqs[s.seq_id] for s in scheduled if s.is_sampled]
        if not sampled:
            return ()
        token_ids = sample(logits_SV, [s.sampling for s in sampled], [s.generator for s in sampled])
        for seq, token_id in zip(sampled, token_ids):
            seq.pending_token = token_id
        seq_ids = [s.seq_id for s in scheduled if s.is_sampled]
        return tuple(zip(seq_ids, token_ids))

    def _apply_diffs(self, plan: StepPlan) -> None:
        for seq_id in plan.finished_seq_ids:
            del self._seqs[seq_id]
        for new in plan.new_sequences:
            generator = torch.Generator(device=self.device).manual_seed(new.sampling.seed)
            self._seqs[new.seq_id] = _Sequence(list(new.block_ids), new.num_cached_tokens,
                                               new.sampling, generator)
        for sched in plan.scheduled:
            self._seqs[sched.seq_id].block_table.extend(sched.new_block_ids)

    def _seq_input(self, sched: ScheduledSequence) -> SeqInput:
        seq = self._seqs[sched.seq_id]
        token_ids = list(sched.token_ids) if sched.token_ids else [seq.pending_token]
        seq.pending_token = None
        return SeqInput(sched.seq_id, token_ids, seq.num_computed, seq.block_table, sched.is_sampled)

    def _check_plan(self, plan: StepPlan) -> None:
        """Validates the whole plan before anything changes (all or nothing)."""
        if plan.group_id != self.group_id or plan.placement_epoch != self.placement_epoch:
            raise StalePlanError(
                f"plan for group {plan.group_id!r} epoch {plan.placement_epoch}, but this rank "
                f"runs group {self.group_id!r} epoch {self.placement_epoch}")
        if plan.step_id != self._last_step_id + 1:
            raise ValueError(f"step_id {plan.step_id} does not follow step {self._last_step_id}")
        finished = set(plan.finished_seq_ids)
        if unknown := finished - self._seqs.keys():
            raise ValueError(f"finished sequence {min(unknown)} is unknown")
        # seq_id -> (blocks, computed tokens, has a token to feed back), after this plan's diffs
        live = {i: (len(s.block_table), s.num_computed, s.pending_token is not None)
                for i, s in self._seqs.items() if i not in finished}
        for new in plan.new_sequences:
            if new.seq_id in live:
                raise ValueError(f"new sequence {new.seq_id} is already known")
            self._check_block_ids(new.seq_id, new.block_ids)
            if not 0 <= new.num_cached_tokens <= len(new.block_ids) * self.block_size:
                raise ValueError(f"sequence {new.seq_id} has {new.num_cached_tokens} cached tokens "
                                 f"in {len(new.block_ids)} blocks of {self.block_size}")
            live[new.seq_id] = (len(new.block_ids), new.num_cached_tokens, False)
        scheduled_ids = set()
        for sched in plan.scheduled:
            self._check_scheduled(sched, live, scheduled_ids)

    def _check_scheduled(self, sched: ScheduledSequence, live: dict, scheduled_ids: set) -> None:
        seq_id = sched.seq_id
        if seq_id in scheduled_ids:
            raise ValueError(f"sequence {seq_id} is scheduled twice in one step")
        scheduled_ids.add(seq_id)
        if seq_id not in live:
            raise ValueError(f"scheduled sequence {seq_id} is unknown")
        num_blocks, num_computed, has_pending = live[seq_id]
        if not sched.token_ids and not has_pending:
            raise ValueError(f"sequence {seq_id} has no token_ids and no sampled token to feed back")
        if bad := [t for t in sched.token_ids if not 0 <= t < self.vocab_size]:
            raise ValueError(f"sequence {seq_id} has token id {bad[0]} outside [0, {self.vocab_size})")
        self._check_block_ids(seq_id, sched.new_block_ids)
        num_tokens = num_computed + (len(sched.token_ids) or 1)
        num_blocks += len(sched.new_block_ids)
        if num_blocks * self.block_size < num_tokens:
            raise ValueError(f"sequence {seq_id} has {num_blocks} blocks of {self.block_size}, "
                             f"too few for {num_tokens} tokens")

    def _check_block_ids(self, seq_id: int, block_ids) -> None:
        if bad := [b for b in block_ids if not 0 <= b < self.kv_pool.num_blocks]:
            raise ValueError(f"sequence {seq_id} has block id {bad[0]} outside the pool's "
                             f"{self.kv_pool.num_blocks} blocks")


class StepFailedError(RuntimeError):
    """A step failed in the model or a collective, or overran its deadline: the
    rank is out of lockstep with its group and can run no further step."""


class StepExecutor:
    """Runs a StepRunner on the rank's one model thread, then an optional hook.

    `after_step(step_id)` runs on the model thread after every successful
    step (the stats reporter reads the device counters there, in order).
    A bad plan raises ValueError and the rank carries on. Any other error, or
    a step still running after `deadline_s` (a collective that never
    returns, e.g. NCCL without a host-side timeout), fails the executor for
    good: `on_failure(reason)` is called once on the event loop, and this
    and every later step raise StepFailedError.
    """

    def __init__(self, runner: StepRunner, thread: concurrent.futures.ThreadPoolExecutor,
                 after_step: Callable[[int], None] | None = None, *,
                 on_failure: Callable[[str], None] | None = None, deadline_s: float | None = None):
        self.runner = runner
        self._thread = thread
        self._after_step = after_step
        self._on_failure = on_failure
        self._deadline_s = deadline_s
        self.failure: str | None = None  # why the executor failed, once it has

    def _run(self, plan: StepPlan) -> StepResult:
        result = self.runner.run_step(plan)
        if self._after_step is not None:
            self._after_step(plan.step_id)
        return result

    async def execute(self, plan: StepPlan) -> StepResult:
        """Runs one step; raises ValueError (StalePlanError) for a bad plan,
        StepFailedError once a step has failed."""
        if self.failure is not None:
            raise StepFailedError(f"step {plan.step_id} refused: {self.failure}")
        step = asyncio.get_running_loop().run_in_executor(self._thread, self._run, plan)
        try:
            return await asyncio.wait_for(step, self._deadline_s)
        except ValueError:
            raise
        except TimeoutError as error:
            raise self._fail(f"step {plan.step_id} did not finish within {self._deadline_s:g} s "
                             f"(stuck in a collective?)") from error
        except Exception as error:  # anything else leaves the group's collectives out of step
            raise self._fail(f"step {plan.step_id} failed: {error}") from error

    def _fail(self, reason: str) -> StepFailedError:
        if self.failure is None:
            self.failure = reason
            if self._on_failure is not None:
                self._on_failure(reason)
        return StepFailedError(reason)

    async def reset(self) -> None:
        """Drops all sequence state, after any step still running."""
        await asyncio.get_running_loop().run_in_executor(self._thread, self.runner.reset)


@dataclasses.dataclass(slots=True)
class RankState:
    """What the rank is, as GetRankInfo reports it; `executor` is set once ready."""

    member_id: str
    model_name: str
    group_id: str = ""
    rank: int = 0
    world_size: int = 0
    placement_epoch: int = 0
    expert_ids: tuple[int, ...] = ()
    num_kv_blocks: int = 0
    kv_block_size: int = 0
    executor: StepExecutor | None = None

    @property
    def is_ready(self) -> bool:
        """True once the weights are loaded and the process group is up."""
        return self.executor is not None
