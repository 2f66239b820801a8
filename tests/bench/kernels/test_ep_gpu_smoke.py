"""bench/kernels/ep_gpu.py on the CPU (--device cpu --small: two gloo processes, a tiny model):
N=2 agrees with N=1 and both dispatch modes are timed at every batch size."""

import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[3] / "bench" / "kernels" / "ep_gpu.py"


def test_ep_gpu_runs_on_the_cpu(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--small", "--out", str(tmp_path),
                          "--num-steps", "8", "--batch-sizes", "1,4", "--warmup", "1", "--iters", "3"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads((tmp_path / "ep_gpu_cpu_small.json").read_text())
    correctness = result["correctness"]
    assert correctness["passed"] and correctness["max_abs_diff"] < 1e-4 * correctness["max_abs_ref_logit"]
    assert correctness["greedy_identical_prompts"] == correctness["num_prompts"] == 8
    assert correctness["top1_agreement"] == 1.0
    timed = {(row["batch_per_rank"], row["mode"].split(" (")[0], row["rank"]) for row in result["timings"]}
    assert timed == {(b, mode, rank) for b in (1, 4) for mode in ("host splits", "fixed capacity")
                     for rank in (0, 1)}
    assert all(row["total_us"] > 0 for row in result["timings"])
    report = (tmp_path / "ep_gpu_cpu_small.md").read_text()
    assert "PASSED" in report and "| 4 | fixed capacity (8/peer) |" in report
    assert report in out.stdout
