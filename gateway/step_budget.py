"""How much prefill each step carries, and whether a new request can still be served in time.

The step budget (per rank and step), priced by the cost model (gateway/step_cost.py):
- No decode anywhere in the group: prefill gets all of max_batch_tokens. The
  ranks of a group step together (their expert collectives), so one rank's
  decodes make every rank's step count.
- With decodes: the step may last `tpot_target_ms * TPOT_SHARE` (the rest of
  the target is the model's error and the gateway's own time), plus the slack
  of the decoding requests: the SLO is on a request's MEAN time per output
  token, so a request whose tokens came faster than the target so far may
  spend that margin, spread over the tokens it still has to generate. The
  tightest request decides (`slack_ms`); one behind its target shrinks the
  step instead (unless it is too far behind to be saved). Prefill chunks get what the decodes leave of that time.
- Prefill always gets at least `min_prefill_tokens` per rank and step while
  prompts wait: a step stretched a little past the target costs the running
  requests a few ms of their mean, prompts held back cost their whole TTFT.
- Chunks are cut in the batcher's order (interactive before batch, oldest
  first); `prefill_chunk_size`, if set, caps one sequence's chunk too.

Admission under overload (`check_admission`): a new request's time to first
token is predicted as the prompt tokens ahead of it (those of its class and of
higher classes: waiting prompts and the rest of those being prefilled) plus its
own, over the group's prefill rate at the current decode load.
An interactive request predicted past `ttft_target_ms * SHED_MARGIN` cannot
make its TTFT target even if admitted; a batch request is refused already past
`ttft_target_ms` and counts every prompt ahead (interactive ones overtake it),
so batch traffic is shed first. A refused request gets `Overloaded`
(RESOURCE_EXHAUSTED) with the predicted wait and a retry hint, before any
model work: queueing it would only make those behind it miss their SLO too.
"""

import dataclasses
import math
from collections.abc import Iterable, Sequence as Seq

from gateway.requests import ErrorCode, GenerationError
from gateway.step_cost import StepCost

# The share of the TPOT target a predicted step may use (see the module docstring).
TPOT_SHARE = 0.9
# Bounds of the slack a step may add (or, negative, take) as shares of the step's target.
MAX_SLACK_SHARE = 1.0
MIN_SLACK_SHARE = -0.5
# An interactive request is refused once its predicted TTFT exceeds this many TTFT targets.
SHED_MARGIN = 2.0
# The least retry hint: sooner, a refused client would mostly be refused again.
MIN_RETRY_AFTER_MS = 50


class Overloaded(GenerationError):
    """RESOURCE_EXHAUSTED for a request refused under load; retry_after_ms: when to try again."""

    def __init__(self, message: str, retry_after_ms: float) -> None:
        super().__init__(ErrorCode.RESOURCE_EXHAUSTED, message)
        self.retry_after_ms = max(MIN_RETRY_AFTER_MS, math.ceil(retry_after_ms))


@dataclasses.dataclass(slots=True)
class StepBudget:
    """What prefill may still add to one rank's step: tokens, predicted ms (inf: no decode
    to protect), and the tokens guaranteed whatever the ms."""

    tokens_left: int
    ms_left: float = math.inf
    floor_left: int = 0
    # The most tokens of one sequence's chunk (0: no cap).
    chunk_cap: int = 0

    def chunk(self, cost: StepCost, start: int, num_remaining: int) -> int:
        """The tokens of a prompt at position start (num_remaining left) this step may take."""
        by_time = num_remaining if self.ms_left == math.inf else cost.tokens_within(self.ms_left, start)
        num = min(num_remaining, self.tokens_left, max(self.floor_left, by_time))
        return max(0, min(num, self.chunk_cap) if self.chunk_cap else num)

    def take(self, cost: StepCost, start: int, num_tokens: int) -> None:
        """Counts a chunk of num_tokens tokens from position start as planned."""
        self.tokens_left -= num_tokens
        self.floor_left = max(0, self.floor_left - num_tokens)
        if self.ms_left != math.inf:
            self.ms_left -= cost.chunk_ms(start, num_tokens)

    @property
    def is_spent(self) -> bool:
        return self.tokens_left <= 0 or (self.ms_left <= 0 and self.floor_left <= 0)


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeProgress:
    """Where one decoding request stands against the mean-TPOT target."""

    # Output tokens after its first whose results have arrived, and the ms they took.
    num_intervals: int
    elapsed_ms: float
    # Tokens it may still generate (max_new_tokens left).
    num_remaining: int


@dataclasses.dataclass(frozen=True, slots=True)
class BudgetRule:
    """The settings of the step budget and of admission (GatewayConfig's)."""

    max_batch_tokens: int
    # 0: no decode latency budget (every step may fill max_batch_tokens).
    tpot_target_ms: float = 40.0
    # 0: no shedding on predicted TTFT.
    ttft_target_ms: float = 0.0
    min_prefill_tokens: int = 1024
    # One sequence's chunk cap; 0: none.
    prefill_chunk_size: int = 0

    def __post_init__(self) -> None:
        if self.max_batch_tokens <= 0:
            raise ValueError(f"max_batch_tokens must be positive, got {self.max_batch_tokens}")
        for name in ("tpot_target_ms", "ttft_target_ms"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be >= 0 (0: off), got {getattr(self, name)}")
        for name in ("min_prefill_tokens", "prefill_chunk_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def step_target_ms(self) -> float:
        """The predicted length a step with decodes aims at, before slack."""
        return self.tpot_target_ms * TPOT_SHARE

    def slack_ms(self, progress: Iterable[DecodeProgress]) -> float:
        """What the decoding requests' mean-TPOT margin adds to (or takes from) the next step:
        the smallest margin per remaining token, within the MIN/MAX_SLACK_SHARE bounds."""
        if not self.tpot_target_ms:
            return 0.0
        target = self.step_target_ms
        # A request so far behind that it would need steps of no time cannot be saved: the
        # others' steps do not shrink for it.
        per_token = [margin for p in progress if p.num_intervals > 0
                     if (margin := (self.tpot_target_ms * p.num_intervals - p.elapsed_ms)
                         / max(1, p.num_remaining)) > -target]
        if not per_token:
            return 0.0
        return min(MAX_SLACK_SHARE * target, max(MIN_SLACK_SHARE * target, min(per_token)))

    def rank_budget(self, cost: StepCost, num_decodes: int, num_tokens: int, *,
                    has_decodes: bool, slack_ms: float = 0.0) -> StepBudget:
        """The prefill budget of a rank whose step holds num_decodes decode rows and num_tokens
        input tokens so far (a jump-forward chunk's tokens beyond its row priced like prompt
        tokens); has_decodes: some rank of the group decodes."""
        tokens_left = self.max_batch_tokens - num_tokens
        if not has_decodes or not self.tpot_target_ms:
            return StepBudget(tokens_left, chunk_cap=self.prefill_chunk_size)
        ms_left = self.step_target_ms + slack_ms - cost.base_ms(num_decodes, num_tokens - num_decodes)
        return StepBudget(tokens_left, ms_left, self.min_prefill_tokens, self.prefill_chunk_size)

    def plan_budgets(self, cost: StepCost, decodes: Seq[int], num_tokens: Seq[int],
                     slack_ms: float = 0.0) -> list[StepBudget]:
        """Each rank's prefill budget once every rank's decodes are planned."""
        has_decodes = any(decodes)
        return [self.rank_budget(cost, d, n, has_decodes=has_decodes, slack_ms=slack_ms)
                for d, n in zip(decodes, num_tokens)]

    def prefill_rate(self, cost: StepCost, num_decodes: float) -> tuple[float, float]:
        """(prompt tokens per ms, step ms) of one rank's steps beside num_decodes decodes each."""
        decodes = math.ceil(num_decodes)
        budget = self.rank_budget(cost, decodes, decodes, has_decodes=decodes > 0)
        tokens = max(1, budget.chunk(cost, 0, self.max_batch_tokens))
        step_ms = cost.base_ms(decodes) + cost.chunk_ms(0, tokens)
        return tokens / max(1e-3, step_ms), step_ms

    def check_admission(self, cost: StepCost, *, num_tokens_ahead: int, num_prompt_tokens: int,
                        num_decodes: float, num_ranks: int, is_batch: bool) -> float:
        """The predicted TTFT (ms) of a new request with num_tokens_ahead prompt tokens to
        prefill before its own num_prompt_tokens; raises Overloaded if it is past the shedding
        bound (module docstring). num_decodes: the mean decoding requests per rank."""
        rate, _ = self.prefill_rate(cost, num_decodes)
        wait_ms = num_tokens_ahead / (num_ranks * rate)
        ttft_ms = wait_ms + num_prompt_tokens / (num_ranks * rate)
        bound_ms = self.ttft_target_ms * (1.0 if is_batch else SHED_MARGIN)
        if bound_ms and ttft_ms > bound_ms:
            what = "a batch-priority request" if is_batch else "the request"
            raise Overloaded(
                f"the gateway is overloaded: {what} would get its first token in about {ttft_ms:.0f} ms "
                f"({num_tokens_ahead} prompt tokens queued ahead of its {num_prompt_tokens}, about "
                f"{wait_ms:.0f} ms of prefill), past the {bound_ms:.0f} ms it may wait "
                f"(--ttft-target-ms {self.ttft_target_ms:g}); retry later", ttft_ms - bound_ms)
        return ttft_ms
