"""The exchange designs' cost model (services/model/exchange/cost_model.py): the bytes each design
moves, the design "auto" picks per topology and step size, the overrides, and the plan's log line."""

import math

import pytest

from services.model.exchange.cost_model import (LinkCosts, RowShape, Topology, choose, delivered_bytes,
                                                expected_ranks_per_token, hit_probabilities, parse_overrides,
                                                rank_shares, step_cost)
from services.model.exchange.plan import DispatchPlan

# Qwen3-235B-A22B's rows in bf16: D = 4096, top-8 of 128 experts.
SHAPE = RowShape(hidden=4096, top_k=8, itemsize=2)
CUDA = LinkCosts.for_device("cuda")


def _hosts(num_hosts: int, per_host: int) -> Topology:
    return Topology(tuple(f"node{h}" for h in range(num_hosts) for _ in range(per_host)))


@pytest.mark.parametrize("num_ranks, expected", [(2, 1.9921875), (8, 5.2511), (16, 6.4525)])
def test_expected_ranks_per_token_is_n_times_one_minus_miss_probability(num_ranks, expected):
    assert expected_ranks_per_token(num_ranks, 8) == pytest.approx(num_ranks * (1 - (1 - 1 / num_ranks) ** 8))
    assert expected_ranks_per_token(num_ranks, 8) == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("num_ranks, low, high", [(2, 1.0, 1.01), (8, 1.45, 1.6), (16, 2.0, 2.6)])
def test_gather_delivers_1_5x_the_bytes_at_8_ranks_and_over_2x_at_16(num_ranks, low, high):
    ratio = delivered_bytes("gather", 64, SHAPE, num_ranks) / delivered_bytes("alltoall", 64, SHAPE, num_ranks)
    assert low < ratio < high
    # (N - 1) rows and (N - 1) partials a token for the gather, whatever the routing
    assert delivered_bytes("gather", 64, SHAPE, num_ranks) == num_ranks * 64 * (num_ranks - 1) * (8192 + 64 + 16384)


def test_measured_hit_counts_change_the_expected_ranks():
    # every copy on rank 0's experts: a token reaches one rank
    hits = [10, 10, 0, 0, 0, 0, 0, 0]
    assert rank_shares(hits, 4) == [1.0, 0.0, 0.0, 0.0]
    assert expected_ranks_per_token(4, 2, rank_shares(hits, 4)) == 1.0
    assert rank_shares([0] * 8, 4) == [0.25] * 4  # nothing counted yet: uniform
    assert hit_probabilities(4, 2) == pytest.approx([1 - 0.75 ** 2] * 4)
    skewed = delivered_bytes("alltoall", 10, SHAPE, 4, rank_shares(hits, 4))
    assert skewed < delivered_bytes("alltoall", 10, SHAPE, 4)
    with pytest.raises(ValueError, match="7 experts do not split evenly over 4 ranks"):
        rank_shares([1] * 7, 4)


def test_link_bytes_gather_spreads_its_rings_over_the_host_nics_the_all_to_all_does_not():
    t = 1000
    rt = SHAPE.round_trip_bytes
    gather = step_cost("gather", t, SHAPE, _hosts(2, 8), CUDA, is_fixed=False)
    assert gather.local_bytes == 15 * t * rt and gather.network_bytes == pytest.approx(15 * t * rt / 8)
    alltoall = step_cost("alltoall", t, SHAPE, _hosts(2, 8), CUDA, is_fixed=False)
    p = 1 - (15 / 16) ** 8
    assert alltoall.network_bytes == pytest.approx(8 * p * t * rt)
    assert alltoall.local_bytes == pytest.approx(7 * p * t * rt)
    assert alltoall.num_collectives == 3 and gather.num_collectives == 2
    # at a fixed capacity every peer gets the bucket's rows: the gather's bytes on one host
    padded = step_cost("alltoall", t, SHAPE, _hosts(1, 8), CUDA, is_fixed=True)
    assert padded.local_bytes == step_cost("gather", t, SHAPE, _hosts(1, 8), CUDA, is_fixed=True).local_bytes
    # one rank per host: every row crosses the network
    single = step_cost("gather", t, SHAPE, _hosts(16, 1), CUDA, is_fixed=False)
    assert single.local_bytes == 0 and single.network_bytes == 15 * t * rt


def test_auto_picks_the_gather_on_two_gpus_of_one_host_at_every_size():
    plan = DispatchPlan("auto", _hosts(1, 2), SHAPE, CUDA, max_fixed_tokens=256)
    assert {plan.design(t) for t in (1, 8, 256, 4096, 65536)} == {"gather"}
    assert plan.splits_design() == "gather"


@pytest.mark.parametrize("topology", [_hosts(2, 8), _hosts(16, 1), _hosts(8, 2)])
def test_auto_picks_the_all_to_all_for_big_steps_across_hosts_and_the_gather_for_decode(topology):
    plan = DispatchPlan("auto", topology, SHAPE, CUDA, max_fixed_tokens=256)
    assert plan.design(1) == plan.design(64) == "gather"  # latency: two collectives, no extra ops
    assert plan.design(4096) == plan.design(16384) == "alltoall"
    assert plan.splits_design() is None or plan.splits_design() == "alltoall"


def test_two_ranks_per_host_at_8_ranks_keep_the_gather_its_rings_carry_fewer_nic_bytes():
    # The rings put 7 / 2 = 3.5 rows a token on each NIC, the all-to-all 6 * (1 - (7/8)^8) = 3.94.
    plan = DispatchPlan("auto", _hosts(4, 2), SHAPE, CUDA, max_fixed_tokens=256)
    assert {plan.design(t) for t in (1, 256, 4096, 16384)} == {"gather"}
    assert plan.splits_design() == "gather"


def test_the_constants_move_the_choice_at_two_hosts_of_eight():
    # By default the gather's rings are bound by NVLink (every rank receives every row), the
    # all-to-all by its NIC bytes: the all-to-all wins a 1024-token step. With NVLink at its
    # large-message rate the gather does; with a slow network too (the rings' NIC bytes are fewer).
    t, topology = 1024, _hosts(2, 8)
    assert choose(t, SHAPE, topology, CUDA, is_fixed=False).design == "alltoall"
    fast_nvlink = LinkCosts.for_device("cuda", "local_gbps=900")
    assert choose(t, SHAPE, topology, fast_nvlink, is_fixed=False).design == "gather"
    slow_network = LinkCosts.for_device("cuda", "network_gbps=5")
    assert choose(t, SHAPE, topology, slow_network, is_fixed=False).design == "gather"
    # one rank per host: nothing to relay over NVLink, the all-to-all's fewer rows win
    assert choose(t, SHAPE, _hosts(16, 1), slow_network, is_fixed=False).design == "alltoall"


def test_a_forced_design_ignores_the_model():
    for setting in ("gather", "alltoall"):
        plan = DispatchPlan(setting, _hosts(2, 8), SHAPE, CUDA, max_fixed_tokens=256)
        assert {plan.design(t) for t in (1, 4096)} == {setting} and plan.splits_design() == setting
    with pytest.raises(ValueError, match="ep_dispatch must be one of .* got 'ring'"):
        DispatchPlan("ring", _hosts(1, 2), SHAPE, CUDA, max_fixed_tokens=256)


def test_fixed_capacity_follows_max_fixed_tokens():
    plan = DispatchPlan("auto", _hosts(1, 2), SHAPE, CUDA, max_fixed_tokens=256)
    assert plan.is_fixed(256) and not plan.is_fixed(257)
    assert not DispatchPlan("auto", _hosts(1, 2), SHAPE, CUDA, max_fixed_tokens=0).is_fixed(1)


def test_describe_names_the_setting_the_topology_and_each_range():
    line = DispatchPlan("auto", _hosts(2, 8), SHAPE, CUDA, max_fixed_tokens=256).describe()
    assert line.startswith("--ep-dispatch auto over 16 ranks on 2 hosts (8 per host): gather at 1-")
    assert "alltoall at " in line and line.endswith("16384 tokens per rank (the cost model's choice)")
    uneven = Topology(("a", "a", "a", "b"))
    assert uneven.describe() == "4 ranks on 2 hosts (3+1 per host)" and uneven.ranks_per_host() == (3, 1)


def test_overrides_parse_and_refuse_bad_values():
    costs = LinkCosts.for_device("cuda", "network_gbps=12.5, network_latency_us=40")
    assert costs.network.bytes_per_s == pytest.approx(12.5e9) and costs.network.latency_s == pytest.approx(40e-6)
    assert costs.local == CUDA.local and costs.alltoall_overhead_s == CUDA.alltoall_overhead_s
    assert parse_overrides("") == {}
    for bad, message in [("speed=3", "is not key=value"), ("local_gbps", "is not key=value"),
                         ("local_gbps=fast", "has no number"), ("local_gbps=0", "a bandwidth > 0"),
                         ("sync_us=-1", ">= 0"), ("sync_us=nan", "finite")]:
        with pytest.raises(ValueError, match=message):
            parse_overrides(bad)
    with pytest.raises(ValueError, match="no link costs for device type 'tpu'"):
        LinkCosts.for_device("tpu")


def test_one_rank_costs_no_latency():
    cost = step_cost("gather", 10, SHAPE, _hosts(1, 1), CUDA, is_fixed=True)
    assert cost.seconds == 0 and math.isclose(cost.local_bytes, 0)
