"""bench/serving/goodput.py's arithmetic: SLO attainment, TPOT, goodput and the prefill FLOPs."""

import argparse

import pytest

from bench.serving.goodput import flops_per_prompt, goodput, markdown, meets_slo, parse_args, rate_row, tpot_s
from bench.serving.serve import RequestResult
from services.model.random_weights import preset

SLO = argparse.Namespace(slo_ttft_ms=500.0, slo_tpot_ms=40.0)


def _result(start, first, end, tokens, error=None):
    r = RequestResult("mix", start, end_s=end, first_token_s=first, num_output_tokens=tokens)
    r.error = error
    return r


def test_tpot_and_slo_count_ttft_and_the_mean_gap():
    fast = _result(0.0, 0.4, 0.4 + 31 * 0.03, 32)
    assert tpot_s(fast) == pytest.approx(0.03)
    assert meets_slo(fast, 0.5, 0.04)
    assert not meets_slo(_result(0.0, 0.6, 1.0, 32), 0.5, 0.04)  # TTFT over
    assert not meets_slo(_result(0.0, 0.1, 0.1 + 31 * 0.05, 32), 0.5, 0.04)  # TPOT over
    assert meets_slo(_result(0.0, 0.2, 0.2, 1), 0.5, 0.04)  # one token: no TPOT
    assert not meets_slo(_result(0.0, None, 1.0, 0, error="UNAVAILABLE"), 0.5, 0.04)


def test_rate_row_leaves_out_the_settling_arrivals_and_counts_failures_as_misses():
    results = [_result(0.0, 5.0, 6.0, 2),  # arrives in the settle window: not counted
               _result(2.0, 2.1, 2.13, 2), _result(3.0, 3.1, 3.13, 2),
               _result(4.0, None, 4.5, 0, error="RESOURCE_EXHAUSTED")]
    row = rate_row(1.0, results, [10, 20, 30, 40], 6.0, 1.0, SLO, [1.0, 2.0, 3.0, 4.0])
    assert (row["sent"], row["counted"], row["ok"]) == (4, 3, 2)
    assert row["slo_attainment"] == pytest.approx(2 / 3, abs=1e-4)
    assert row["errors"] == {"RESOURCE_EXHAUSTED": 1}
    assert row["prompt_tokens_per_s"] == round((20 + 30) / 2.5)  # the counted window: 2.0 to 4.5


def test_goodput_is_the_highest_rate_that_meets_the_attainment():
    rows = [{"rate": 2, "slo_attainment": 1.0}, {"rate": 4, "slo_attainment": 0.995},
            {"rate": 6, "slo_attainment": 0.97}, {"rate": 8, "slo_attainment": 0.2}]
    assert goodput(rows, 0.99) == 4
    assert goodput(rows[2:], 0.99) == 0.0


def test_prefill_flops_of_the_30b_shape_are_about_eight_gflop_a_token_at_4k():
    per_token = flops_per_prompt(preset("qwen3-30b-a3b"), 4096) / 4096
    assert 5e9 < per_token < 10e9  # about 3.3B active weights, twice, plus attention at 4K
    assert flops_per_prompt(preset("tiny"), 8) < flops_per_prompt(preset("tiny"), 16)


def test_rates_are_parsed_and_checked():
    assert parse_args(["--rates", "2,4.5"]).rate_list == [2.0, 4.5]
    with pytest.raises(SystemExit):
        parse_args(["--rates", "0,2"])
    with pytest.raises(SystemExit):
        parse_args(["--duration-s", "5", "--settle-s", "5"])


def test_the_gateway_runs_the_step_budget_and_sheds_at_the_slo_unless_told_otherwise():
    budget = ["--tpot-target-ms=40", "--prefill-chunk-size=0"]
    assert parse_args(["--slo-ttft-ms", "300"]).gateway_arg == [*budget, "--ttft-target-ms=300"]
    assert parse_args(["--gateway-arg=--ttft-target-ms=0"]).gateway_arg == [
        *budget, "--ttft-target-ms=500", "--ttft-target-ms=0"]   # the caller's own, later, wins
    assert parse_args(["--no-shed", "--slo-tpot-ms", "50"]).gateway_arg == ["--tpot-target-ms=50", "--prefill-chunk-size=0"]
    assert parse_args(["--no-shed", "--no-step-budget"]).gateway_arg == []


def test_schedule_row_says_where_the_steps_of_a_rate_went():
    from bench.serving.goodput import schedule_row

    before = {"num_prefill_steps": 10, "num_decode_steps": 5, "prefill_step_ms": 500.0, "decode_step_ms": 40.0,
              "num_step_prefill_tokens": 20_000, "num_rejected_overload": 1, "recent_prefill_tokens": [7] * 15}
    after = {"num_prefill_steps": 14, "num_decode_steps": 9, "prefill_step_ms": 760.0, "decode_step_ms": 72.0,
             "num_step_prefill_tokens": 36_000, "num_rejected_overload": 3, "step_cost_scale": 1.1,
             "step_floor_ms": 48.0, "step_decode_scale": 1.5,
             "recent_prefill_tokens": [7] * 15 + [4000, 0, 4000, 0, 2000, 0, 6000, 0],
             "recent_steps": [[1, 0, 1, 1.0, 1.0]] * 3 + [[4000, 8, 2000 + i, 60.0, 61.0] for i in range(4)]}
    row = schedule_row(before, after)
    # The rate's own four steps with prefill, not the earlier rates' ones before them.
    assert [s[2] for s in row["last_steps"]] == [2000, 2001, 2002, 2003]
    assert schedule_row(after, after)["last_steps"] == []
    assert row["steps"] == 8 and row["prefill_step_share"] == 0.5 and row["prefill_tokens_per_prefill_step"] == 4000
    assert (row["prefill_tokens_p50"], row["prefill_tokens_p99"]) == (4000, 6000)
    assert row["prefill_step_ms"] == 65.0 and row["decode_step_ms"] == 8.0 and row["shed"] == 2
    assert row["fit"] == {"scale": 1.1, "floor_ms": 48.0, "decode_scale": 1.5}


def test_the_table_shows_queueing_and_the_steps_with_and_without_prefill():
    results = [_result(2.0, 2.1, 2.13, 2), _result(3.0, 3.1, 3.13, 2)]
    row = rate_row(4.0, results, [10, 20], 6.0, 0.0, SLO, [1.0, 2.0])
    row |= {"busy_share": 0.9, "queue_ms": 212.5, "schedule": {"prefill_step_ms": 96.1, "decode_step_ms": 12.4}}
    report = {"config": {"preset": "tiny", "kind": "cpu", "slo_ttft_ms": 500.0, "slo_tpot_ms": 40.0,
                         "slo_attainment": 0.99, "duration_s": 6.0, "settle_s": 0.0},
              "command": "c", "date": "d", "goodput": 4.0, "mesh": {"cases": {"rates": [row]}}}
    table = [line for line in markdown(report).splitlines() if line.startswith("| 4 |")]
    assert len(table) == 1 and "| 212.5 | 96.1 / 12.4 |" in table[0]


def test_the_prefill_steps_fit_recovers_a_linear_cost_and_is_printed():
    from bench.serving.goodput import fit_prefill_steps

    def measured(tokens, context):
        return 20.0 + 0.01 * tokens + 3e-6 * tokens * context

    shapes = [(670, 1713), (2162, 2759), (4501, 2250), (1436, 7259), (2041, 5518), (2612, 1209)]
    steps = [[t, 20, c, 0.0, measured(t, c)] for t, c in shapes]
    fit = fit_prefill_steps(steps)
    assert fit["steps"] == 6 and fit["fixed_ms"] == pytest.approx(20.0, abs=0.01)
    assert fit["us_per_token"] == pytest.approx(10.0, abs=0.01) and fit["ns_per_pair"] == pytest.approx(3.0, abs=0.01)
    assert fit["rms_ms"] < 0.01
    assert fit_prefill_steps(steps[:3]) is None                        # too few steps
    assert fit_prefill_steps([[1000, 20, 500, 0.0, 40.0]] * 5) is None   # one shape: nothing to tell apart
    row = rate_row(4.0, [_result(2.0, 2.1, 2.13, 2)], [10], 6.0, 0.0, SLO, [1.0])
    row["schedule"] = {"last_steps": steps}
    report = {"config": {"preset": "tiny", "kind": "cpu", "slo_ttft_ms": 500.0, "slo_tpot_ms": 40.0,
                         "slo_attainment": 0.99, "duration_s": 6.0, "settle_s": 0.0},
              "command": "c", "date": "d", "goodput": 4.0, "mesh": {"cases": {"rates": [row]}}}
    assert "20.0 ms a step + 10.0 us a prompt token + 3.0 ns a token-context pair" in markdown(report)
