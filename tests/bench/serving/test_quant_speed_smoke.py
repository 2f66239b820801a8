"""bench/serving/quant_speed.py on the CPU: two tiny presets one mesh after the other, each case's figure beside
its bound and the first preset's, the memory plan and the KV blocks each service reports on /metrics."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_quant_speed_runs_two_presets_on_the_cpu(tmp_path):
    out = subprocess.run([sys.executable, "-m", "bench.serving.quant_speed", "--device", "cpu", "--kind", "cpu",
                          "--presets", "tiny,tiny-tied", "--cases", "b1,mix", "--prompt-scale", "0.01",
                          "--output-scale", "0.01", "--mix-requests", "4", "--mix-concurrency", "2",
                          "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((tmp_path / "quant_speed_cpu.json").read_text())
    assert list(report["presets"]) == ["tiny", "tiny-tied"]
    for run in report["presets"].values():
        assert run["kv_blocks_measured"] == {"expert-0": run["kv_tokens_measured"]["expert-0"] // 16}
        assert run["kv_blocks_measured"]["expert-0"] > 0 and run["plan"]["fits"]
        assert {c: r["num_ok"] for c, r in run["cases"].items()} == {"b1": 1, "mix": 4}
    rows = {(r["preset"], r["case"]): r for r in report["table"]}
    assert rows[("tiny-tied", "mix")]["unit"] == "req/s" and rows[("tiny-tied", "mix")]["vs_first"] > 0
    assert all(r["bound"] > r["value"] > 0 for r in rows.values())
    assert "| tiny-tied | b1 | 1 |" in (tmp_path / "quant_speed_cpu.md").read_text()
