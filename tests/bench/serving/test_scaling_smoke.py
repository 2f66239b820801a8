"""bench/serving/scaling_gpu.py on the CPU (--device cpu --tiny: two gloo processes, the tiny model):
the rebalance evens the rank loads of the skewed model and leaves the logits bit-identical."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_scaling_bench_runs_on_the_cpu(tmp_path):
    out = subprocess.run([sys.executable, "-m", "bench.serving.scaling_gpu", "--device", "cpu", "--tiny", "--out",
                          str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads((tmp_path / "scaling_cpu_tiny.json").read_text())
    assert result["hot_expert_hit_share"] > 0.9  # the gate sends (nearly) everything to experts 0 and 1
    assert result["imbalance_before"]["mean"] > 1.9
    assert result["imbalance_after"]["max"] < 1.1
    assert result["replicas_added"] == 2 * result["model"]["moe_layers"]
    assert all(r["is_bit_identical"] and r["argmax_agreement"] == 1.0 for r in result["ranks"])
    assert result["step_ms_before"] > 0 and result["step_ms_after"] > 0
    report = (tmp_path / "scaling_cpu_tiny.md").read_text()
    assert "| before | 2.000 |" in report and report in out.stdout
