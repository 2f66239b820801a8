"""Fitting measured collective timings to the cost model's links (services/model/exchange/link_fit.py):
the fit recovers a known latency and bandwidth, refuses too few sizes, the pairs follow the nodes, and
the printed --ep-link-costs line goes back through LinkCosts.with_overrides."""

import numpy
import pytest

from services.model.exchange.cost_model import Link, LinkCosts, parse_overrides
from services.model.exchange.link_fit import (DEFAULT_SIZES, MAX_ITERS, MIN_ITERS, Measurement, combined,
                                              fit_link, iterations, link_pairs, parse_sizes, slowest)


def _times(latency_s: float, bytes_per_s: float, sizes=DEFAULT_SIZES) -> dict[int, float]:
    return {size: latency_s + size / bytes_per_s for size in sizes}


def test_the_fit_recovers_a_known_latency_and_bandwidth():
    link = fit_link(_times(250e-6, 0.8e9))
    # the latency: the smallest sizes' time, which carries their few bytes too (64-1024 B at 0.8 GB/s)
    assert link.latency_s == pytest.approx(250e-6, rel=0.01)
    assert link.bytes_per_s == pytest.approx(0.8e9, rel=1e-9)


def test_the_latency_is_the_small_sizes_median_and_one_late_call_does_not_move_it():
    times = _times(100e-6, 5e9)
    times[DEFAULT_SIZES[0]] = 900e-6  # one small size hit by a late call
    assert fit_link(times).latency_s == pytest.approx(100e-6, rel=0.01)


def test_the_bandwidth_is_the_slope_over_the_largest_sizes_only():
    times = _times(100e-6, 2e9)
    times[DEFAULT_SIZES[4]] *= 10  # a mid size off the line: neither the latency nor the slope
    assert fit_link(times).bytes_per_s == pytest.approx(2e9, rel=1e-9)
    noisy = _times(100e-6, 2e9)
    large = DEFAULT_SIZES[-3:]
    noisy[large[1]] *= 1.05
    noisy[large[2]] *= 0.95
    slope, _ = numpy.polyfit(large, [noisy[s] for s in large], 1)  # the least-squares line through the three
    assert fit_link(noisy).bytes_per_s == pytest.approx(1 / slope, rel=1e-9)


@pytest.mark.parametrize("sizes", [(64, 1024, 4096), (64,), ()])
def test_too_few_sizes_are_refused(sizes):
    with pytest.raises(ValueError, match=r"a fit needs more than 3 sizes .* got \d"):
        fit_link(_times(1e-4, 1e9, sizes))
    with pytest.raises(ValueError, match="a fit needs more than 2 sizes"):
        fit_link(_times(1e-4, 1e9, (64, 1024)), num_large=1)


def test_times_that_do_not_grow_with_the_size_are_refused():
    flat = {size: 1e-4 for size in DEFAULT_SIZES}
    with pytest.raises(ValueError, match="does not grow with the size over .*: measure larger sizes"):
        fit_link(flat)


def test_sizes_are_parsed_and_checked():
    assert parse_sizes("4096, 64,1024,64,16384") == (64, 1024, 4096, 16384)
    for bad, match in [("64,1024,x", "comma-separated byte counts"), ("64,1024,4096,6", "multiples of 4"),
                       ("0,64,128,256", "positive"), ("64,128,256", "more than 3 distinct values")]:
        with pytest.raises(ValueError, match=match):
            parse_sizes(bad)


def test_iterations_are_a_function_of_the_size_only_and_bounded():
    assert iterations(64) == MAX_ITERS and iterations(1 << 30) == MIN_ITERS
    assert iterations(4 << 20) == 16 and [iterations(s) for s in DEFAULT_SIZES] == sorted(
        (iterations(s) for s in DEFAULT_SIZES), reverse=True)


def test_pairs_follow_the_node_names():
    # two nodes of four: local pairs within each, network pairs rank i of one with rank i of the other
    nodes = ["a", "a", "b", "b", "a", "b", "a", "b"]
    assert link_pairs(nodes) == {"local": ((0, 1), (4, 6), (2, 3), (5, 7)),
                                 "network": ((0, 2), (1, 3), (4, 5), (6, 7))}
    assert link_pairs(["x", "x", "x"]) == {"local": ((0, 1),)}  # rank 2 idles
    assert link_pairs(["a", "b"]) == {"network": ((0, 1),)}
    assert link_pairs(["a", "b", "c"]) == {"network": ((0, 1),)}  # node c has no partner node
    with pytest.raises(ValueError, match=r"no two ranks to measure between: ranks on nodes \['a'\]"):
        link_pairs(["a"])


def test_slowest_takes_each_ranks_median_and_then_the_slowest_rank():
    reports = [{"all_to_all": {64: [1.0, 9.0, 2.0]}}, {}, {"all_to_all": {64: [3.0, 3.0, 3.0], 128: [5.0]}}]
    assert slowest(reports) == {"all_to_all": {64: 3.0, 128: 5.0}}


def test_combined_links_average_the_latency_and_the_time_per_byte():
    link = combined([Link(100e-6, 1e9), Link(300e-6, 3e9)])
    assert link.latency_s == pytest.approx(200e-6)
    assert link.bytes_per_s == pytest.approx(1.5e9)  # 2 / (1/1 + 1/3) GB/s
    with pytest.raises(ValueError, match="no links"):
        combined([])


def _measurement() -> Measurement:
    return Measurement.fitted({
        "local": {"all_to_all": _times(245e-6, 0.77e9), "all_gather": _times(180e-6, 1.2e9)},
        "network": {"all_to_all": _times(1234.5e-6, 0.1234e9)}})


def test_the_printed_line_round_trips_through_the_cost_model():
    m = _measurement()
    line = m.overrides_line()
    assert set(parse_overrides(line)) == {"local_latency_us", "local_gbps", "network_latency_us", "network_gbps"}
    costs = LinkCosts.for_device("cpu").with_overrides(line)
    for name in ("local", "network"):
        assert getattr(costs, name).latency_s == pytest.approx(m.links[name].latency_s, rel=1e-3)
        assert getattr(costs, name).bytes_per_s == pytest.approx(m.links[name].bytes_per_s, rel=1e-3)
    assert LinkCosts.for_device("cuda", line).local == costs.local  # the same figures on either device
    # only the measured keys: the overheads keep their defaults
    assert costs.alltoall_overhead_s == LinkCosts.for_device("cpu").alltoall_overhead_s


def test_a_class_not_measured_is_not_in_the_line():
    m = Measurement.fitted({"local": {"all_to_all": _times(245e-6, 0.77e9)}})
    assert set(parse_overrides(m.overrides_line())) == {"local_latency_us", "local_gbps"}
    assert LinkCosts.for_device("cpu", m.overrides_line()).network == LinkCosts.for_device("cpu").network


def test_a_failed_fit_names_its_class_and_collective():
    with pytest.raises(ValueError, match="network all_to_all: the time does not grow"):
        Measurement.fitted({"network": {"all_to_all": {size: 1e-3 for size in DEFAULT_SIZES}}})


def test_the_table_and_json_carry_every_size_and_figure():
    m = _measurement()
    table = m.table()
    assert "| bytes to the peer | local all_to_all (us) | local all_gather (us) | network all_to_all (us) |" in table
    assert f"| {DEFAULT_SIZES[-1]:,} |" in table
    assert "| network | combined | 1236.6 | 0.123 |" in table  # 256 B at 0.1234 GB/s in the latency
    data = m.as_json()
    assert data["ep_link_costs"] == m.overrides_line()
    assert data["times_us"]["local"]["all_gather"]["64"] == pytest.approx(180 + 64 / 1.2e3)
    assert data["links"]["network"]["gbps"] == pytest.approx(0.1234, rel=1e-9)
