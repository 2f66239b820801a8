"""bench/serving/step_overhead.py in miniature: the real gateway and rank processes with a fake
5 ms device, one and two ranks; every request served, the ranks kept busy."""

import json
import subprocess
import sys


def test_step_overhead_serves_every_request_and_keeps_the_ranks_busy(tmp_path):
    cmd = [sys.executable, "-m", "bench.serving.step_overhead", "--cases", "1x8,2x8", "--step-ms", "5",
           "--prompt-tokens", "16", "--output-tokens", "24", "--label", "smoke", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    runs = json.loads((tmp_path / "step_overhead.json").read_text())["runs"]
    assert [(run["ranks"], run["concurrency"]) for run in runs] == [(1, 8), (2, 8)]
    for run in runs:
        assert run["client"]["num_ok"] == run["client"]["num_requests"] == 8 and not run["client"]["errors"]
        assert run["num_steps"] > 0 and run["out_tok_s"] > 0
        # A 5 ms device step against well under 5 ms of host work a step at 8 sequences.
        assert run["busy"] > 0.5 and run["turnaround_ms"] < run["wall_ms_per_step"]
    assert "| smoke |" in (tmp_path / "step_overhead.md").read_text()
