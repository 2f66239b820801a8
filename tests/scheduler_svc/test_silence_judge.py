"""SilenceJudge and MemberProbe's settings: refusals in a row, silence measured from the last
answer however late it came, resets, members never seen alive."""

import pytest

from scheduler_svc.health import Health, SilenceJudge
from scheduler_svc.member_probe import MemberProbe


def test_refusals_in_a_row_lose_a_member_and_any_answer_resets_them():
    judge = SilenceJudge(3)
    judge.answered("a", Health.SERVING, 0.0)
    for t in (0.1, 0.2):
        judge.answered("a", Health.REFUSED, t)
    assert not judge.is_lost("a", 0.25)
    judge.answered("a", Health.NOT_SERVING, 0.3)  # an answer: the process is there
    for t in (0.4, 0.5):
        judge.answered("a", Health.REFUSED, t)
    judge.answered("a", Health.NO_ANSWER, 0.6)  # a deadline passing neither resets nor counts
    assert not judge.is_lost("a", 0.6)
    judge.answered("a", Health.REFUSED, 0.7)
    assert judge.is_lost("a", 0.7)
    assert "refused 3 health checks in a row" in judge.why("a", 0.7)


def test_silence_counts_from_the_last_answer_however_late_it_came():
    judge = SilenceJudge(2, silent_s=0.5)
    # A slow member: every answer takes 0.4 s, yet one arrives every 0.5 s at most.
    for t in (0.0, 0.5, 1.0, 1.5, 2.0):
        judge.answered("slow", Health.SERVING, t)
        assert not judge.is_lost("slow", t + 0.49)
    judge.answered("other", Health.NOT_SERVING, 2.4)  # another member still heard
    # Frozen after its answer at 2.0: lost 0.5 s later, not before.
    judge.answered("slow", Health.NO_ANSWER, 4.0)
    assert not judge.is_lost("slow", 2.25)
    assert judge.is_lost("slow", 2.5)
    assert "has not answered a health check for 0.50 s (last answer serving)" in judge.why("slow", 2.5)


def test_when_every_member_is_silent_at_once_nobody_is_lost():
    judge = SilenceJudge(2, silent_s=0.5)
    judge.answered("a", Health.SERVING, 1.0)
    judge.answered("b", Health.SERVING, 1.1)
    assert not judge.is_lost("a", 2.0) and not judge.is_lost("b", 2.0)  # the prober was starved, or cut off
    judge.answered("b", Health.SERVING, 1.9)
    assert judge.is_lost("a", 2.0) and not judge.is_lost("b", 2.0)
    judge.answered("a", Health.REFUSED, 5.0)
    judge.answered("a", Health.REFUSED, 5.1)
    assert judge.is_lost("a", 5.1)  # refusals need no one else
    alone = SilenceJudge(2, silent_s=0.5)
    alone.answered("a", Health.SERVING, 1.0)
    assert alone.is_lost("a", 1.5)  # no other member to tell by: its silence counts


def test_silence_after_not_serving_has_its_own_allowance():
    lenient = SilenceJudge(2, silent_s=0.45)  # silent_not_serving_s None: never
    lenient.answered("loading", Health.NOT_SERVING, 0.0)
    assert not lenient.is_lost("loading", 100.0)
    lenient.answered("loading", Health.REFUSED, 100.1)
    lenient.answered("loading", Health.REFUSED, 100.2)
    assert lenient.is_lost("loading", 100.2)  # a refusal is definite, whatever the last answer
    patient = SilenceJudge(2, silent_s=0.45, silent_not_serving_s=5.0)
    patient.answered("loading", Health.NOT_SERVING, 0.0)
    patient.answered("other", Health.SERVING, 4.8)
    assert not patient.is_lost("loading", 4.9) and patient.is_lost("loading", 5.0)
    gateways = SilenceJudge(2)  # silence never counts
    gateways.answered("g", Health.SERVING, 0.0)
    assert not gateways.is_lost("g", 100.0)


def test_a_member_never_seen_alive_is_never_lost_and_forget_drops_the_history():
    judge = SilenceJudge(1, silent_s=0.1)
    for t in range(5):
        judge.answered("never", Health.REFUSED, float(t))
        judge.answered("never", Health.NO_ANSWER, float(t))
    assert not judge.is_lost("never", 10.0) and not judge.heard("never")
    judge.answered("b", Health.SERVING, 0.0)
    assert judge.heard("b")
    judge.answered("c", Health.SERVING, 0.95)
    assert judge.is_lost("b", 1.0)
    judge.forget("b")  # gone from the members, or given up on: its history goes
    assert not judge.is_lost("b", 1.0) and not judge.heard("b")
    judge.answered("b", Health.REFUSED, 1.1)
    assert not judge.is_lost("b", 1.1)


def test_detection_bounds_follow_the_settings():
    from scheduler_svc.config import SchedulerConfig

    config = SchedulerConfig(member_id="s0", etcd="127.0.0.1:2379")
    probe = MemberProbe("expert", config.rank_probe_interval_s, config.rank_probe_misses,
                        silent_s=config.rank_probe_silent_s)
    low, high = probe.detection_s
    assert 0.3 <= low < high <= 0.6, probe.detection_s  # the documented 0.35 to 0.55 s
    assert MemberProbe("gateway", 0.1, 2).detection_s == pytest.approx((0.1, 0.3))


@pytest.mark.parametrize("kwargs", [dict(interval_s=0), dict(deadline_s=0), dict(refusals=0), dict(silent_s=0)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="member probe|silence judge"):
        MemberProbe("expert", **kwargs)
    with pytest.raises(ValueError, match="silence judge"):
        SilenceJudge(0)
    with pytest.raises(ValueError, match="silence judge"):
        SilenceJudge(1, silent_s=1.0, silent_not_serving_s=-1.0)


def test_a_pause_of_the_prober_itself_is_pardoned():
    """Woken after a pause (SIGSTOP, starved), the prober knows nothing of the members' silence
    meanwhile: the first member to answer must not make the others look silent for the whole pause."""
    judge = SilenceJudge(2, silent_s=0.5, interval_s=0.1)
    judge.answered("a", Health.SERVING, 1.0)
    judge.answered("b", Health.SERVING, 1.0)
    judge.tick(1.0)
    judge.tick(1.1)  # on time
    judge.tick(10.0)  # paused from 1.1 to 10.0: 8.8 s not the members' silence
    judge.answered("a", Health.SERVING, 10.05)
    assert not judge.is_lost("b", 10.1)  # b's answer is still on its way
    judge.tick(10.1)
    assert not judge.is_lost("b", 10.25)
    judge.tick(10.2)
    judge.tick(10.3)
    assert judge.is_lost("b", 10.35)  # silent for the allowance after the pause: lost


def test_a_prober_that_is_always_late_still_judges():
    """Rounds every 0.3 s against an interval of 0.1 s: 0.2 s of each is forgiven, the rest counts."""
    judge = SilenceJudge(2, silent_s=0.5, interval_s=0.1)
    judge.answered("a", Health.SERVING, 0.0)
    judge.tick(0.0)
    lost_at = None
    for i in range(1, 20):
        now = 0.3 * i
        judge.answered("witness", Health.SERVING, now)
        judge.tick(now)
        if judge.is_lost("a", now):
            lost_at = now
            break
    assert lost_at is not None and 1.2 <= lost_at <= 1.8, lost_at


def test_a_member_never_heard_is_lost_after_its_own_allowance_from_its_first_check():
    judge = SilenceJudge(1, silent_s=0.1, silent_unheard_s=2.0)
    judge.checked("hung", 1.0)
    judge.checked("hung", 1.5)  # only the first check counts
    judge.answered("hung", Health.NO_ANSWER, 1.5)
    judge.answered("live", Health.SERVING, 2.9)
    assert not judge.is_lost("hung", 2.9)
    assert judge.is_lost("hung", 3.0) and "any health check in 2.00 s" in judge.why("hung", 3.0)
    judge.forget("hung")
    assert not judge.is_lost("hung", 10.0)
    judge.checked("alone", 0.0)  # without others heard within the silence, the prober is suspect
    judge.answered("other", Health.SERVING, 0.5)
    assert not judge.is_lost("alone", 5.0)
    assert not SilenceJudge(1, silent_s=0.1).is_lost("x", 100.0)  # None: never
