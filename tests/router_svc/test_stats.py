"""Expert hit statistics: pure."""

import pytest

from moe.router.v1 import router_pb2
from router_svc.stats import MAX_COUNT, ExpertStats, hit_rates


def test_hit_rates_are_shares_of_the_layer_total():
    assert hit_rates([1, 3, 0, 4]) == [0.125, 0.375, 0.0, 0.5]
    assert hit_rates([0, 0]) == [0.0, 0.0]


def test_accumulates_per_group_and_layer():
    stats = ExpertStats()
    stats.add_report("g0", [(0, [1, 0, 2, 1]), (1, [0, 4, 0, 0])])
    stats.add_report("g0", [(0, [1, 2, 0, 1])])
    stats.add_report("g1", [(0, [4, 0, 0, 0])])
    [layer0, layer1] = stats.layer_stats("g0")
    assert (layer0.layer, layer0.counts, layer0.hit_rates) == (0, [2, 2, 2, 2], [0.25] * 4)
    assert (layer1.layer, layer1.counts, layer1.hit_rates) == (1, [0, 4, 0, 0], [0.0, 1.0, 0.0, 0.0])
    assert stats.num_reports("g0") == 2 and stats.num_reports("g1") == 1


def test_all_groups_summed_when_no_group_given():
    stats = ExpertStats()
    stats.add_report("g0", [(3, [1, 1])])
    stats.add_report("g1", [(3, [2, 0]), (5, [0, 1])])
    assert [(s.layer, s.counts) for s in stats.layer_stats()] == [(3, [3, 1]), (5, [0, 1])]
    assert stats.layer_stats("nope") == [] and stats.num_reports() == 2


def test_bad_reports_are_rejected_whole():
    stats = ExpertStats()
    stats.add_report("g0", [(0, [1, 1])])
    with pytest.raises(ValueError, match="group_id must be set"):
        stats.add_report("", [(0, [1, 1])])
    with pytest.raises(ValueError, match="layer 0 of group 'g0' has 2 experts, the report has 3"):
        stats.add_report("g0", [(1, [5, 5]), (0, [1, 1, 1])])
    assert [(s.layer, s.counts) for s in stats.layer_stats("g0")] == [(0, [1, 1])]
    assert stats.num_reports("g0") == 1


def test_counts_saturate_at_the_wire_uint64():
    # Found by tests/e2e/test_fuzz_e2e.py: two groups' counts summed past 2**64 - 1, and
    # GetExpertStats failed with UNKNOWN ("Value out of range") for every client after.
    stats = ExpertStats()
    stats.add_report("g0", [(0, [MAX_COUNT, 1])])
    stats.add_report("g1", [(0, [5, 1])])
    [layer] = stats.layer_stats()
    assert layer.counts == [MAX_COUNT, 2]
    assert layer.hit_rates == hit_rates([MAX_COUNT + 5, 2])
    router_pb2.LayerStats(layer=0, counts=layer.counts)  # fits the wire
