"""The step budget and the step-cost model, alone and in the pure batcher: prefill per step
from the TPOT target, the slack of the decoding requests, the prefill floor, priorities,
and shedding on predicted TTFT."""

import dataclasses
import math

import pytest

from gateway.requests import ErrorCode, GenerationError
from gateway.step_budget import BudgetRule, DecodeProgress, MIN_RETRY_AFTER_MS, Overloaded, SHED_MARGIN, TPOT_SHARE
from gateway.step_cost import (DECODE_MS, FIXED_MS, MAX_DECODE_SCALE, MAX_FLOOR_MS, MAX_SCALE, MIN_SCALE, StepCost,
                               StepShape)
from tests.gateway.fakes import make_request
from tests.gateway.test_batcher import add, make_batcher, step

COST = StepCost()


# The cost model.

def test_the_priors_price_the_measured_h200_steps_within_ten_percent():
    alone = StepShape()
    alone.add_chunk(0, 4096)
    mixed = StepShape(num_decodes=256)
    mixed.add_chunk(0, 3840)
    for shape, measured_ms in ((alone, 51.8), (mixed, 74.4), (StepShape(num_decodes=256), 26.1)):
        assert COST.predict_ms(shape) == pytest.approx(measured_ms, rel=0.1), shape


@pytest.mark.parametrize("start", [0, 1000, 7000])
@pytest.mark.parametrize("ms", [0.5, 10.0, 30.0])
def test_tokens_within_is_the_largest_chunk_whose_cost_fits(start, ms):
    cost = StepCost(scale=1.3)
    n = cost.tokens_within(ms, start)
    assert cost.chunk_ms(start, n) <= ms < cost.chunk_ms(start, n + 1)
    assert cost.tokens_within(0.0, start) == cost.tokens_within(-1.0, start) == 0


def test_a_chunk_deeper_into_its_prompt_costs_more():
    assert COST.chunk_ms(6000, 1000) > COST.chunk_ms(0, 1000) > 0
    assert COST.tokens_within(20.0, 6000) < COST.tokens_within(20.0, 0)


def shapes_of(*sizes: int) -> list[StepShape]:
    """Steps of 10 decodes and one prompt chunk of each size."""
    out = []
    for size in sizes:
        shape = StepShape(num_decodes=10)
        shape.add_chunk(0, size)
        out.append(shape)
    return out


def fit(cost: StepCost, steps: list[StepShape], device, rounds: int) -> None:
    """Observes every step rounds times, each as long as device(its prior work in ms)."""
    for _ in range(rounds):
        for shape in steps:
            cost.observe(shape, device(StepCost().predict_ms(shape)))


def test_the_fit_follows_steps_with_prefill_but_never_leaves_its_bounds():
    steps = shapes_of(300, 2000, 1000, 4000)
    cost = StepCost()
    fit(cost, steps, lambda work: 1.5 * work, 200)             # work-bound, 1.5 times the priors
    assert cost.scale == pytest.approx(1.5, rel=0.02)
    # A low quantile of the steps' times: under the middle ones'.
    assert cost.floor_ms < 1.5 * StepCost().predict_ms(steps[2])
    fit(cost, steps, lambda work: 0.01 * work, 300)            # a misleading measure: the bound only
    assert cost.scale == pytest.approx(MIN_SCALE)
    # Decode-only steps, and nonsense times, leave it alone.
    cost.observe(StepShape(num_decodes=200), 1.0)
    assert not cost.observe(steps[1], 0.0) and not cost.observe(steps[1], math.inf)
    assert cost.scale == pytest.approx(MIN_SCALE)


def test_a_floor_under_every_step_with_prefill_is_learnt_and_not_taken_for_slow_work():
    steps = shapes_of(300, 1300, 2500, 1000, 6000)             # ~6 to ~100 ms of work
    cost = StepCost()
    fit(cost, steps, lambda work: max(45.0, work), 100)
    assert cost.floor_ms == pytest.approx(45.0, rel=0.1) and cost.scale == pytest.approx(1.0, rel=0.02)
    assert cost.step_ms(steps[0]) == cost.floor_ms
    assert cost.step_ms(steps[-1]) == cost.predict_ms(steps[-1]) > 1.5 * 45.0
    # Steps of one size at the floor: the floor explains them, the scale stays.
    fit(cost, shapes_of(1300), lambda work: 50.0, 200)
    assert cost.floor_ms == pytest.approx(50.0, rel=0.02) and cost.scale == pytest.approx(1.0, rel=0.02)
    fit(cost, shapes_of(300), lambda work: 1e4, 200)
    assert cost.floor_ms == pytest.approx(MAX_FLOOR_MS)
    fit(cost, shapes_of(300), lambda work: 5.0, 40)            # faster than the floor: it comes down fast
    assert cost.floor_ms == pytest.approx(5.0, rel=0.01)


def test_decode_only_steps_have_their_own_bounded_scale():
    cost = StepCost()
    decodes = StepShape(num_decodes=100)
    for _ in range(300):
        cost.observe(decodes, 2 * (FIXED_MS + DECODE_MS * 100))
    assert cost.decode_scale == pytest.approx(2.0, rel=1e-3) and cost.scale == 1.0
    assert cost.step_ms(decodes) == pytest.approx(cost.decode_step_ms(100)) == pytest.approx(2 * (FIXED_MS + 9.0))
    for _ in range(300):
        cost.observe(decodes, 1e4)
    assert cost.decode_scale == pytest.approx(MAX_DECODE_SCALE)


def test_bad_coefficients_are_refused():
    with pytest.raises(ValueError, match="token_ms must be positive"):
        StepCost(token_ms=0.0)
    with pytest.raises(ValueError, match="pair_ms"):
        StepCost(pair_ms=-1.0)
    assert StepCost(scale=10.0).scale == MAX_SCALE


# The budget rule.

RULE = BudgetRule(max_batch_tokens=8192, tpot_target_ms=40.0, ttft_target_ms=500.0, min_prefill_tokens=1024)


def test_without_decodes_prefill_gets_the_whole_token_budget():
    budget = RULE.rank_budget(COST, 0, 0, has_decodes=False)
    assert budget.chunk(COST, 0, 10_000) == 8192 and budget.ms_left == math.inf


def test_beside_decodes_prefill_gets_what_the_tpot_target_leaves():
    budget = RULE.rank_budget(COST, 32, 32, has_decodes=True)
    n = budget.chunk(COST, 0, 8000)
    target = 40.0 * TPOT_SHARE
    step_ms = COST.base_ms(32) + COST.chunk_ms(0, n)
    assert step_ms <= target < COST.base_ms(32) + COST.chunk_ms(0, n + 1)
    assert 2000 < n < 4000    # the scale the production mix needs beside its decodes
    budget.take(COST, 0, n)
    assert budget.chunk(COST, n, 1000) == 0


def test_where_the_decodes_leave_no_room_the_step_is_decode_only_and_the_next_one_prefills():
    budget = RULE.rank_budget(COST, 400, 400, has_decodes=True)   # the decodes alone exceed the target
    assert budget.chunk(COST, 0, 5000) == 0 and budget.is_spent
    forced = RULE.rank_budget(COST, 400, 400, has_decodes=True, is_forced=True)
    assert forced.chunk(COST, 0, 5000) == 1024
    forced.take(COST, 0, 1000)
    assert forced.chunk(COST, 1000, 5000) == 24
    forced.take(COST, 1000, 24)
    assert forced.is_spent


def test_a_step_that_cannot_pay_the_floor_is_decode_only_and_a_forced_one_fills_the_floor():
    cost = StepCost(floor_ms=50.0)
    assert RULE.rank_budget(cost, 16, 16, has_decodes=True).chunk(cost, 0, 9000) == 0      # 36 ms < 50
    forced = RULE.rank_budget(cost, 16, 16, has_decodes=True, is_forced=True).chunk(cost, 0, 9000)
    assert cost.base_ms(16) + cost.chunk_ms(0, forced) <= 50.0 < cost.base_ms(16) + cost.chunk_ms(0, forced + 1)
    # After a decode-only step the requests allow a step past the floor: it is filled to that.
    allowed = RULE.rank_budget(cost, 16, 16, has_decodes=True, allowance_ms=64.0).chunk(cost, 0, 9000)
    assert cost.base_ms(16) + cost.chunk_ms(0, allowed) <= 64.0 < cost.base_ms(16) + cost.chunk_ms(0, allowed + 1)


def test_a_chunk_never_exceeds_the_tokens_left_nor_the_per_sequence_cap():
    capped = dataclasses.replace(RULE, prefill_chunk_size=512)
    assert capped.rank_budget(COST, 0, 0, has_decodes=False).chunk(COST, 0, 4096) == 512
    assert capped.rank_budget(COST, 4, 4, has_decodes=True).chunk(COST, 0, 4096) == 512
    small = dataclasses.replace(RULE, max_batch_tokens=10)
    assert small.rank_budget(COST, 3, 3, has_decodes=True).chunk(COST, 0, 4096) == 7


def test_an_off_tpot_target_lets_every_step_fill_max_batch_tokens():
    off = dataclasses.replace(RULE, tpot_target_ms=0.0)
    assert off.rank_budget(COST, 100, 100, has_decodes=True).chunk(COST, 0, 9000) == 8092


def test_plan_budgets_protects_every_rank_when_one_decodes():
    budgets = RULE.plan_budgets(COST, [0, 16], [0, 16])
    assert all(b.ms_left < math.inf for b in budgets)
    assert RULE.plan_budgets(COST, [0, 0], [0, 0])[0].ms_left == math.inf


def test_the_allowance_is_the_tightest_requests_margin_plus_one_decode_steps_recovery():
    target = 40.0 * TPOT_SHARE
    decode_ms = 6.0
    recovery = target - decode_ms
    ahead = DecodeProgress(num_intervals=10, elapsed_ms=200.0, num_remaining=20)    # 10 ms a token so far
    behind = DecodeProgress(num_intervals=10, elapsed_ms=380.0, num_remaining=30)
    fresh = DecodeProgress(num_intervals=0, elapsed_ms=0.0, num_remaining=31, has_first_token=False)
    assert RULE.allowance_ms([ahead], decode_step_ms=decode_ms) == pytest.approx(11 * target - 200.0 + recovery)
    assert RULE.allowance_ms([ahead, behind, fresh], decode_step_ms=decode_ms) == pytest.approx(
        11 * target - 380.0 + recovery)
    assert RULE.allowance_ms([fresh], decode_step_ms=decode_ms) == pytest.approx(target + recovery)
    assert RULE.allowance_ms([], decode_step_ms=decode_ms) == target
    # Its last token: no decode-only step after this one to win time back.
    last = DecodeProgress(num_intervals=10, elapsed_ms=10 * target, num_remaining=0)
    assert RULE.allowance_ms([ahead, last], decode_step_ms=decode_ms) == pytest.approx(target)
    # A token still in flight counts at the in-flight step's predicted time.
    flying = DecodeProgress(num_intervals=10, elapsed_ms=10 * target, num_remaining=5, num_in_flight=1)
    assert RULE.allowance_ms([flying], decode_step_ms=decode_ms, in_flight_ms=50.0) == pytest.approx(
        12 * target - 10 * target - 50.0 + recovery)
    # One too far behind to be saved by any step is left out.
    lost = DecodeProgress(num_intervals=10, elapsed_ms=5000.0, num_remaining=2)
    assert RULE.allowance_ms([ahead, lost], decode_step_ms=decode_ms) == pytest.approx(11 * target - 200.0 + recovery)


def test_bad_rules_are_refused():
    with pytest.raises(ValueError, match="tpot_target_ms"):
        BudgetRule(64, tpot_target_ms=-1.0)
    with pytest.raises(ValueError, match="min_prefill_tokens"):
        BudgetRule(64, min_prefill_tokens=-1)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        BudgetRule(0)


# Shedding.

def test_admission_predicts_the_ttft_and_sheds_interactive_requests_past_twice_the_target():
    rate, step_ms = RULE.prefill_rate(COST, 0)
    assert rate == pytest.approx(8192 / step_ms)
    ttft = RULE.check_admission(COST, num_tokens_ahead=0, num_prompt_tokens=4096, num_decodes=0,
                                num_ranks=1, is_batch=False)
    assert ttft == pytest.approx(4096 / rate)
    # Just within, then just past, the interactive bound.
    within = int(SHED_MARGIN * 500 * rate) - 4096 - 10
    RULE.check_admission(COST, num_tokens_ahead=within, num_prompt_tokens=4096, num_decodes=0, num_ranks=1,
                         is_batch=False)
    with pytest.raises(Overloaded) as refused:
        RULE.check_admission(COST, num_tokens_ahead=within + 100, num_prompt_tokens=4096, num_decodes=0,
                             num_ranks=1, is_batch=False)
    error = refused.value
    assert isinstance(error, GenerationError) and error.code is ErrorCode.RESOURCE_EXHAUSTED
    assert f"{within + 100} prompt tokens queued ahead" in error.message and "--ttft-target-ms 500" in error.message
    assert error.retry_after_ms == MIN_RETRY_AFTER_MS          # only just past: the least hint
    # Two ranks prefill twice as fast.
    RULE.check_admission(COST, num_tokens_ahead=within + 100, num_prompt_tokens=4096, num_decodes=0,
                         num_ranks=2, is_batch=False)


def test_batch_requests_are_shed_first():
    ahead = 40_000   # about 0.6 s of prefill on an idle rank
    ttft = RULE.check_admission(COST, num_tokens_ahead=ahead, num_prompt_tokens=2048, num_decodes=0,
                                num_ranks=1, is_batch=False)
    assert 500 < ttft < 1000
    with pytest.raises(Overloaded, match="a batch-priority request would get its first token"):
        RULE.check_admission(COST, num_tokens_ahead=ahead, num_prompt_tokens=2048, num_decodes=0,
                             num_ranks=1, is_batch=True)


def test_decodes_slow_the_predicted_prefill():
    idle, _ = RULE.prefill_rate(COST, 0)
    busy, step_ms = RULE.prefill_rate(COST, 400)
    assert busy < idle and step_ms > 40.0 * TPOT_SHARE   # 400 decodes: the floor's step


def test_an_off_ttft_target_sheds_nothing():
    off = dataclasses.replace(RULE, ttft_target_ms=0.0)
    assert off.check_admission(COST, num_tokens_ahead=10**7, num_prompt_tokens=8192, num_decodes=0,
                               num_ranks=1, is_batch=True) > 1e5


# In the batcher.

def big_batcher(**kwargs):
    # A clock that stands still unless the test moves it: the decoding requests' times are the test's.
    kwargs = {"num_blocks": 2048, "block_size": 16, "max_running_requests": 64, "max_batch_tokens": 8192,
              "max_context": 32_768, "clock": lambda: 0.0, "tpot_target_ms": 40.0, "prefill_chunk_size": 0, **kwargs}
    return make_batcher(**kwargs)


def prefill_sizes(batch, rank=0) -> dict[int, int]:
    return {s.seq_id: len(s.token_ids) for s in batch.plans[rank].scheduled if s.token_ids}


def request(n: int, rid: str, *, is_batch=False, max_new_tokens=64):
    return dataclasses.replace(make_request(n, max_new_tokens=max_new_tokens, ignore_eos=True, request_id=rid,
                                            prompt_ids=[100 + sum(map(ord, rid)) % 1000] * n), is_batch=is_batch)


def test_a_prompt_on_an_idle_group_is_prefilled_in_one_step_without_a_512_cap():
    batcher = big_batcher()
    seq = add(batcher, request(4096, "a"))
    batch, _ = step(batcher)
    assert prefill_sizes(batch) == {seq.seq_id: 4096}


def test_beside_interactive_decodes_a_long_prompt_is_cut_to_the_budget():
    batcher = big_batcher()
    decoding = [add(batcher, request(16, f"d{i}")) for i in range(16)]
    step(batcher)
    long = add(batcher, request(8000, "long"))
    batch, _ = step(batcher)
    chunk = prefill_sizes(batch)[long.seq_id]
    rule, cost = batcher.budget_rule, batcher.cost
    # Each decoding request has its first token and its first interval to come, then a decode-only step.
    allowance = rule.step_target_ms + rule.step_target_ms - cost.decode_step_ms(16)
    expected = rule.rank_budget(cost, 16, 16, has_decodes=True, allowance_ms=allowance).chunk(cost, 0, 8000)
    assert chunk == expected and 1024 < chunk < 8000
    assert cost.base_ms(16) + cost.chunk_ms(0, chunk) <= allowance + 1e-9
    assert all(s.is_prefilled for s in decoding)


def test_batch_decodes_alone_do_not_hold_an_interactive_prompt_back():
    batcher = big_batcher()
    for i in range(16):
        add(batcher, request(16, f"b{i}", is_batch=True))
    step(batcher)
    prompt = add(batcher, request(9000, "i"))
    batch, _ = step(batcher)
    assert prefill_sizes(batch)[prompt.seq_id] == 8192 - 16


def test_an_interactive_prompt_takes_the_budget_before_a_batch_prompt_in_progress():
    batcher = big_batcher(max_batch_tokens=16_384)
    for i in range(8):
        add(batcher, request(16, f"d{i}"))                        # interactive decodes: a timed budget
    step(batcher)
    early = add(batcher, request(30_000, "batch", is_batch=True))
    batch, _ = step(batcher)
    assert early.seq_id in prefill_sizes(batch)                   # alone, it is prefilled
    late = add(batcher, request(4000, "inter"))
    sizes = {}
    while late.seq_id not in sizes:
        batch, _ = step(batcher)
        sizes = prefill_sizes(batch)
    assert sizes[late.seq_id] == 4000 and sizes.get(early.seq_id, 0) < sizes[late.seq_id]


def test_the_batcher_sheds_the_overflow_of_a_burst_and_counts_it():
    batcher = big_batcher(ttft_target_ms=100.0)
    admitted, refused = [], []
    for i in range(12):
        try:
            admitted.append(add(batcher, request(4096, f"r{i}")))
        except Overloaded as error:
            refused.append(error)
    rate, _ = batcher.budget_rule.prefill_rate(batcher.cost, 0)
    # Admitted while the predicted first token is within twice the target.
    assert len(admitted) == math.floor(2 * 100.0 * rate / 4096)
    assert refused and batcher.stats.num_rejected_overload == len(refused) == 12 - len(admitted)
    # A batch-priority request is refused where an interactive one still fits.
    small = big_batcher(ttft_target_ms=100.0)
    add(small, request(4096, "x"))
    with pytest.raises(Overloaded):
        add(small, request(4096, "b", is_batch=True))
    add(small, request(4096, "i"))


def test_interactive_requests_do_not_count_batch_prompts_ahead_of_them():
    batcher = big_batcher(ttft_target_ms=100.0, max_batch_tokens=4096)
    rate, step_ms = batcher.budget_rule.prefill_rate(batcher.cost, 0)
    num_batch = 0
    for i in range(50):
        try:
            add(batcher, request(4096, f"b{i}", is_batch=True))
            num_batch += 1
        except Overloaded:
            break
    assert batcher.num_prefill_tokens_ahead() == 4096 * num_batch
    assert batcher.num_prefill_tokens_ahead(include_batch=False) == 0
    add(batcher, request(4096, "i"))      # overtakes every batch prompt: admitted


def test_the_cost_scale_follows_the_ranks_step_times():
    batcher = big_batcher()
    add(batcher, request(4096, "a"))
    batch = batcher.schedule()
    predicted = batcher.cost.predict_ms(batcher._step_shapes[batch.step_id][0])
    tokens = {s.seq_id: 30 for s in batch.plans[0].scheduled if s.is_sampled}
    batcher.apply_results(batch.step_id, tokens, step_seconds=[1.5 * predicted / 1e3, predicted / 1e3])
    assert batcher.cost.scale > 1.0 and batcher.stats.step_cost_scale == round(batcher.cost.scale, 4)
    stats = batcher.stats
    assert (stats.num_prefill_steps, stats.num_decode_steps, stats.num_step_prefill_tokens) == (1, 0, 4096)
    assert stats.prefill_step_ms == pytest.approx(1.5 * predicted)
    assert stats.recent_steps[-1][:3] == [4096, 0, 2048] and stats.recent_steps[-1][4] == round(1.5 * predicted, 1)


def test_decoding_requests_ahead_of_their_target_lend_the_next_step_their_margin():
    now = [0.0]
    batcher = big_batcher(clock=lambda: now[0])
    decoding = [add(batcher, request(16, f"d{i}", max_new_tokens=41)) for i in range(4)]
    for _ in range(11):       # the first token, then 10 more 10 ms apart
        step(batcher)
        now[0] += 0.010
    assert all(len(s.output_ids) == 11 and s.first_token_at == 0.0 for s in decoding)
    long = add(batcher, request(12_000, "long"))
    batch, _ = step(batcher)
    rule, cost = batcher.budget_rule, batcher.cost
    allowance = rule.allowance_ms([DecodeProgress(10, 100.0, 29)] * 4, decode_step_ms=cost.decode_step_ms(4))
    assert allowance == pytest.approx(11 * rule.step_target_ms - 100.0 + rule.step_target_ms - cost.decode_step_ms(4))
    assert prefill_sizes(batch)[long.seq_id] == rule.rank_budget(
        cost, 4, 4, has_decodes=True, allowance_ms=allowance).chunk(cost, 0, 12_000)


def test_a_batch_request_never_overtakes_an_interactive_one_that_fits_nowhere_yet():
    batcher = make_batcher(num_blocks=16, block_size=4, max_batch_tokens=64)   # 64 tokens of KV
    first = add(batcher, request(40, "first", max_new_tokens=4))
    step(batcher)
    blocked = add(batcher, request(40, "blocked"))      # waits for first's blocks
    small = add(batcher, request(4, "small", is_batch=True))
    step(batcher)
    assert first.is_prefilled and blocked.rank is None and small.rank is None
    while not first.is_finished:
        step(batcher)
    step(batcher)
    assert blocked.rank is not None
