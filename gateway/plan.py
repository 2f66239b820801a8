"""What the batcher produces for one step: one plan per rank, as diffs.

The batcher fills a mutable RankPlan per rank with the step contract's own
types (services/step.py); `RankPlan.to_step_plan` freezes it into the
StepPlan the rank executes.
"""

import dataclasses

from gateway.requests import GenerationError, RequestOutput, Sequence
from services.step import NewSequence, ScheduledSequence, StepPlan


@dataclasses.dataclass(slots=True)
class RankPlan:
    """One rank's step as the batcher builds it: diffs against the rank's state. Empty = an idle step."""

    rank: int
    new_sequences: list[NewSequence] = dataclasses.field(default_factory=list)
    scheduled: list[ScheduledSequence] = dataclasses.field(default_factory=list)
    finished_seq_ids: list[int] = dataclasses.field(default_factory=list)
    # (source, destination) KV blocks the rank copies before the step (StepPlan.block_copies).
    block_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # Input tokens of the step (a decode counts one), kept as sequences are scheduled.
    num_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.finished_seq_ids)

    def to_step_plan(self, step_id: int, group_id: str, placement_epoch: int, *,
                     max_tokens_per_rank: int = 0, expert_placement_epoch: int = 0) -> StepPlan:
        """The frozen StepPlan of this rank's step."""
        return StepPlan(step_id, group_id, placement_epoch, tuple(self.new_sequences), tuple(self.scheduled),
                        tuple(self.finished_seq_ids), max_tokens_per_rank, expert_placement_epoch,
                        tuple(self.block_copies))


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
