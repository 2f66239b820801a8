"""How much prefill each step carries, and whether a new request can still be served in time.

The step budget (per rank and step), priced by the cost model (gateway/step_cost.py):
- No interactive request decodes in the group: prefill gets all of
  max_batch_tokens. The ranks of a group step together (their expert
  collectives), so one rank's decodes make every rank's step count.
- With decodes, the SLO is on each request's MEAN time per output token, so
  the step may be as long as the tightest decoding request allows
  (`allowance_ms`): its margin against `tpot_target_ms * TPOT_SHARE` a token
  so far (the rest of the target is the model's error and the gateway's own
  time), plus what one decode-only step after this one would win back. Prefill
  chunks get what the decodes leave of that. A step with prefill costs at
  least the cost model's floor (an eager step's own cost): where the allowance
  does not cover it, the step is decode-only and the requests gain the time a
  longer prefill step then spends, so prefill steps alternate with cheap
  decode steps and fill what the pair allows, instead of every step carrying
  a little prefill at the floor's price.
- Prompts are never starved: a step after one that held them back prefills
  whatever the allowance, at least `min_prefill_tokens` and up to the floor.
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
from gateway.step_cost import StepCost, StepShape

# The share of the TPOT target a predicted step may use (see the module docstring).
TPOT_SHARE = 0.9
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
    # Tokens it may still generate after the step being planned.
    num_remaining: int
    # Its tokens of earlier steps still in flight (results not applied yet).
    num_in_flight: int = 0
    # False while its first token has not arrived (the step being planned is its first interval).
    has_first_token: bool = True


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
        """The mean step length aimed at while requests decode."""
        return self.tpot_target_ms * TPOT_SHARE

    def allowance_ms(self, progress: Iterable[DecodeProgress], *, decode_step_ms: float,
                     in_flight_ms: float = 0.0) -> float:
        """The longest the next step may be for every decoding request to keep its mean time per
        output token at the step target: the tightest request's margin so far (its target
        times its intervals after this step, less their time, the step in flight counted at
        in_flight_ms), plus what one decode-only step of decode_step_ms after this one would
        win back where the request has a token left for it. A request whose margin does not
        even cover a decode-only step cannot be saved and is left out."""
        target = self.step_target_ms
        recovery = max(0.0, target - decode_step_ms)
        tightest = math.inf
        for p in progress:
            if p.has_first_token:
                intervals = p.num_intervals + p.num_in_flight + 1
                margin = target * intervals - p.elapsed_ms - p.num_in_flight * in_flight_ms
            else:
                margin = target
            margin += recovery * min(1, p.num_remaining)
            if margin >= decode_step_ms:
                tightest = min(tightest, margin)
        return target if tightest == math.inf else tightest

    def rank_budget(self, cost: StepCost, num_decodes: int, num_tokens: int, *, has_decodes: bool,
                    allowance_ms: float | None = None, is_forced: bool = False) -> StepBudget:
        """The prefill budget of a rank whose step holds num_decodes decode rows and num_tokens
        input tokens so far (a jump-forward chunk's tokens beyond its row priced like prompt
        tokens); has_decodes: some interactive request of the group decodes; allowance_ms: how
        long the step may be (allowance_ms(), default the step target); is_forced: the last
        step held prompts back, so this one prefills whatever the allowance."""
        tokens_left = self.max_batch_tokens - num_tokens
        if not has_decodes or not self.tpot_target_ms:
            return StepBudget(tokens_left, chunk_cap=self.prefill_chunk_size)
        allowance = self.step_target_ms if allowance_ms is None else allowance_ms
        base_ms = cost.base_ms(num_decodes, num_tokens - num_decodes)
        if allowance >= max(cost.floor_ms, base_ms):
            return StepBudget(tokens_left, allowance - base_ms, 0, self.prefill_chunk_size)
        if is_forced:  # a step with prefill costs the floor anyway: it may fill it
            return StepBudget(tokens_left, max(cost.floor_ms, allowance) - base_ms, self.min_prefill_tokens,
                              self.prefill_chunk_size)
        return StepBudget(0)   # a decode-only step: the decoding requests win back time for the next

    def plan_budgets(self, cost: StepCost, decodes: Seq[int], num_tokens: Seq[int], *,
                     allowance_ms: float | None = None, is_forced: bool = False) -> list[StepBudget]:
        """Each rank's prefill budget once every rank's decodes are planned."""
        has_decodes = any(decodes)
        return [self.rank_budget(cost, d, n, has_decodes=has_decodes, allowance_ms=allowance_ms,
                                 is_forced=is_forced) for d, n in zip(decodes, num_tokens)]

    def prefill_rate(self, cost: StepCost, num_decodes: float) -> tuple[float, float]:
        """(prompt tokens per ms, ms per prefill step) of one rank beside num_decodes decodes a
        step, in the steady state of the budget: a prefill step as long as its allowance with a
        decode-only step after it, or, where the floor exceeds the allowance, every other step."""
        decodes = math.ceil(num_decodes)
        if not decodes or not self.tpot_target_ms:   # several sequences' chunks fill a step: no cap
            budget = dataclasses.replace(self.rank_budget(cost, decodes, decodes, has_decodes=False), chunk_cap=0)
            tokens = max(1, budget.chunk(cost, 0, self.max_batch_tokens))
            step_ms = cost.step_ms(_shape(decodes, tokens))
            return tokens / max(1e-3, step_ms), step_ms
        decode_ms = cost.decode_step_ms(decodes)
        allowance = self.step_target_ms + max(0.0, self.step_target_ms - decode_ms)
        budget = self.rank_budget(cost, decodes, decodes, has_decodes=True, allowance_ms=allowance, is_forced=True)
        tokens = max(1, budget.chunk(cost, 0, self.max_batch_tokens))
        step_ms = cost.step_ms(_shape(decodes, tokens))
        period_ms = step_ms + (decode_ms if step_ms > self.step_target_ms else 0.0)
        return tokens / max(1e-3, period_ms), step_ms

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


def _shape(num_decodes: int, num_prefill_tokens: int) -> StepShape:
    shape = StepShape(num_decodes)
    shape.add_chunk(0, num_prefill_tokens)
    return shape
