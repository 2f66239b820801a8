"""bench/serving/skew.py on the CPU (tiny-skewed, two ranks): the mesh with auto spare slots reserves
them and installs replicas while it settles, the one with 0 never does; both report each rank's step time."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_skew_bench_runs_on_the_cpu(tmp_path):
    out = subprocess.run([sys.executable, "-m", "bench.serving.skew", "--device", "cpu", "--preset", "tiny-skewed",
                          "--kind", "cpu", "--concurrency", "4", "--requests", "8", "--prompt-tokens", "48",
                          "--new-tokens", "4", "--settle-s", "5", "--scale-up-window-s", "1", "--prompt-scale",
                          "0.03", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    results = json.loads((tmp_path / "skew_cpu.json").read_text())["results"]
    assert set(results) == {"0", "auto"}
    assert results["0"]["installed_epochs"] == {"expert-0": 0, "expert-1": 0}
    assert all(n >= 1 for n in results["auto"]["installed_epochs"].values()), results["auto"]["installed_epochs"]
    assert all(lines and lines[0].startswith("4 spare slots") for lines in results["auto"]["spare_slots"].values())
    for r in results.values():
        assert r["client"]["num_ok"] == 8 and r["slowest_rank_step_ms"] > 0
    assert "| auto |" in (tmp_path / "skew_cpu.md").read_text()
