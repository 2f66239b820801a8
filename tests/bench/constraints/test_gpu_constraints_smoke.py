"""bench/constraints/gpu_constraints.py's smoke form on the CPU: the tiny random-weights preset, a tiny
load; every case runs, the constrained answers finish and parse, the baselines replay their lengths
over the same window, and jump-forward's answers also parse, in fewer steps."""

import json

from bench.constraints import gpu_constraints, load


def test_the_unconstrained_twin_asks_for_the_same_length_and_the_answers_are_checked():
    twin = load.twin_request("t", (5, 6, 7), 42)
    assert twin.sampling.max_new_tokens == 42 and twin.sampling.ignore_eos
    assert twin.sampling.WhichOneof("constraint") is None
    request = load.constrained_request("c", (5, 6), 64)
    assert json.loads(request.sampling.json_schema) == load.TICKET_SCHEMA and not request.sampling.ignore_eos
    good = '{"is_dispute": true, "amount": 1.5, "date_range": ["2024-01-01", "2024-01-31"], "order_id": "ORD-123456"}'
    assert load.is_valid_ticket(good)
    assert not load.is_valid_ticket(good[:-1]) and not load.is_valid_ticket('{"is_dispute": true}')


def test_cpu_smoke_run_reports_every_case(tmp_path):
    code = gpu_constraints.main(["--device", "cpu", "--preset", "tiny", "--concurrency", "4", "--constrained-slots", "1",
                                 "--prompt-scale", "0.01", "--output-scale", "0.02", "--b1-requests", "2",
                                 "--max-new-tokens", "120", "--repeats", "2", "--c256-window-s", "4", "--kind", "cpu",
                                 "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "constraints_cpu.json").read_text())
    assert "| default (jump-forward off) | b1_constrained |" in (tmp_path / "constraints_cpu.md").read_text()
    compile_ = report["compile"]
    assert compile_["tokenizer_build_s"] > 0 and compile_["cold_ms_median"] * 1e3 > compile_["cached_us_median"] > 0
    cases = report["mesh"]["cases"]
    assert set(cases) == {"c256_constrained", "c256_unconstrained", "b1_constrained", "b1_unconstrained"}
    for name in ("c256_constrained", "b1_constrained"):
        answers = cases[name]["answers"]
        # The random model reaches the end of the finite schema: bounded whitespace and numbers.
        assert answers["finish_reasons"] == {"FINISH_REASON_STOP": answers["stopped"]}, answers
        assert answers["valid_json"] == answers["stopped"] > 0
    b1, twins = cases["b1_constrained"], cases["b1_unconstrained"]
    assert b1["num_ok"] == twins["num_ok"] == 2 and len(b1["texts"]) == 2
    assert b1["decode_ms_per_token"] > 0 and twins["decode_ms_per_token"] > 0
    c256, c256_twins = cases["c256_constrained"], cases["c256_unconstrained"]
    assert c256["duration_s"] == c256_twins["duration_s"] == 4   # the same window
    assert c256["window_output_tokens_per_s"] > 0 and c256_twins["window_output_tokens_per_s"] > 0
    assert set(report["targets"]) == {
        "c256, a quarter constrained: output tok/s in the same window >= 90% of unconstrained",
        "b1 with a JSON schema: mean decode ms per token <= 1.1x unconstrained"}
    # The second mesh, jump-forward on: valid answers in fewer steps, reported beside the default's.
    jf = report["mesh_jump_forward"]["cases"]["b1_constrained"]
    assert jf["answers"]["valid_json"] == jf["answers"]["stopped"] == 2
    assert jf["gateway_steps_per_output_token"] < 0.9 < b1["gateway_steps_per_output_token"]
    assert isinstance(report["jf_same_answers"], bool) and "jump_forward" in report
