"""The scheduler against a modelled device (bench/serving/sim_goodput.py): the production mix
meets the SLO at a moderate rate, and the cost model learns the device's floor without taking
it for slow work."""

import pytest

from bench.serving.sim_goodput import parse_args, simulate


def test_a_device_like_the_priors_serves_a_moderate_rate_within_the_slo():
    row = simulate(6.0, parse_args(["--duration-s", "15"]), seed=0)
    assert row["refused"] == 0 and row["slo_attainment"] == 1.0
    assert row["tpot_ms_p99"] <= 40.0 and row["ttft_ms_p99"] <= 500
    assert row["learnt"]["scale"] == pytest.approx(1.0, abs=0.05) and row["learnt"]["floor_ms"] < 30


def test_an_eager_floor_is_learnt_and_steps_alternate_around_it():
    row = simulate(8.0, parse_args(["--duration-s", "60", "--floor-ms", "50", "--decode-scale", "2"]), seed=1)
    assert row["learnt"]["floor_ms"] == pytest.approx(50.0, rel=0.15)
    assert row["learnt"]["scale"] == pytest.approx(1.0, abs=0.05)      # not inflated by floor-bound steps
    assert row["tpot_ms_p99"] <= 40.0 and row["slo_attainment"] >= 0.99


def test_rates_are_parsed_and_checked():
    assert parse_args(["--rates", "2,4.5"]).rate_list == [2.0, 4.5]
    with pytest.raises(SystemExit):
        parse_args(["--rates", "0"])
