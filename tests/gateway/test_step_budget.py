"""The step budget and the step-cost model on the pure batcher, over simulated ranks.

The simulated ranks report step times from a known linear cost (TrueCost), so
the tests check that the model learns it from the batcher's own observations
and that the budget then keeps decode steps within the TPOT target.
"""

import random

import pytest

from gateway.requests import ErrorCode
from gateway.step_budget import (MIN_PREFILL_TOKENS, OVER_TARGET_STRETCH, TPOT_SAFETY, BudgetRule, Overloaded,
                                 StepBudget)
from gateway.step_cost import StepCostModel, StepShape
from tests.gateway.fakes import reference_tokens, run_batch
from tests.gateway.test_scheduling import Sim

# A rank whose steps cost 2 ms, 0.2 ms a decode row and 0.01 ms a prefill token.
TRUE_MS = (2.0, 0.2, 0.01)


def true_ms(shape: StepShape) -> float:
    return TRUE_MS[0] + TRUE_MS[1] * shape.num_decodes + TRUE_MS[2] * shape.num_prefill_tokens


def plan_shape(plan) -> StepShape:
    """What a rank's plan asks of it (decode rows, prefill tokens), read off the plan itself."""
    shape = StepShape()
    for item in plan.scheduled:
        if item.token_ids:
            shape.num_prefill_tokens += len(item.token_ids)
        else:
            shape.num_decodes += 1
    return shape


class TimedSim(Sim):
    """Sim whose ranks report execute times from TRUE_MS (the slowest rank's, as a group steps together)."""

    def step(self):
        batch = self.batcher.schedule()
        self.batches.append(batch)
        self._record(batch.events)
        if not batch.is_empty:
            seconds = [true_ms(plan_shape(plan)) / 1e3 for plan in batch.plans]
            self._pending.append((batch.step_id, run_batch(self.ranks, batch), None, None, seconds))
        while len(self._pending) >= self.depth or (self._pending and batch.is_empty):
            self._record(self.batcher.apply_results(*self._pending.popleft()))
        return batch


def make_sim(num_ranks=1, **kwargs) -> TimedSim:
    defaults = dict(num_blocks=1024, block_size=16, max_running_requests=64, max_batch_tokens=4096,
                    max_context=10_000, tpot_target_ms=10.0)
    return TimedSim(num_ranks, **{**defaults, **kwargs})


def prompt(n: int, salt: int) -> list[int]:
    return [(salt * 7 + i) % 50 + 30 for i in range(n)]


def known_model() -> StepCostModel:
    """A model already fit to TRUE_MS (per scaled unit: rows per 100, tokens per 1,000)."""
    return StepCostModel((TRUE_MS[0], TRUE_MS[1] * 100, TRUE_MS[2] * 1000, 0.0))


# The cost model alone.

def test_the_model_learns_a_linear_step_cost_from_observations():
    model = StepCostModel()
    rng = random.Random(0)
    truth = lambda s: 1.5 + 0.05 * s.num_decodes + 0.02 * s.num_prefill_tokens + 2e-6 * s.attention_pairs
    for _ in range(400):
        shape = StepShape(num_decodes=rng.randrange(0, 200))
        if rng.random() < 0.6:
            shape.add_chunk(rng.randrange(0, 4000), rng.randrange(1, 3000))
        model.observe(shape, truth(shape) * rng.uniform(0.97, 1.03))
    for decodes, start, tokens in [(0, 0, 4096), (150, 0, 0), (40, 3000, 1000), (1, 0, 1)]:
        shape = StepShape(num_decodes=decodes)
        if tokens:
            shape.add_chunk(start, tokens)
        assert model.predict_ms(shape) == pytest.approx(truth(shape), rel=0.1)
    assert model.num_observed == 400


def test_one_outlier_step_moves_the_fit_little_and_bad_times_are_ignored():
    model = known_model()
    shape = StepShape(num_decodes=50)
    before = model.predict_ms(shape)
    model.observe(shape, 1e4)               # a cold step, a thousand times too slow
    assert model.predict_ms(shape) <= 2.5 * before
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        model.observe(shape, bad)
    assert model.num_observed == 1


def test_tokens_within_inverts_the_chunk_cost_with_attention():
    model = StepCostModel((1.0, 10.0, 10.0, 5.0))
    for ms, start in [(30.0, 0), (30.0, 6000), (0.5, 100)]:
        n = model.tokens_within(ms, start)
        assert model.chunk_ms(start, n) <= ms < model.chunk_ms(start, n + 1)
    # Deeper into a prompt a chunk attends to more context: fewer tokens for the same time.
    assert model.tokens_within(30.0, 6000) < model.tokens_within(30.0, 0)
    assert model.tokens_within(0.0, 0) == 0


def test_a_model_that_saw_no_prefill_never_promises_an_unbounded_chunk():
    model = StepCostModel((0.0, 0.0, 0.0, 0.0))
    assert 0 < model.tokens_within(10.0, 0) < 1e6


# The budget rule.

def test_without_decodes_prefill_takes_the_whole_step_and_with_them_what_the_target_leaves():
    rule, model = BudgetRule(8192, tpot_target_ms=40.0), known_model()
    idle = rule.rank_budget(model, StepShape(), 0, has_decodes=False)
    assert idle.chunk(model, 0, 10_000) == 8192
    decodes = StepShape(num_decodes=100)
    budget = rule.rank_budget(model, decodes, 100, has_decodes=True)
    expected = int((40.0 * TPOT_SAFETY - true_ms(decodes)) / TRUE_MS[2])
    assert abs(budget.chunk(model, 0, 10_000) - expected) <= 1
    # Once chunks spent its time, only the floor is left, and then nothing.
    budget.take(model, 0, budget.chunk(model, 0, 10_000))
    assert budget.chunk(model, 0, 10_000) == 0 and budget.is_spent
    # At the target, only the floor: prompts still advance.
    at_target = StepShape(num_decodes=int((40.0 * TPOT_SAFETY - TRUE_MS[0]) / TRUE_MS[1]))
    assert rule.rank_budget(model, at_target, 150, has_decodes=True).chunk(model, 0, 10_000) == MIN_PREFILL_TOKENS
    # A decode load that alone exceeds the target lets prefill stretch the step by half the excess.
    heavy = StepShape(num_decodes=400)
    excess_ms = true_ms(heavy) - 40.0 * TPOT_SAFETY
    chunk = rule.rank_budget(model, heavy, 400, has_decodes=True).chunk(model, 0, 10_000)
    assert abs(chunk - int(OVER_TARGET_STRETCH * excess_ms / TRUE_MS[2])) <= 1 and chunk > MIN_PREFILL_TOKENS
    # Off: the whole token budget even beside decodes.
    off = BudgetRule(8192, tpot_target_ms=0.0).rank_budget(model, decodes, 100, has_decodes=True)
    assert off.chunk(model, 0, 10_000) == 8092


def test_step_budget_counts_chunks_at_their_context():
    model = StepCostModel((0.0, 0.0, 10.0, 1.0))
    budget = StepBudget(tokens_left=8192, ms_left=20.0)
    near, far = budget.chunk(model, 0, 8192), budget.chunk(model, 8000, 8192)
    assert far < near
    budget.take(model, 8000, far)
    assert budget.ms_left == pytest.approx(20.0 - model.chunk_ms(8000, far))
    assert budget.tokens_left == 8192 - far


def test_bad_budget_settings_are_refused_naming_the_value():
    with pytest.raises(ValueError, match="tpot_target_ms must be >= 0 .* got -1"):
        BudgetRule(8192, tpot_target_ms=-1)
    with pytest.raises(ValueError, match="max_queue_delay_ms .* got inf"):
        BudgetRule(8192, max_queue_delay_ms=float("inf"))


# On the batcher.

def test_a_long_prompt_on_an_idle_batcher_is_one_step():
    sim = make_sim()
    sim.add(prompt(3000, 1), 3)
    first = sim.step()
    assert first.plans[0].num_tokens == 3000
    sim.run()
    assert sim.tokens[1] == reference_tokens(prompt(3000, 1), 3)


def test_beside_decodes_chunks_keep_each_step_within_the_tpot_target():
    sim = make_sim(max_batch_tokens=4096, tpot_target_ms=10.0)
    sim.batcher.cost_model = known_model()
    for i in range(20):                                 # 20 decoding requests
        sim.add(prompt(8, i), 60)
    sim.step()
    sim.step()
    sim.add(prompt(3000, 99), 2)                         # then a long prompt
    chunks = []
    for _ in range(20):
        batch = sim.step()
        shape = plan_shape(batch.plans[0])
        if shape.num_prefill_tokens:
            chunks.append(shape.num_prefill_tokens)
            assert true_ms(shape) <= 10.0 * TPOT_SAFETY + 1e-6
    assert sum(chunks) == 3000 and len(chunks) > 1      # spread over steps, not one 3000-token step
    budget = int((10.0 * TPOT_SAFETY - true_ms(StepShape(num_decodes=20))) / TRUE_MS[2])
    assert max(chunks) >= budget - 1                    # and each step filled to its budget
    sim.run()
    assert sim.tokens[21] == reference_tokens(prompt(3000, 99), 2)
    assert all(sim.tokens[i + 1] == reference_tokens(prompt(8, i), 60) for i in range(20))


def test_one_ranks_decodes_limit_every_ranks_prefill():
    sim = make_sim(num_ranks=2, tpot_target_ms=10.0)
    sim.batcher.cost_model = known_model()
    sim.add(prompt(8, 1), 40)           # rank 0 decodes from the next step on
    sim.step()
    sim.add(prompt(3000, 2), 2)         # placed on the idle rank 1
    batch = sim.step()
    assert [len(p.new_sequences) for p in batch.plans] == [0, 1]
    assert plan_shape(batch.plans[1]).num_prefill_tokens < 3000
    assert true_ms(plan_shape(batch.plans[1])) <= 10.0 * TPOT_SAFETY


def test_the_batcher_fits_its_model_to_the_ranks_step_times():
    sim = make_sim(max_batch_tokens=2048, tpot_target_ms=10.0)
    for i in range(30):
        sim.add(prompt(200 + 37 * i, i), 5 + i % 7)
    sim.run()
    model = sim.batcher.cost_model
    assert model.num_observed == len(sim.batches) - 1  # all but the last, which only forgets
    # Right where the batcher plans (its steps sit on the budget line, where decode rows
    # and prefill tokens trade off, so that is what the fit pins down)...
    for batch in sim.batches[len(sim.batches) // 2:-1]:
        shape = plan_shape(batch.plans[0])
        assert model.predict_ms(shape) == pytest.approx(true_ms(shape), rel=0.05)
    # ... and the price of a prefill token, which the budget divides by.
    assert sim.batcher.stats.step_cost_ms["per_1k_prefill_tokens"] == pytest.approx(1e3 * TRUE_MS[2], rel=0.1)


def test_prefill_chunk_size_still_caps_one_sequences_chunk():
    sim = make_sim(prefill_chunk_size=512)
    sim.add(prompt(1500, 1), 2)
    assert [b.plans[0].num_tokens for b in (sim.step(), sim.step(), sim.step())] == [512, 512, 476]


# Admission under overload.

def test_a_request_whose_predicted_wait_exceeds_the_bound_is_refused_with_a_retry_hint():
    sim = make_sim(max_batch_tokens=1000, max_queue_delay_ms=40.0, tpot_target_ms=0.0)
    sim.batcher.cost_model = known_model()    # 1000 tokens a step of 12 ms: ~83 tokens/ms
    added = [sim.add(prompt(1000, i), 1) for i in range(4)]   # ~48 ms of prefill queued
    with pytest.raises(Overloaded) as err:
        sim.add(prompt(1000, 9), 1)
    assert err.value.code is ErrorCode.RESOURCE_EXHAUSTED and "max_queue_delay_ms 40" in err.value.message
    assert 0 < err.value.retry_after_ms < 100 and not err.value.is_queue_full
    assert sim.batcher.stats.num_rejected_overload == 1 and sim.batcher.num_waiting == 4
    sim.step()                                # the queue drains: room again
    sim.add(prompt(1000, 10), 1)
    sim.run()
    assert all(sim.tokens[i + 1] == reference_tokens(prompt(1000, i), 1) for i in range(len(added)))


def test_batch_class_requests_are_refused_first():
    class Batch:  # a request of the batch priority class (ValidatedRequest.is_batch, where the API has it)
        def __init__(self, request):
            self._request = request
            self.is_batch = True

        def __getattr__(self, name):
            return getattr(self._request, name)

    from gateway.requests import Sequence
    from services.text import IncrementalDetokenizer
    from tests.gateway.fakes import FakeTokenizer, make_request

    sim = make_sim(max_batch_tokens=1000, max_queue_delay_ms=50.0, tpot_target_ms=0.0)
    sim.batcher.cost_model = known_model()
    sim.add(prompt(1000, 0), 1)
    sim.add(prompt(1000, 1), 1)
    sim.add(prompt(1000, 4), 1)                # ~36 ms queued: within 50, beyond 25
    batcher = sim.batcher
    request = Batch(make_request(prompt_ids=prompt(1000, 2), max_new_tokens=1))
    with pytest.raises(Overloaded, match="for batch-class requests"):
        batcher.add(Sequence(batcher.new_seq_id(), request, IncrementalDetokenizer(FakeTokenizer())))
    sim.add(prompt(1000, 3), 1)                # an interactive one still queues


def test_a_full_queue_is_refused_with_the_limit_and_a_hint():
    sim = make_sim(max_waiting_requests=2, max_queue_delay_ms=0.0)
    sim.add(prompt(10, 0), 1)
    sim.add(prompt(10, 1), 1)
    with pytest.raises(Overloaded, match="max_waiting_requests 2") as err:
        sim.add(prompt(10, 2), 1)
    assert err.value.is_queue_full and err.value.retry_after_ms >= 50
    assert sim.batcher.stats.num_rejected_queue_full == 1
