"""bench/serving/quant_speed.py keeps one result per GPU kind: a run merges into the file by (preset, case),
its cases replacing the earlier ones, every run's command and figures kept."""

import json

from bench.serving import quant_speed


def _row(conc: int, value: float) -> dict:
    latency = dict.fromkeys(("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99"), 1.0)
    return {"concurrency": conc, "requests_per_s": 1.0, "output_tokens_per_s": value,
            "decode_tokens_per_s_per_seq": value, "num_ok": 1, "num_requests": 1, **latency}


def _run(command: str, output_scale: float, presets: dict) -> dict:
    """One run's report as main() builds it (before merging)."""
    return {"command": command, "date": f"date of {command}", "setup": {},
            "config": {"kind": "nvidia-h200", "prompt_scale": 1.0, "output_scale": output_scale, "expert_arg": [],
                       "mix_requests": 8, "mix_concurrency": 4},
            "presets": {p: {"plan": {"kv_tokens": 10}, "startup_s": s, "log_tails": {"x": "log"},
                            "kv_tokens_needed": {c: 1 for c in cases}, "cases": cases}
                        for p, (s, cases) in presets.items()}}


def test_a_run_of_other_cases_adds_to_the_file_and_a_rerun_replaces_its_cases():
    b1 = _run("b1 run", 0.25, {"qwen3-30b-a3b": (1.0, {"b1": _row(1, 300.0)}),
                               "qwen3-30b-a3b-fp8": (2.0, {"b1": _row(1, 400.0)}),
                               "qwen3-30b-a3b-awq": (3.0, {"b1": _row(1, 200.0)})})
    c256 = _run("c256 run", 0.5, {"qwen3-30b-a3b": (4.0, {"c256": _row(256, 5000.0)}),
                                  "qwen3-30b-a3b-fp8": (5.0, {"c256": _row(256, 4000.0)})})
    result = quant_speed.merged(quant_speed.merged(None, b1), c256)
    assert [r["command"] for r in result["runs"]] == ["b1 run", "c256 run"]
    assert list(result["presets"]) == ["qwen3-30b-a3b", "qwen3-30b-a3b-fp8", "qwen3-30b-a3b-awq"]
    fp8 = result["presets"]["qwen3-30b-a3b-fp8"]
    assert {c: (r["run"], quant_speed.measured(c, r)[0]) for c, r in fp8["cases"].items()} == {
        "b1": (0, 400.0), "c256": (1, 4000.0)}
    assert fp8["kv_tokens_needed"] == {"b1": 1, "c256": 1} and fp8["startup_s"] == 5.0
    assert result["runs"][0]["presets"]["qwen3-30b-a3b-fp8"]["startup_s"] == 2.0  # the older run's figures stay
    assert "log_tails" not in result["runs"][0]["presets"]["qwen3-30b-a3b-fp8"]
    rows = {(r["preset"], r["case"]): r for r in quant_speed.table(result)}
    assert rows[("qwen3-30b-a3b-fp8", "c256")]["vs_first"] == 0.8
    assert rows[("qwen3-30b-a3b-fp8", "c256")]["run"] == 1
    # Each case's bound is at its own run's context: b1 ran 256 new tokens, c256 512.
    own, latest = (quant_speed.case_bound("qwen3-30b-a3b-fp8", "b1", fp8["cases"]["b1"], run["config"])[1]
                   for run in (b1, c256))
    assert rows[("qwen3-30b-a3b-fp8", "b1")]["bound_with_kv"] == own != latest
    text = quant_speed.markdown(result)
    assert "- run 0, date of b1 run: `b1 run`" in text and "- run 1, date of c256 run: `c256 run`" in text
    assert "| qwen3-30b-a3b-fp8 | c256 | 256 | 4000.0 | out tok/s |" in text

    again = _run("b1 again", 0.25, {"qwen3-30b-a3b-fp8": (6.0, {"b1": _row(1, 450.0)})})
    result = quant_speed.merged(json.loads(json.dumps(result)), again)
    fp8 = result["presets"]["qwen3-30b-a3b-fp8"]
    assert fp8["cases"]["b1"]["run"] == 2 and quant_speed.measured("b1", fp8["cases"]["b1"])[0] == 450.0
    assert fp8["cases"]["c256"]["run"] == 1 and len(result["runs"]) == 3


def test_a_result_written_before_merging_is_its_first_run(tmp_path):
    old = _run("old", 0.25, {"qwen3-30b-a3b": (1.0, {"b1": _row(1, 300.0)})})
    old["table"] = []
    path = tmp_path / "quant_speed_nvidia-h200.json"
    path.write_text(json.dumps(old))
    assert quant_speed.read_result(tmp_path / "none.json") is None
    result = quant_speed.merged(quant_speed.read_result(path), _run("new", 0.25, {"qwen3-30b-a3b": (2.0, {})}))
    assert [r["command"] for r in result["runs"]] == ["old", "new"]
    bf16 = result["presets"]["qwen3-30b-a3b"]
    assert bf16["cases"]["b1"]["run"] == 0 and bf16["startup_s"] == 2.0
