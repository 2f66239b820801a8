"""Admission: which waiting requests start in this step, and on which rank.

Part of the batcher: batcher.Batcher calls `admit` after scheduling the
running sequences and is, to admission, only the narrow `AdmissionHost`
below (what it reads, and the two calls that start a sequence). The policy orders the waiting requests; each is started
on a rank that has room for its first prefill chunk: a free running slot,
prefill budget left in the step (batcher.py, step_budget.py), and KV blocks for the chunk beyond its cached
prefix, keeping `watermark` blocks spare for the decodes of the running
sequences. The first request that fits nowhere stops admission (so the
policy's order is kept, and a long prompt is never starved by short ones).

Prefix affinity: the rank whose cache holds the longest prefix of the request
wins, unless it runs more than `AFFINITY_SLACK` of max_running_requests more
sequences than the least loaded fitting rank; otherwise the rank with the
fewest running tokens. A request whose next uncached block another request is
prefilling on that rank in this very step waits one step (it is skipped, not
blocking the queue), and then reuses the block instead of computing it again:
this is what makes a burst of requests with one system prompt prefill it once.

Samples of one request (n > 1): each later sample (Sequence.leader is the
first) waits until the first one's prompt is scheduled to its last chunk, and
then starts only on the first one's rank, where the block deferral above holds
it one step more, until that prompt's full blocks are in the rank's prefix
cache: so the prompt is prefilled once, whatever the load of the other ranks.
A leader that finished pins nothing (nor does any without a prefix cache); one
preempted makes the samples not yet started wait until it is prefilled again.

A request that still needs its prompt's log-probabilities takes a cached prefix only
up to the position whose logits score the first one it lacks (Sequence.max_cached_tokens):
a rank scores the positions it computes, so with prompt_logprobs_start a scoring request
reuses the blocks of the prefix it shares with others and computes little more than the
positions it scores; asked for all of them, it takes none (cached_tokens 0).
"""

import dataclasses
from collections.abc import Sequence as Seq
from typing import Protocol

from gateway.kv_accounting import PrefixMatch, RankKV
from gateway.prefix_cache import ROOT_HASH
from gateway.plan import RankPlan, StepBatch
from gateway.policy import SchedulePolicy
from gateway.requests import Sequence
from gateway.stats import GatewayStats
from services.step import NewSequence

AFFINITY_SLACK = 0.125
# The fewest tokens of a partly filled block another request prefills in the step that make a
# request wait a step to copy them (the full-block deferral's counterpart; a step of TTFT for them).
MIN_TAIL_GAIN = 4
# Requests skipped for a block being prefilled, per step, before admission stops looking.
MAX_DEFERRED = 64


@dataclasses.dataclass(slots=True)
class StepState:
    """Scratch state of one schedule() call."""

    num_ranks: dataclasses.InitVar[int]
    scheduled: list[Sequence] = dataclasses.field(default_factory=list)
    scheduled_ids: set[int] = dataclasses.field(default_factory=set)
    # The sequences that sample in this step, by id.
    sampled: dict[int, Sequence] = dataclasses.field(default_factory=dict)
    # Jump-forward chunks of this step by sequence id: (the token fed back, the forced output tokens).
    jumps: dict[int, tuple[int, tuple[int, ...]]] = dataclasses.field(default_factory=dict)
    # Per rank: hashes of the full blocks prefilled in this step.
    computing: list[set[int]] = dataclasses.field(default_factory=list)
    # Per rank: the tokens of the block each prompt chunk of this step ends in (full or not), by
    # the hash of the block before it.
    chunk_ends: list[dict[int, list[tuple[int, ...]]]] = dataclasses.field(default_factory=list)
    # The sequences that prefilled prompt tokens in this step (their partly filled block is shared once sent).
    prefilled: list[Sequence] = dataclasses.field(default_factory=list)
    # Per rank: True once it preempted a sequence in this step (then it admits none).
    is_preempting: list[bool] = dataclasses.field(default_factory=list)

    def __post_init__(self, num_ranks: int) -> None:
        self.computing = [set() for _ in range(num_ranks)]
        self.chunk_ends = [{} for _ in range(num_ranks)]
        self.is_preempting = [False] * num_ranks


@dataclasses.dataclass(frozen=True, slots=True)
class _Placement:
    rank: int
    match: PrefixMatch
    num_tokens: int


# _place's answer for a request that should wait for a block being prefilled now.
_DEFER = object()


class AdmissionHost(Protocol):
    """What admission reads of the batcher, and the calls it makes to start a sequence."""

    ranks: Seq[RankKV]
    running: Seq[list[Sequence]]
    policy: SchedulePolicy
    stats: GatewayStats
    max_running_requests: int
    max_batch_tokens: int
    jump_forward: bool

    @property
    def num_ranks(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def waiting(self) -> list[Sequence]: ...

    def prefill_chunk(self, rank: int, start: int, num_remaining: int) -> int:
        """The prompt tokens from position start the rank's step may still prefill (step_budget.py)."""

    def has_prefill_budget(self, rank: int) -> bool:
        """True while the rank's step may take more prefill."""

    def start(self, plan: RankPlan, seq: Sequence) -> None:
        """Moves seq from waiting to running on plan's rank."""

    def schedule_seq(self, plan: RankPlan, step: "StepState", seq: Sequence, num_tokens: int) -> None:
        """Adds num_tokens of seq's input to plan."""


def watermark(kv: RankKV) -> int:
    """Blocks kept free at admission for the running sequences' next decode blocks."""
    return max(1, kv.num_blocks // 100)


def admit(batcher: AdmissionHost, batch: StepBatch, step: StepState, is_batch: bool | None = None) -> bool:
    """Starts waiting sequences while they fit, in the policy's order; is_batch: only those of
    that priority class (None: both). True if it stopped at a request that fits nowhere (those
    behind it, the next class's included, must not overtake it)."""
    if not batcher.num_waiting:
        return False
    waiting = batcher.waiting
    if is_batch is not None:
        waiting = [seq for seq in waiting if seq.request.is_batch == is_batch]
        if not waiting:
            return False
    running_tokens = [sum(s.num_tokens for s in seqs) for seqs in batcher.running]

    def cached_tokens(seq: Sequence) -> int:
        """The policy's estimate: the longest cached prefix on any rank."""
        return max(_match(kv, seq, is_estimate=True).num_cached_tokens for kv in batcher.ranks)

    num_deferred = 0
    for seq in batcher.policy.order(waiting, cached_tokens):
        if not any(_is_open(batcher, batch, step, r) for r in range(batcher.num_ranks)):
            return True
        if seq.num_in_flight:
            continue  # preempted with a token in flight: back once it has arrived
        placement = _place(batcher, batch, step, seq, running_tokens)
        if placement is _DEFER:
            num_deferred += 1
            if num_deferred >= MAX_DEFERRED:
                return True  # a burst behind one prefix: looking further costs more than it gains
            continue
        if placement is None:
            return True
        _start(batcher, batch, step, seq, placement)
        running_tokens[placement.rank] += seq.num_tokens
    return False


def _is_open(batcher: AdmissionHost, batch: StepBatch, step: StepState, rank: int) -> bool:
    return (not step.is_preempting[rank]
            and len(batcher.running[rank]) < batcher.max_running_requests
            and batcher.has_prefill_budget(rank))


def _place(batcher: AdmissionHost, batch: StepBatch, step: StepState, seq: Sequence, running_tokens: list[int]):
    """The rank to start seq on (a _Placement), _DEFER, or None if it fits nowhere."""
    ranks = range(batcher.num_ranks)
    leader = seq.leader
    if leader is not None and not leader.is_finished and batcher.ranks[0].cache is not None:
        if not leader.is_prefilled:
            return _DEFER  # the request's first sample computes the prompt first
        assert leader.rank is not None, leader.seq_id
        ranks = (leader.rank,)  # where that prompt's blocks are (or are being computed)
    fitting: list[_Placement] = []
    is_deferred = False
    for rank in ranks:
        kv = batcher.ranks[rank]
        if not _is_open(batcher, batch, step, rank):
            continue
        # Looked up afresh: admitting the previous request may have evicted blocks.
        match = _match(kv, seq)
        first_uncached = match.num_cached_tokens // kv.block_size
        # Waits only for a block it may take from the cache (max_cached_tokens).
        if ((first_uncached + 1) * kv.block_size <= seq.max_cached_tokens and first_uncached < len(seq.block_hashes)
                and seq.block_hashes[first_uncached] in step.computing[rank]) or _tail_is_computed(kv, step, seq, match,
                                                                                                 rank):
            is_deferred = True
            continue
        num_tokens = batcher.prefill_chunk(rank, match.num_cached_tokens, seq.num_tokens - match.num_cached_tokens)
        if not num_tokens:
            continue
        num_new_blocks = kv.blocks_needed(match.num_cached_tokens + num_tokens) - len(match.nodes)
        reserve = watermark(kv) if batcher.running[rank] else 0
        if num_new_blocks + reserve <= kv.num_available - match.num_unreferenced:
            fitting.append(_Placement(rank, match, num_tokens))
    if not fitting:
        return _DEFER if is_deferred else None
    best = max(p.match.num_cached_tokens for p in fitting)
    if best:
        least = min(len(batcher.running[p.rank]) for p in fitting)
        slack = max(1, int(AFFINITY_SLACK * batcher.max_running_requests))
        affine = [p for p in fitting if p.match.num_cached_tokens == best
                  and len(batcher.running[p.rank]) <= least + slack]
        fitting = affine or fitting
    return min(fitting, key=lambda p: (running_tokens[p.rank], -batcher.ranks[p.rank].num_available, p.rank))


def _tail_is_computed(kv: RankKV, step: StepState, seq: Sequence, match: PrefixMatch, rank: int) -> bool:
    """True if a prompt chunk of this step ends, under seq's last cached full block, in a block that
    begins with at least MIN_TAIL_GAIN more of seq's next tokens than seq's match has: seq waits a
    step and then copies those tokens (from the block, cached if full, live if not) instead of
    computing them."""
    computing = step.chunk_ends[rank]
    if not computing:
        return False
    bs = kv.block_size
    num_full = len(match.nodes)
    parent = seq.block_hashes[num_full - 1] if num_full else ROOT_HASH
    start = num_full * bs
    limit = min(seq.max_cached_tokens, len(seq.token_ids) - 1, start + bs - 1)
    wanted = seq.token_ids[start:limit]
    need = match.num_cached_tokens - start + MIN_TAIL_GAIN
    if len(wanted) < need:
        return False
    for tokens in computing.get(parent, ()):
        if len(tokens) >= need and tuple(wanted[:need]) == tokens[:need]:
            return True
    return False


def _match(kv: RankKV, seq: Sequence, *, is_estimate: bool = False) -> PrefixMatch:
    """seq's cached prefix on kv, within the tokens it may take from the cache (a match always
    leaves a token to compute: the one after max_cached_tokens here)."""
    limit = seq.max_cached_tokens
    token_ids = seq.token_ids if limit >= len(seq.token_ids) else seq.token_ids[:limit + 1]
    return kv.match(token_ids, seq.block_hashes, is_estimate=is_estimate)


def _start(batcher: AdmissionHost, batch: StepBatch, step: StepState, seq: Sequence, placement: _Placement) -> None:
    plan = batch.plans[placement.rank]
    kv = batcher.ranks[placement.rank]
    match = placement.match
    batcher.start(plan, seq)
    block_ids = kv.open(seq.seq_id, match)
    block_ids += kv.grow(seq.seq_id, match.num_cached_tokens + placement.num_tokens)
    if (copy := kv.pop_copy(seq.seq_id)) is not None:  # the prefix goes on inside the copied block
        plan.block_copies.append(copy)
        batcher.stats.num_block_copies += 1
    seq.num_computed = match.num_cached_tokens
    if seq.num_cached_tokens is None:
        seq.num_cached_tokens = min(match.num_cached_tokens, len(seq.prompt_ids))
    constraint, logprobs = seq.request.constraint, seq.request.logprobs
    if logprobs.prompt_logprobs and not seq.wants_prompt_logprobs:  # a resumed one that has them
        logprobs = dataclasses.replace(logprobs, prompt_logprobs=False)
    plan.new_sequences.append(NewSequence(
        seq.seq_id, seq.request.sampling, tuple(block_ids), match.num_cached_tokens, constraint=constraint,
        # A resumed constrained sequence's matcher replays what it already produced.
        constraint_output_ids=tuple(seq.output_ids) if constraint is not None else (), logprobs=logprobs,
        # The rank reports forced tokens only where the gateway may take a jump (jump_forward.note).
        is_jump_forward=constraint is not None and batcher.jump_forward and not logprobs.logprobs))
    stats = batcher.stats
    if seq.num_preemptions == 0:
        stats.num_prompt_tokens += seq.num_tokens
        stats.num_cached_prompt_tokens += match.num_cached_tokens
    else:
        stats.num_recomputed_tokens += seq.num_tokens - match.num_cached_tokens
    batcher.schedule_seq(plan, step, seq, placement.num_tokens)
