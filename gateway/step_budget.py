"""How much prefill each step carries, and whether a new request can still be served in time.

The step budget (per rank, per step), from the step-cost model (gateway/step_cost.py):
- With no decode anywhere in the group, prefill gets the whole max_batch_tokens:
  a 4K prompt on an idle mesh is one step, not eight (a bigger step is also
  a more efficient one). The ranks of a group step together (their expert
  collectives), so one rank's decodes make every rank's step count.
- With decodes, a step may take `tpot_target_ms * TPOT_SAFETY` as predicted by the model:
  prefill chunks get what the rank's decodes leave of it, priced per token and
  by the context they attend to, so running requests keep their time per
  output token while prompts are prefilled beside them. Prefill still gets at
  least `MIN_PREFILL_TOKENS` per rank and step, so that prompts always advance.
  Where the decodes alone take longer than the target (it cannot be met: a
  slow device, or more running requests than it allows), holding prompts back
  would only add TTFT misses to the TPOT ones: prefill may then stretch the
  step by `OVER_TARGET_STRETCH` of the excess (continuous at the target).
- Chunks are cut from that budget in the batcher's order (oldest first);
  prefill_chunk_size, if set, caps one sequence's chunk as well.

Admission under overload (`check_admission`): a new request's queueing delay is
predicted as the prefill tokens ahead of it (waiting prompts plus the rest of
those being prefilled) over the group's prefill rate at the current decode
load. Past max_queue_delay_ms, or with the waiting queue full, it is refused
with `Overloaded` (RESOURCE_EXHAUSTED and a retry hint) before any model work:
it would miss its TTFT anyway, and queueing it would make those behind it miss
theirs. Batch-class requests (the request's `is_batch`, where the API has
priority classes) are refused at half those bounds, so that interactive ones
keep the other half of the headroom.
"""

import dataclasses
import math
from collections.abc import Sequence as Seq

from gateway.plan import RankPlan
from gateway.requests import ErrorCode, GenerationError
from gateway.step_cost import StepCostModel, StepShape

# The share of the TPOT target a predicted step may use: the model's error, and
# the gateway's own time per step, take the rest.
TPOT_SAFETY = 0.8
# Prefill tokens a rank's step always gets (see the module docstring).
MIN_PREFILL_TOKENS = 128
# Past the target, the prefill ms a step gets per ms its decodes exceed it.
OVER_TARGET_STRETCH = 0.5
# Batch-class requests are refused at this share of the delay bound and of the queue.
BATCH_SHARE = 0.5
# The least retry hint: sooner, a refused client would mostly be refused again.
MIN_RETRY_AFTER_MS = 50


class Overloaded(GenerationError):
    """RESOURCE_EXHAUSTED for a request refused under load; retry_after_ms: when to try again;
    is_queue_full: refused for the queue's length rather than its predicted delay."""

    def __init__(self, message: str, retry_after_ms: int, *, is_queue_full: bool = False) -> None:
        super().__init__(ErrorCode.RESOURCE_EXHAUSTED, message)
        self.retry_after_ms = max(MIN_RETRY_AFTER_MS, retry_after_ms)
        self.is_queue_full = is_queue_full


@dataclasses.dataclass(slots=True)
class StepBudget:
    """What prefill may still add to one rank's step: tokens, predicted ms, and the
    tokens guaranteed whatever the ms (math.inf ms: no decode to protect)."""

    tokens_left: int
    ms_left: float = math.inf
    floor_left: int = 0

    def chunk(self, model: StepCostModel, start: int, num_remaining: int) -> int:
        """The tokens of a prompt at position start (num_remaining left) this step may take."""
        by_time = num_remaining if self.ms_left == math.inf else model.tokens_within(self.ms_left, start)
        return max(0, min(num_remaining, self.tokens_left, max(self.floor_left, by_time)))

    def take(self, model: StepCostModel, start: int, num_tokens: int) -> None:
        """Counts a chunk of num_tokens tokens from position start as planned."""
        self.tokens_left -= num_tokens
        self.floor_left = max(0, self.floor_left - num_tokens)
        if self.ms_left != math.inf:
            self.ms_left -= model.chunk_ms(start, num_tokens)

    @property
    def is_spent(self) -> bool:
        return self.tokens_left <= 0 or (self.ms_left <= 0 and self.floor_left <= 0)


@dataclasses.dataclass(frozen=True, slots=True)
class BudgetRule:
    """The settings of the step budget and of admission (GatewayConfig's)."""

    max_batch_tokens: int
    # 0: no decode latency budget (every step may fill max_batch_tokens).
    tpot_target_ms: float = 40.0
    # 0: no shedding on predicted delay (only a full queue refuses).
    max_queue_delay_ms: float = 3000.0

    def __post_init__(self) -> None:
        if self.max_batch_tokens <= 0:
            raise ValueError(f"max_batch_tokens must be positive, got {self.max_batch_tokens}")
        for name in ("tpot_target_ms", "max_queue_delay_ms"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be >= 0 (0: off), got {getattr(self, name)}")

    def rank_budget(self, model: StepCostModel, shape: StepShape, num_tokens: int, *,
                    has_decodes: bool) -> StepBudget:
        """The prefill budget of a rank whose step holds `shape` (its decodes) and
        num_tokens input tokens so far; has_decodes: some rank of the group decodes."""
        tokens_left = self.max_batch_tokens - num_tokens
        if not has_decodes or not self.tpot_target_ms:
            return StepBudget(tokens_left)
        target_ms, decode_ms = self.tpot_target_ms * TPOT_SAFETY, model.predict_ms(shape)
        ms_left = max(target_ms - decode_ms, OVER_TARGET_STRETCH * (decode_ms - target_ms))
        return StepBudget(tokens_left, ms_left, MIN_PREFILL_TOKENS)

    def plan_budgets(self, model: StepCostModel, plans: Seq[RankPlan], shapes: Seq[StepShape]) -> list[StepBudget]:
        """Each rank's prefill budget once every rank's decodes are planned (shapes: their work,
        to which a jump-forward chunk's forced tokens are added, priced like prefill tokens)."""
        for plan, shape in zip(plans, shapes):
            shape.num_prefill_tokens += plan.num_tokens - len(plan.scheduled)
        has_decodes = any(plan.scheduled for plan in plans)
        return [self.rank_budget(model, shape, plan.num_tokens, has_decodes=has_decodes)
                for plan, shape in zip(plans, shapes)]

    def prefill_rate(self, model: StepCostModel, num_decodes: float) -> float:
        """Prefill tokens per ms one rank achieves beside num_decodes decodes per step."""
        decodes = StepShape(num_decodes=math.ceil(num_decodes))
        budget = self.rank_budget(model, decodes, decodes.num_decodes, has_decodes=num_decodes > 0)
        tokens = max(1, budget.chunk(model, 0, self.max_batch_tokens))
        decodes.add_chunk(0, tokens)
        return tokens / max(1e-3, model.predict_ms(decodes))

    def check_admission(self, model: StepCostModel, *, num_prefill_tokens_ahead: int, num_decodes: float,
                        num_ranks: int, num_waiting: int, max_waiting: int, is_batch: bool = False,
                        is_delay_checked: bool = True) -> None:
        """Raises Overloaded if a new request should not queue (module docstring); num_decodes:
        the mean running decodes per rank; is_delay_checked False: only the queue's length counts."""
        share = BATCH_SHARE if is_batch else 1.0
        what = "batch-class requests" if is_batch else "requests"
        delay_ms = num_prefill_tokens_ahead / (num_ranks * self.prefill_rate(model, num_decodes))
        if num_waiting >= max(1, int(max_waiting * share)):
            raise Overloaded(
                f"the gateway's waiting queue is full ({num_waiting} requests wait, max_waiting_requests "
                f"{max_waiting}{', half of it for ' + what if is_batch else ''}); retry later",
                math.ceil(delay_ms / max(1, num_waiting)), is_queue_full=True)
        bound_ms = self.max_queue_delay_ms * share
        if is_delay_checked and bound_ms and delay_ms > bound_ms:
            raise Overloaded(
                f"the gateway is overloaded: a new request would wait about {delay_ms:.0f} ms for its "
                f"prefill ({num_prefill_tokens_ahead} prompt tokens ahead), more than max_queue_delay_ms "
                f"{bound_ms:.0f} for {what}; retry later", math.ceil(delay_ms - bound_ms))
