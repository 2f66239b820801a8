"""Step execution on one rank: step plans in, sampled tokens out. No gRPC here.

`StepRunner` keeps the state the step protocol gives each sequence (block
table, tokens whose KV is computed, the last sampled token, the sampling spec),
applies a plan's diffs, runs one forward and samples.
expert_svc/executor.py runs those steps on the rank's single model thread so
the event loop stays responsive. See docs/internals.md, "The step protocol".

A step is launched, then finished. `launch` checks the plan, applies it,
and queues the forward and the sampling on the device; the rank's state
moves on at once, each sampled sequence's next input being its row of the
step's tokens, still on the device. `finish` reads those tokens back: the
step's one host sync, which touches no runner state. So the next step can
be launched (the GPU kept busy) before the last one's tokens are read.

Decode steps (every sequence one new token, a fixed dispatch capacity) run
through CUDA graphs when a `DecodeGraphRunner` is given (graph_runner.py), and
so do steps whose sequences bring a few tokens each (jump-forward chunks,
short prompt chunks: expanded, a decode row per token); other steps run
eagerly (the plan's max_tokens_per_rank spares the all_reduce that would
otherwise pick the dispatch mode), or, given a `PrefillGraphRunner`
(prefill_graphs.py), as captured pieces with the attention eager between them. Constrained
sequences' logits are masked before sampling (expert_svc/constrained.py).
"""

import array
import dataclasses
import time
from collections.abc import Callable

import torch
from torch import Tensor

from expert_svc.constrained import ConstraintMasks, Unaccepted
from expert_svc.graph_runner import DecodeGraphRunner, TokenFeed
from expert_svc.logprobs import SeqScoring, StepScores, is_scored_chunk
from expert_svc.prefill_graphs import PrefillGraphRunner
from expert_svc.step_profile import StepProfiler
from services import metrics
from services.constraints import Matcher
from services.kv_pool import KVPool
from services.model.batch import ForwardBatch, SeqInput, build_forward_batch, to_device
from services.model.sampling import sample_on_device
from services.step import GREEDY, SamplingSpec, ScheduledSequence, StepPlan, StepResult


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchedStep:
    """A step whose work is queued on the device; `StepRunner.finish` reads its tokens."""

    step_id: int
    start: float  # time.perf_counter() at launch
    # (row of token_ids_S, seq_id) of each sampled sequence, in plan order.
    sampled: tuple[tuple[int, int], ...]
    # The sampled tokens on the host (pinned on CUDA), complete once `ready` has
    # fired; None when nothing was sampled.
    token_ids_S: Tensor | None
    # A torch.cuda.Event recorded after the copy to the host; None when the
    # tokens are complete already (the CPU: the forward ran in launch).
    ready: "torch.cuda.Event | None"
    # The step's scored tokens (expert_svc/logprobs.py) and their tensors on the host, read
    # with the tokens; None when no scheduled sequence asked for log-probabilities.
    scores: StepScores | None = None
    scores_host: tuple[Tensor, ...] = ()
    # (row, seq_id, a copy of its matcher before the sampled token) of each masked constrained row:
    # finish advances the copies to report the tokens forced next (expert_svc/constrained.py).
    watched: tuple[tuple[int, int, Matcher], ...] = ()
    # On CUDA: an event recorded before the step's first kernel (device time up to `ready`), and
    # whether the step carried prompt tokens (the device-time histogram's kind).
    device_start: "torch.cuda.Event | None" = None
    has_prompt: bool = False
    # On CUDA: the `ready` event of the step launched before this one (the device gap's start).
    previous_ready: "torch.cuda.Event | None" = None


class StalePlanError(ValueError):
    """A plan for another group or placement epoch than the one this rank runs."""


@dataclasses.dataclass(slots=True)
class _Sequence:
    # An int32 array: a decode step copies it whole into the graph's packed inputs
    # (graph_inputs.StaticInputs), at memcpy speed rather than int by int.
    block_table: array.array
    num_computed: int
    sampling: SamplingSpec
    # Sampled in an earlier step and not yet in the KV cache: the next decode
    # input, on the device as (that step's tokens, this sequence's row).
    last_token: tuple[Tensor, int] | None = None
    # A constrained sequence's matcher (expert_svc/constrained.py), and its last sampled
    # token while the matcher has not accepted it (that step's host copy).
    matcher: Matcher | None = None
    unaccepted: Unaccepted | None = None
    # Jump-forward: report the tokens forced after each sampled one (NewSequence.is_jump_forward).
    is_jump_forward: bool = False
    # What the sequence reports of its log-probabilities; None: nothing.
    scoring: SeqScoring | None = None


class StepRunner:
    """Executes step plans against a model and its KV pool (one rank, one thread)."""

    def __init__(self, model, kv_pool: KVPool, block_size: int, *, vocab_size: int,
                 group_id: str = "", placement_epoch: int = 0, device="cpu",
                 graphs: DecodeGraphRunner | None = None, constraints: ConstraintMasks | None = None,
                 prefill_graphs: PrefillGraphRunner | None = None):
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
        self._num_scoring = 0  # sequences with a `scoring`: no step is scored while there is none
        self.graphs = graphs  # None: every step runs eagerly
        self.prefill_graphs = prefill_graphs  # None: steps with prompt tokens run eagerly
        # Constrained sequences' matchers and masks; without a compiler they are refused.
        self.constraints = constraints or ConstraintMasks()
        # Installs a plan's expert placement epoch when it differs (expert_svc/placement.py).
        self.install_placement: Callable[[int], None] | None = None
        self._last_ready: torch.cuda.Event | None = None  # the last launched step's, for the device gap
        self.profiler: StepProfiler | None = None  # --profile-prefill-steps (expert_svc/step_profile.py)

    @property
    def seq_ids(self) -> list[int]:
        """The sequences the rank currently knows."""
        return list(self._seqs)

    def reset(self) -> None:
        """Forgets every sequence and restarts step numbering (a new gateway stream)."""
        self._seqs.clear()
        self._num_scoring = 0
        self._last_step_id = 0
        self._last_ready = None

    def run_step(self, plan: StepPlan) -> StepResult:
        """launch, then finish: one whole step."""
        return self.finish(self.launch(plan))

    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Applies the plan and queues its forward and sampling, reading nothing
        back; raises ValueError for a bad plan.

        A rejected plan still runs an idle step, so the other ranks of the
        group do not hang in the step's collectives; the state is unchanged.
        """
        start, start_cpu = time.perf_counter(), time.thread_time()
        try:
            self._check_plan(plan)
            matchers = {new.seq_id: self.constraints.matcher(new) for new in plan.new_sequences
                        if new.constraint is not None}
            if self.install_placement is not None:  # a no-op unless the epoch changes
                self.install_placement(plan.expert_placement_epoch)
        except ValueError:
            self._forward([], None, plan.max_tokens_per_rank)
            raise
        self._last_step_id = plan.step_id
        prof = None if self.profiler is None else self.profiler.begin()
        self._apply_diffs(plan, matchers)
        seqs, feed = self._inputs(plan.scheduled)
        device_start = _timing_event(self.device)
        self.kv_pool.copy_blocks(plan.block_copies)
        logits_SV, greedy_S = self._forward(seqs, feed, plan.max_tokens_per_rank)
        scores = None
        if self._num_scoring:  # scored before sampling, whose constraint masks write into logits_SV
            scores = StepScores.prepare(logits_SV, plan.scheduled, [self._seqs[s.seq_id] for s in plan.scheduled],
                                        is_graph=greedy_S is not None)
            logits_SV = logits_SV if scores is None else scores.sampling_logits(logits_SV)
        token_ids_S, sampled, watched, masked = self._sample(plan.scheduled, logits_SV, greedy_S)
        for seq in seqs:
            self._seqs[seq.seq_id].num_computed += len(seq.token_ids)
        scored = [] if scores is None else scores.launch(token_ids_S)
        host, ready = _to_host([t for t in (token_ids_S, *scored) if t is not None])
        host_S = None if token_ids_S is None else host.pop(0)
        for row, seq in masked:  # their matchers read the tokens from the host copy next step
            seq.unaccepted = (host_S, row, ready)
        has_prompt = any(len(seq.token_ids) > 1 for seq in seqs)
        previous_ready = self._last_ready
        self._last_ready = ready if ready is not None else self._last_ready
        launched = time.perf_counter()
        if seqs:
            expert = metrics.expert_metrics()
            expert.step_launch.labels(_kind(has_prompt)).observe(launched - start)
            expert.step_launch_cpu.labels(_kind(has_prompt)).observe(time.thread_time() - start_cpu)
        if prof is not None:
            self.profiler.end(prof, start, launched, ready, step_id=plan.step_id, has_prompt=has_prompt,
                              num_tokens=sum(len(seq.token_ids) for seq in seqs), num_seqs=len(seqs))
        return LaunchedStep(plan.step_id, start, sampled, host_S, ready, scores, tuple(host), watched, device_start,
                            has_prompt, previous_ready)

    @staticmethod
    def finish(step: LaunchedStep) -> StepResult:
        """Waits for the step's tokens and reads them: the step's one host sync.

        Touches no runner state, so it may run on another thread while the
        model thread launches the next step.
        """
        if step.ready is not None:
            step.ready.synchronize()
            if step.device_start is not None:
                _observe_device_time(step)
        token_ids = [] if step.token_ids_S is None else step.token_ids_S.tolist()
        tokens = tuple((seq_id, token_ids[row]) for row, seq_id in step.sampled)
        logprobs = () if step.scores is None else step.scores.results([t.tolist() for t in step.scores_host],
                                                                      token_ids)
        forced = []
        for row, seq_id, matcher in step.watched:  # the step's own copies: no runner state
            if matcher.accept(token_ids[row]) and (token_ids_after := matcher.forced_token_ids()):
                forced.append((seq_id, tuple(token_ids_after)))
        return StepResult(step.step_id, tokens, time.perf_counter() - step.start, logprobs, tuple(forced))

    def _forward(self, seqs: list[SeqInput], feed: TokenFeed | None,
                 max_tokens_per_rank: int) -> tuple[Tensor, Tensor | None]:
        """(logits, greedy): eagerly, logits of the sampled sequences and no greedy
        tokens; through a graph, logits and argmax of every sequence (at its last token)."""
        self.num_steps += 1
        num_tokens = sum(len(s.token_ids) for s in seqs)
        if not max_tokens_per_rank:
            max_tokens_per_rank = self.model.comm.max_over_ranks(num_tokens, self.device)
        capacity = self.model.dispatch_capacity(max_tokens_per_rank)
        if self.graphs is not None and self.graphs.fits(seqs, capacity):
            out = self.graphs.run(seqs, capacity, feed)
            return out.logits_SV, out.greedy_S
        batch = _upload(build_forward_batch(seqs, self.block_size, "cpu"), self.device)
        if feed is not None:
            feed.apply(batch.input_ids_T)
        if seqs and self.prefill_graphs is not None and self.prefill_graphs.fits(num_tokens):
            return self.prefill_graphs.run(batch, self.kv_pool), None
        return self.model.forward_at_capacity(batch, self.kv_pool, capacity), None

    def _sample(self, scheduled, logits_SV: Tensor, greedy_S: Tensor | None) -> tuple[Tensor | None, tuple, tuple,
                                                                                     list]:
        """Samples on the device, reading nothing back: (token_ids_S, (row, seq_id)
        of each sampled sequence, LaunchedStep.watched, (row, _Sequence) of each constrained
        one), and makes each one's row its next input.

        greedy_S None: logits_SV holds the sampled sequences' rows; otherwise
        every scheduled sequence's row (an unsampled one takes the argmax, no draw).
        """
        rows = [s for s in scheduled if s.is_sampled or greedy_S is not None]
        if not rows:
            return None, (), (), []
        seqs = [self._seqs[s.seq_id] for s in rows]
        specs = [seq.sampling if s.is_sampled else GREEDY for s, seq in zip(rows, seqs)]
        # The index of the token each row draws: a draw depends on its seed and this only.
        positions = [seq.num_computed + s.num_inputs for s, seq in zip(rows, seqs)]
        constrained = [(row, s, seq) for row, (s, seq) in enumerate(zip(rows, seqs)) if s.is_sampled and seq.matcher]
        watched = ()
        if constrained:
            greedy_S, copies = self.constraints.mask(
                logits_SV, greedy_S, [row for row, _, _ in constrained], [seq.matcher for _, _, seq in constrained],
                [seq.unaccepted for _, _, seq in constrained],
                [s.token_ids[len(s.token_ids) - s.num_forced:] if s.num_forced else () for _, s, _ in constrained],
                [seq.is_jump_forward for _, _, seq in constrained])
            watched = tuple((row, rows[row].seq_id, matcher) for row, matcher in copies)
        token_ids_S = sample_on_device(logits_SV, specs, positions, greedy_S)
        if token_ids_S is greedy_S:  # a graph's static output: the next replay overwrites it
            token_ids_S = token_ids_S.clone()
        sampled = []
        for row, (sched, seq) in enumerate(zip(rows, seqs)):
            if sched.is_sampled:
                seq.last_token = (token_ids_S, row)
                sampled.append((row, sched.seq_id))
        return token_ids_S, tuple(sampled), watched, [(row, seq) for row, _, seq in constrained]

    def _apply_diffs(self, plan: StepPlan, matchers: dict[int, Matcher]) -> None:
        for seq_id in plan.finished_seq_ids:
            self._num_scoring -= self._seqs.pop(seq_id).scoring is not None
        for new in plan.new_sequences:
            scoring = SeqScoring(new.logprobs) if new.logprobs else None
            self._num_scoring += scoring is not None
            self._seqs[new.seq_id] = _Sequence(array.array("i", new.block_ids), new.num_cached_tokens, new.sampling,
                                               matcher=matchers.get(new.seq_id), scoring=scoring,
                                               is_jump_forward=new.is_jump_forward)
        for sched in plan.scheduled:
            self._seqs[sched.seq_id].block_table.extend(sched.new_block_ids)

    def _inputs(self, scheduled) -> tuple[list[SeqInput], TokenFeed | None]:
        """The step's sequences; a decode input is fed from the device (its host-side
        id is 0 until the device gather writes the sampled token)."""
        seqs, fed_rows, fed_tokens, num_tokens = [], [], [], 0
        for sched in scheduled:
            seq = self._seqs[sched.seq_id]
            token_ids = list(sched.token_ids) or [0]
            if not sched.token_ids:
                fed_rows.append(num_tokens)
                fed_tokens.append(seq.last_token)
            seq.last_token = None
            seqs.append(SeqInput(sched.seq_id, token_ids, seq.num_computed, seq.block_table, sched.is_sampled,
                                 seq.scoring is not None and is_scored_chunk(sched, seq.scoring)))
            num_tokens += len(token_ids)
        return seqs, _token_feed(fed_rows, fed_tokens, self.device)

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
        live = {i: (len(s.block_table), s.num_computed, s.last_token is not None)
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
        if plan.block_copies:
            self._check_copies(plan)
        num_tokens = plan.num_tokens
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
        if sched.num_forced and (not sched.is_sampled or sched.num_forced >= len(sched.token_ids)):
            raise ValueError(f"sequence {seq_id} has {sched.num_forced} forced tokens in a chunk of "
                             f"{len(sched.token_ids)} (sampled: {sched.is_sampled})")
        if bad := [t for t in sched.token_ids if not 0 <= t < self.vocab_size]:
            raise ValueError(f"sequence {seq_id} has token id {bad[0]} outside [0, {self.vocab_size})")
        self._check_block_ids(seq_id, sched.new_block_ids)
        num_tokens = num_computed + sched.num_inputs
        num_blocks += len(sched.new_block_ids)
        if num_blocks * self.block_size < num_tokens:
            raise ValueError(f"sequence {seq_id} has {num_blocks} blocks of {self.block_size}, "
                             f"too few for {num_tokens} tokens")

    def _check_copies(self, plan: StepPlan) -> None:
        """A copy writes a block of a new sequence of this plan, once, and reads a block of the pool."""
        new_blocks = {b for new in plan.new_sequences for b in new.block_ids}
        destinations = set()
        for source, destination in plan.block_copies:
            if not 0 <= source < self.kv_pool.num_blocks:
                raise ValueError(f"block copy source {source} is outside the pool's {self.kv_pool.num_blocks} blocks")
            if destination not in new_blocks:
                raise ValueError(f"block copy destination {destination} is no block of a new sequence in the plan")
            if destination in destinations:
                raise ValueError(f"block {destination} is the destination of two copies")
            destinations.add(destination)

    def _check_block_ids(self, seq_id: int, block_ids) -> None:
        if bad := [b for b in block_ids if not 0 <= b < self.kv_pool.num_blocks]:
            raise ValueError(f"sequence {seq_id} has block id {bad[0]} outside the pool's "
                             f"{self.kv_pool.num_blocks} blocks")


def _token_feed(rows_F: list[int], tokens: list[tuple[Tensor, int]], device: torch.device) -> TokenFeed | None:
    """Input rows rows_F take tokens[i] = (an earlier step's token_ids_S, row), gathered on
    the device: one index upload, and one gather (plus a cat when the tokens come from
    several steps)."""
    if not rows_F:
        return None
    sources = list({id(t): t for t, _ in tokens}.values())
    starts, offset = {}, 0
    for source in sources:
        starts[id(source)], offset = offset, offset + source.shape[0]
    token_ids_N = sources[0] if len(sources) == 1 else torch.cat(sources)
    index_2F = to_device(torch.tensor([rows_F, [starts[id(t)] + row for t, row in tokens]]), device)
    return TokenFeed(index_2F[0], token_ids_N.index_select(0, index_2F[1]))


def _upload(batch: ForwardBatch, device: torch.device) -> ForwardBatch:
    """A batch built on the CPU, on `device`, without a sync."""
    if device.type == "cpu":
        return batch
    return dataclasses.replace(batch, **{
        field.name: to_device(value, device) for field in dataclasses.fields(batch)
        if isinstance(value := getattr(batch, field.name), Tensor)})


def _to_host(tensors: list[Tensor]) -> tuple[list[Tensor], "torch.cuda.Event | None"]:
    """The tensors (the sampled tokens, the scored log-probabilities) on the host without a
    sync, and the one event after which they all are complete; None when there are none.

    On CUDA, non-blocking copies into pinned memory: a plain .tolist() would
    also wait for every step queued after this one.
    """
    if not tensors or tensors[0].device.type != "cuda":
        return tensors, None
    host = []
    for tensor in tensors:
        host.append(torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True))
        host[-1].copy_(tensor, non_blocking=True)
    ready = torch.cuda.Event(enable_timing=True)  # also the end of the step's device time
    ready.record()
    return host, ready


def _kind(has_prompt: bool) -> str:
    """The step histograms' kind label."""
    return "prefill" if has_prompt else "decode"


def _observe_device_time(step: LaunchedStep) -> None:
    """A read CUDA step's device time and, unless the rank was idle, the device gap before it."""
    expert = metrics.expert_metrics()
    kind = _kind(step.has_prompt)
    expert.step_device.labels(kind).observe(step.device_start.elapsed_time(step.ready) / 1e3)
    if step.previous_ready is not None:  # complete: recorded before this step's events
        gap_s = step.previous_ready.elapsed_time(step.device_start) / 1e3
        if gap_s < 1.0:
            expert.step_device_gap.labels(kind).observe(max(gap_s, 0.0))


def _timing_event(device: torch.device) -> "torch.cuda.Event | None":
    """On CUDA, a timing event recorded now on the current stream (a step's device start); else None."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
