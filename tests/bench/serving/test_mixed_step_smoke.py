"""bench/serving/mixed_step.py in miniature on the CPU: every step kind timed, profiled and written."""

import json

from bench.serving import mixed_step


def test_mixed_step_times_each_kind_and_writes_results(tmp_path):
    assert mixed_step.main(["--preset", "tiny", "--device", "cpu", "--layers", "1", "--decodes", "4",
                            "--chunks", "2", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "mixed_step.json").read_text())
    steps = report["steps"]
    assert [steps[k]["tokens"] for k in ("prefill", "mixed", "decode")] == [2 * 512, 2 * 480 + 4, 4]
    for row in steps.values():
        assert 0 < row["launch_ms"] <= row["wall_ms"] and row["host_syncs"] == []
        assert "Name" in row["profile"]
    assert "| mixed | 964 |" in (tmp_path / "mixed_step.md").read_text()
