"""services/gc_pauses.py: pauses measured into the histogram, the heap frozen and unfrozen."""

import gc
import weakref

import pytest

from services import gc_pauses, metrics


class Node:
    def __init__(self):
        self.other = None


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()


def pause_count(generation: str) -> float:
    histogram = metrics.common_metrics().gc_pause
    return next((s.value for s in histogram.collect()[0].samples
                 if s.name.endswith("_count") and s.labels["generation"] == generation), 0.0)


def test_every_collection_is_timed_and_recorded():
    gc_pauses.observe()
    gc_pauses.observe()  # idempotent: one callback
    assert gc.callbacks.count(gc_pauses._on_collection) == 1
    before = pause_count("2")
    with gc_pauses.recording() as pauses:
        gc.collect()
        gc.collect(0)
    assert pause_count("2") == before + 1
    assert [generation for generation, _ in pauses] == [2, 0]
    assert all(0 <= seconds < 10 for _, seconds in pauses)
    gc.collect()
    assert len(pauses) == 2  # nothing recorded once outside


def test_freeze_skips_the_survivors_and_a_later_freeze_collects_their_cycles(unfrozen):
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: only the cyclic collector frees it
    alive = weakref.ref(a)
    assert gc_pauses.freeze("the test's set-up", enabled=False) == 0
    assert gc.get_freeze_count() == 0
    frozen = gc_pauses.freeze("the test's set-up")
    # Other threads of the test process (earlier tests' servers) may free frozen objects between the reads.
    assert frozen > 0 and frozen * 0.99 <= gc.get_freeze_count() <= frozen
    del a, b
    gc.collect()
    assert alive() is not None  # frozen: collections skip it
    gc_pauses.freeze("a new group's weights")  # unfreezes, collects, freezes again
    assert alive() is None


def test_keep_frozen_collects_and_freezes_only_what_came_since(unfrozen):
    """A standby froze its startup heap; its join collects only what the load added."""
    old_a, old_b = Node(), Node()
    old_a.other, old_b.other = old_b, old_a
    old = weakref.ref(old_a)
    first = gc_pauses.freeze("startup")
    del old_a, old_b
    new_a, new_b, kept = Node(), Node(), Node()
    new_a.other, new_b.other = new_b, new_a
    new = weakref.ref(new_a)
    del new_a, new_b
    second = gc_pauses.freeze("loading the weights", keep_frozen=True)
    assert new() is None  # the new cycle was collected
    assert old() is not None  # the frozen one was not walked
    assert second >= first + 1 and gc.is_tracked(kept)  # the survivors joined the frozen ones


def test_freeze_sets_the_young_threshold_even_when_disabled(unfrozen):
    before = gc.get_threshold()
    try:
        assert gc_pauses.freeze("a test", enabled=False, young_threshold=12_345) == 0
        assert gc.get_threshold() == (12_345, *before[1:])
        gc_pauses.freeze("a test", young_threshold=0)  # 0 leaves it as it is
        assert gc.get_threshold()[0] == 12_345
    finally:
        gc.set_threshold(*before)


def test_member_config_refuses_a_negative_threshold():
    from services.settings import MemberConfig

    assert MemberConfig(member_id="m").gc_young_threshold == gc_pauses.DEFAULT_YOUNG_THRESHOLD
    with pytest.raises(ValueError, match="gc_young_threshold must be >= 0, got -1"):
        MemberConfig(member_id="m", gc_young_threshold=-1)
