"""MissCounter and MemberProbe's thresholds: consecutive misses, resets, members never seen alive."""

import pytest

from scheduler_svc.health import Health, MissCounter
from scheduler_svc.member_probe import MemberProbe

SILENT_OR_REFUSED = frozenset({Health.REFUSED, Health.NO_ANSWER})


def test_misses_in_a_row_reach_the_threshold_once():
    counter = MissCounter(3, SILENT_OR_REFUSED)
    assert not counter.observe("a", Health.SERVING)
    assert [counter.observe("a", Health.NO_ANSWER) for _ in range(3)] == [False, False, True]
    # Counting starts again: three more misses to the next decision.
    assert [counter.observe("a", Health.REFUSED) for _ in range(3)] == [False, False, True]


def test_an_answer_resets_the_count_and_not_serving_is_an_answer():
    counter = MissCounter(2, SILENT_OR_REFUSED)
    counter.observe("a", Health.SERVING)
    assert not counter.observe("a", Health.NO_ANSWER)
    assert not counter.observe("a", Health.SERVING)
    assert not counter.observe("a", Health.NO_ANSWER)
    assert counter.observe("a", Health.NO_ANSWER)


def test_silence_after_not_serving_counts_towards_its_own_threshold():
    lenient = MissCounter(2, SILENT_OR_REFUSED)  # threshold_not_serving None: never
    lenient.observe("loading", Health.NOT_SERVING)
    assert not any(lenient.observe("loading", Health.NO_ANSWER) for _ in range(10))
    assert not lenient.observe("loading", Health.REFUSED)
    assert lenient.observe("loading", Health.REFUSED)  # a refusal is definite, whatever the last answer
    patient = MissCounter(2, SILENT_OR_REFUSED, threshold_not_serving=5)
    patient.observe("loading", Health.NOT_SERVING)
    assert [patient.observe("loading", Health.NO_ANSWER) for _ in range(5)] == [False] * 4 + [True]


def test_a_member_never_seen_alive_never_misses():
    counter = MissCounter(1, SILENT_OR_REFUSED)
    assert not any(counter.observe("never", Health.REFUSED) for _ in range(5))
    counter.observe("b", Health.SERVING)
    counter.forget("b")  # gone from the members: its history goes
    assert not counter.observe("b", Health.REFUSED)


def test_only_the_answers_that_count_are_misses():
    gateways = MemberProbe("gateway", misses=2).counter()
    gateways.observe("g", Health.SERVING)
    assert not any(gateways.observe("g", Health.NO_ANSWER) for _ in range(5))  # late: left to its lease
    assert not gateways.observe("g", Health.REFUSED)
    assert gateways.observe("g", Health.REFUSED)
    ranks = MemberProbe("expert", misses=2, is_silence_a_miss=True).counter()
    ranks.observe("r", Health.SERVING)
    assert not ranks.observe("r", Health.NO_ANSWER)
    assert ranks.observe("r", Health.NO_ANSWER)  # a hung serving rank is a lost one
    ranks.observe("loading", Health.NOT_SERVING)
    assert not any(ranks.observe("loading", Health.NO_ANSWER) for _ in range(5))  # left to its lease


def test_detection_bounds_follow_the_settings():
    from scheduler_svc.config import SchedulerConfig

    config = SchedulerConfig(member_id="s0", etcd="127.0.0.1:2379")
    probe = MemberProbe("expert", config.rank_probe_interval_s, config.rank_probe_timeout_s,
                        config.rank_probe_misses, is_silence_a_miss=True)
    low, high = probe.detection_s
    assert 0.25 <= low < high <= 0.6, probe.detection_s  # the documented 0.3 to 0.55 s
    assert MemberProbe("gateway", 0.1, 0.1, 2).detection_s == pytest.approx((0.1, 0.3))


@pytest.mark.parametrize("kwargs", [dict(interval_s=0), dict(timeout_s=0), dict(misses=0)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="member probe"):
        MemberProbe("expert", **kwargs)
    with pytest.raises(ValueError, match="threshold"):
        MissCounter(0, SILENT_OR_REFUSED)
    with pytest.raises(ValueError, match="threshold"):
        MissCounter(1, SILENT_OR_REFUSED, threshold_not_serving=0)
