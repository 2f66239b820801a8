"""The scheduler against a modelled device (bench/serving/sim_goodput.py): the production mix
meets the SLO at a moderate rate, and the cost model learns the device's floor without taking
it for slow work."""

import json

import pytest

from bench.serving.sim_goodput import FittedDevice, parse_args, simulate


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


def _goodput_result(tmp_path, steps, decode_rates):
    """A goodput result JSON with the logged steps and (steps, decode-only share, decode ms) a rate."""
    rates = [{"schedule": {"last_steps": steps if i == 0 else [], "steps": n, "prefill_step_share": share,
                           "decode_step_ms": ms}} for i, (n, share, ms) in enumerate(decode_rates)]
    path = tmp_path / "goodput.json"
    path.write_text(json.dumps({"mesh": {"cases": {"rates": rates}}}))
    return path


def test_a_measured_device_is_the_goodput_results_fit(tmp_path):
    from gateway.step_cost import StepShape

    shapes = [(670, 1713), (2162, 2759), (4501, 2250), (1436, 7259), (2041, 5518), (2612, 1209)]
    steps = [[t, 20, c, 0.0, 20.0 + 0.01 * t + 3e-6 * t * c] for t, c in shapes]
    path = _goodput_result(tmp_path, steps, [(100, 0.25, 10.0), (300, 0.5, 14.0)])
    args = parse_args(["--device-fit", str(path), "--rates", "4", "--duration-s", "10"])
    device = args.fitted
    assert (device.fixed_ms, device.us_per_token, device.ns_per_pair) == (20.0, 10.0, 3.0)
    assert device.decode_ms == pytest.approx((75 * 10.0 + 150 * 14.0) / 225, abs=0.01)   # by decode-only steps
    shape = StepShape(num_decodes=8)
    assert device.step_ms(shape) == device.decode_ms
    shape.add_chunk(1000, 2000)
    assert device.step_ms(shape) == pytest.approx(20.0 + 20.0 + 3e-6 * 2000 * 2000)
    row = simulate(4.0, args, seed=0)
    assert row["counted"] > 0 and row["slo_attainment"] > 0.5


def test_a_result_without_enough_steps_is_refused(tmp_path):
    path = _goodput_result(tmp_path, [[1000, 20, 500, 0.0, 40.0]] * 3, [(10, 0.5, 9.0)])
    with pytest.raises(SystemExit):
        parse_args(["--device-fit", str(path)])
    with pytest.raises(SystemExit):
        parse_args(["--device-fit", str(tmp_path / "missing.json")])
    shapes = [(670, 1713), (2162, 2759), (4501, 2250), (1436, 7259), (2041, 5518)]
    steps = [[t, 20, c, 0.0, 20.0 + 0.01 * t + 3e-6 * t * c] for t, c in shapes]
    path = _goodput_result(tmp_path, steps, [(10, 1.0, None)])   # every step carried prefill
    with pytest.raises(ValueError, match="no decode-only steps"):
        FittedDevice.from_result(path)
    with pytest.raises(SystemExit):
        parse_args(["--device-fit", str(path)])


def test_a_device_given_by_hand_prices_steps_as_a_fitted_one():
    from gateway.step_cost import StepShape

    args = parse_args(["--device", "15,5.0,1.2,9.4", "--rates", "4", "--duration-s", "10"])
    assert args.fitted == FittedDevice(15.0, 5.0, 1.2, 9.4)
    shape = StepShape(num_decodes=4)
    assert args.fitted.step_ms(shape) == 9.4
    shape.add_chunk(0, 1000)
    assert args.fitted.step_ms(shape) == pytest.approx(15.0 + 5.0 + 1.2e-6 * shape.pairs)
    # A slower device of the same shape meets the SLO for fewer of the same requests.
    fast = simulate(10.0, parse_args(["--device", "15,5.0,1.2,9.4", "--duration-s", "20"]), seed=1)
    slow = simulate(10.0, parse_args(["--device", "30,10.0,2.6,12.6", "--duration-s", "20"]), seed=1)
    assert fast["slo_attainment"] > slow["slo_attainment"]


@pytest.mark.parametrize("spec", ["15,5,1.2", "0,5,1.2,9.4", "15,-1,1.2,9.4", "15,5,1.2,0", "a,b,c,d", "15,nan,1.2,9.4", "15,5,inf,9.4"])
def test_a_malformed_device_is_refused(spec):
    with pytest.raises(SystemExit):
        parse_args(["--device", spec])


def test_a_device_is_given_one_way(tmp_path):
    with pytest.raises(SystemExit):
        parse_args(["--device", "15,5,1.2,9.4", "--device-fit", str(tmp_path / "goodput.json")])
