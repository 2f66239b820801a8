"""The scaling policy and the hit windows, without sockets."""

import dataclasses

import pytest

from router_svc.policy import ScalingPolicy, imbalance, max_imbalance, rebalance, scale
from router_svc.windows import SlidingWindows
from services.placement import EMPTY, Placement

POLICY = ScalingPolicy(scale_up_hit_rate=0.10, scale_up_window_s=300, scale_down_hit_rate=0.03,
                       scale_down_window_s=600, max_replicas=3)
# 16 experts over 4 ranks, 2 spares each: experts 0 and 1 (rank 0) take most of the tokens.
SKEWED = [400, 300, 20, 20] + [30] * 12
EMPTY_4x2 = Placement(16, 4, 2)


def test_windows_sum_the_reports_inside_them_and_forget_the_old():
    windows = SlidingWindows(horizon_s=10)
    windows.add("g", 0, [(0, [1, 0])], now_s=0)
    windows.add("g", 1, [(0, [0, 2]), (2, [5, 5])], now_s=4)
    windows.add("g", 0, [(0, [3, 0])], now_s=9)
    assert windows.counts("g", 6, now_s=9) == {0: [3, 2], 2: [5, 5]}
    assert windows.counts("g", 100, now_s=9) == {0: [4, 2], 2: [5, 5]}
    assert windows.span_s("g", 9) == 9 and windows.num_reporting_ranks("g") == 2
    windows.add("g", 0, [(0, [0, 1])], now_s=15)  # the reports at 0 s and 4 s leave the 10 s horizon
    assert windows.counts("g", 100, now_s=15) == {0: [3, 1]}
    assert windows.counts("other", 10, now_s=15) == {}


def test_a_hot_expert_gets_one_replica_per_round_up_to_the_maximum():
    placement = EMPTY_4x2
    for expected in (2, 3, 3):
        placement = scale(placement, {0: SKEWED}, None, POLICY)
        assert placement.num_replicas(0)[0] == expected
    assert placement.num_replicas(0)[1] == 3  # also above 10%
    assert all(n == 1 for n in placement.num_replicas(0)[2:])  # below 10%: no replica
    # The replicas went to the least loaded ranks, never to rank 0 (which holds both).
    assert all(e in (EMPTY, 0, 1) for e in placement.spares(0)) and placement.spares(0)[:2] == (EMPTY, EMPTY)
    assert imbalance(placement.rank_loads(0, SKEWED)) < imbalance(EMPTY_4x2.rank_loads(0, SKEWED))


def test_no_window_no_change_and_layers_without_hits_stay_empty():
    assert scale(EMPTY_4x2, None, None, POLICY) == EMPTY_4x2
    assert scale(EMPTY_4x2, {0: [0] * 16}, {0: [0] * 16}, POLICY) == EMPTY_4x2


def test_scale_down_removes_cold_replicas_but_never_the_last_copy():
    placement = Placement(16, 4, 2, {0: (EMPTY, EMPTY, 0, 9, 0, EMPTY, 9, EMPTY)})
    assert placement.num_replicas(0)[9] == 3
    cold = [500] + [1] * 15  # expert 9 is below 3%, expert 0 is not
    placement = scale(placement, None, {0: cold}, POLICY)
    assert placement.num_replicas(0)[9] == 2
    for _ in range(3):
        placement = scale(placement, None, {0: cold}, POLICY)
    assert placement.num_replicas(0)[9] == 1 and placement.num_replicas(0)[0] == 3
    assert all(n >= 1 for n in placement.num_replicas(0))
    assert placement.rank_experts(0, 2) == [8, 9, 10, 11, 0]  # the primary of expert 9 stays


def test_rebalance_lowers_the_largest_rank_load_on_a_skewed_histogram():
    before = imbalance(EMPTY_4x2.rank_loads(0, SKEWED))
    planned = rebalance(EMPTY_4x2, {0: SKEWED}, max_replicas=3)
    after = imbalance(planned.rank_loads(0, SKEWED))
    assert before == pytest.approx(740 * 4 / 1100)
    assert after < 0.6 * before, (before, after)
    assert max(planned.num_replicas(0)) <= 3
    assert max_imbalance(planned, {0: SKEWED}) == after


def test_rebalance_keeps_a_replica_that_stays_in_its_slot():
    current = Placement(16, 4, 2, {0: (EMPTY, EMPTY, EMPTY, 0, EMPTY, EMPTY, EMPTY, EMPTY)})
    planned = rebalance(current, {0: SKEWED}, max_replicas=3)
    if 0 in planned.rank_experts(0, 1):
        assert planned.spares(0)[3] == 0
    assert 0 in planned.rank_experts(0, 1)  # the hottest expert is worth a replica on every other rank


def test_thresholds_are_checked():
    with pytest.raises(ValueError, match="scale_down_hit_rate < scale_up_hit_rate"):
        dataclasses.replace(POLICY, scale_up_hit_rate=0.02)
    with pytest.raises(ValueError, match="max_replicas must be >= 1"):
        dataclasses.replace(POLICY, max_replicas=0)
    with pytest.raises(ValueError, match="windows must be positive"):
        dataclasses.replace(POLICY, scale_down_window_s=0)
