"""Step execution on one rank: step plans in, sampled tokens out. No gRPC here.

`StepRunner` keeps the state the step protocol gives each sequence (block
table, tokens whose KV is computed, the last sampled token, the sampling spec
and its generator), applies a plan's diffs, runs one forward and samples.
`StepExecutor` runs those steps on the rank's single model thread so the
event loop stays responsive. See docs/internals.md, "The step protocol".

Decode steps (every sequence one new token, a fixed dispatch capacity) run
through CUDA graphs when a `DecodeGraphRunner` is given (graph_runner.py);
other steps run eagerly. Either way a step reads the device once: the
sampled tokens, at the end (the plan's max_tokens_per_rank spares the
all_reduce that would otherwise pick the dispatch mode).
"""

import asyncio
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable

import torch

from expert_svc.graph_runner import DecodeGraphRunner
from services.kv_pool import KVPool
from services.model.batch import ForwardBatch, SeqInput, build_forward_batch
from services.model.sampling import SamplingSpec, sample_on_device


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
    # The largest token count of any rank of the group in this step (the same
    # in every rank's plan); 0 = unknown, found with an all_reduce.
    max_tokens_per_rank: int = 0
    # The expert placement to run the step with (expert_svc/placement.py).
    expert_placement_epoch: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class StepResult:
    """The outcome of one step: (seq_id, token_id) per sampled sequence, in plan order."""

    step_id: int
    tokens: tuple[tuple[int, int], ...]
    execute_seconds: float


_GREEDY = SamplingSpec(temperature=0.0)


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
                 group_id: str = "", placement_epoch: int = 0, device="cpu",
                 graphs: DecodeGraphRunner | None = None):
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
        self.graphs = graphs  # None: every step runs eagerly
        # Installs a plan's expert placement epoch when it differs (expert_svc/placement.py).
        self.install_placement: Callable[[int], None] | None = None

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
            if self.install_placement is not None:  # a no-op unless the epoch changes
                self.install_placement(plan.expert_placement_epoch)
        except ValueError:
            self._forward([], plan.max_tokens_per_rank)
            raise
        self._last_step_id = plan.step_id
        self._apply_diffs(plan)
        seqs = [self._seq_input(s) for s in plan.scheduled]
        tokens = self._sample(plan.scheduled, *self._forward(seqs, plan.max_tokens_per_rank))
        for seq in seqs:
            self._seqs[seq.seq_id].num_computed += len(seq.token_ids)
        return StepResult(plan.step_id, tokens, time.perf_counter() - start)

    def _forward(self, seqs: list[SeqInput], max_tokens_per_rank: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits, greedy): eagerly, logits of the sampled sequences and no greedy
        tokens; through a graph, logits and argmax of every sequence."""
        self.num_steps += 1
        num_tokens = sum(len(s.token_ids) for s in seqs)
        if not max_tokens_per_rank:
            max_tokens_per_rank = self.model.comm.max_over_ranks(num_tokens, self.device)
        capacity = self.model.dispatch_capacity(max_tokens_per_rank)
        if self.graphs is not None and self.graphs.fits(seqs, capacity):
            out = self.graphs.run(seqs, capacity)
            return out.logits_SV, out.greedy_S
        batch = _upload(build_forward_batch(seqs, self.block_size, "cpu"), self.device)
        return self.model.forward_at_capacity(batch, self.kv_pool, capacity), None

    def _sample(self, scheduled, logits_SV: torch.Tensor, greedy_S: torch.Tensor | None) -> tuple[tuple[int, int], ...]:
        """Samples on the device, then reads the tokens back: the step's one host sync.

        greedy_S None: logits_SV holds the sampled sequences' rows; otherwise
        every scheduled sequence's row (an unsampled one takes the argmax, no draw).
        """
        rows = [s for s in scheduled if s.is_sampled or greedy_S is not None]
        if not rows:
            return ()
        seqs = [self._seqs[s.seq_id] for s in rows]
        specs = [seq.sampling if s.is_sampled else _GREEDY for s, seq in zip(rows, seqs)]
        token_ids = sample_on_device(logits_SV, specs, [seq.generator for seq in seqs], greedy_S).tolist()
        tokens = []
        for sched, seq, token_id in zip(rows, seqs, token_ids):
            if sched.is_sampled:
                seq.pending_token = token_id
                tokens.append((sched.seq_id, token_id))
        return tuple(tokens)

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
        num_tokens = sum(len(s.token_ids) or 1 for s in plan.scheduled)
        if plan.max_tokens_per_rank and num_tokens > plan.max_tokens_per_rank:
            raise ValueError(f"the plan has {num_tokens} tokens, more than its max_tokens_per_rank "
                             f"{plan.max_tokens_per_rank}")

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


def _upload(batch: ForwardBatch, device: torch.device) -> ForwardBatch:
    """A batch built on the CPU, on `device`: pinned, non-blocking copies on CUDA (a plain
    copy from pageable memory would wait for the device, once per tensor)."""
    if device.type == "cpu":
        return batch
    pin = device.type == "cuda"
    return dataclasses.replace(batch, **{
        field.name: value.pin_memory().to(device, non_blocking=True) if pin else value.to(device)
        for field in dataclasses.fields(batch)
        if isinstance(value := getattr(batch, field.name), torch.Tensor)})


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
        """Drops all sequence state, after any step still running.

        Cancelling the caller does not cancel the reset: it is queued on the model
        thread and still runs there before any later step (the thread runs jobs in
        order), so a new stream never sees the last stream's sequences.
        """
        await asyncio.shield(asyncio.wrap_future(self._thread.submit(self.runner.reset)))


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
