"""What the batcher produces for one step: one plan per rank, as diffs (the step protocol).

Domain types only; engine.plan_to_proto writes them as moe.expert.v1.StepPlan.
"""

import dataclasses

from gateway.requests import GenerationError, RequestOutput, Sequence


@dataclasses.dataclass(frozen=True, slots=True)
class NewSequencePlan:
    """A sequence a rank sees for the first time, in full."""

    seq_id: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    block_ids: tuple[int, ...]
    # Tokens whose KV is already in the first blocks (a cached prefix).
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
    # Input tokens of the step (a decode counts one), kept as sequences are scheduled.
    num_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.finished_seq_ids)


# What happened to one request: an output, or the error that failed it.
SeqEvent = tuple[Sequence, RequestOutput | GenerationError]


@dataclasses.dataclass(slots=True)
class StepBatch:
    """The plans of one step, one per rank, and the events scheduling produced
    (aborted and expired requests, requests that can never fit).

    step_id is 0 when there is nothing to send: no rank has work or anything
    to forget (then only the events count).
    """

    step_id: int
    plans: list[RankPlan]
    events: list[SeqEvent] = dataclasses.field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return all(p.is_empty for p in self.plans)

    @property
    def max_tokens_per_rank(self) -> int:
        """The most input tokens any rank runs in this step (StepPlan.max_tokens_per_rank)."""
        return max((p.num_tokens for p in self.plans), default=0)
