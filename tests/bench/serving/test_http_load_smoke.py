"""The HTTP load tool in miniature on the shared mesh: nothing lost, the added latency reported."""

import json

from bench.serving import http_load


def test_http_load_loses_nothing_and_reports_the_http_layers_added_latency(mesh, tmp_path):
    rc = http_load.main(["--grpc", mesh.gateway_address, "--http", mesh.http_url, "--num-requests", "12",
                         "--concurrency", "4", "--rounds", "1", "--num-paired", "5", "--max-new-tokens", "4",
                         "--out", str(tmp_path)])
    report = json.loads((tmp_path / "http_load_cpu.json").read_text())
    assert rc == 0 and report["problems"] == []
    for phase, num_sent in (("loaded", 12), ("paired", 5)):
        for transport in ("grpc", "http"):
            summary = report[phase][transport]
            assert summary["num_sent"] == summary["num_completed"] == num_sent, (phase, transport, summary)
            assert 0 < summary["ttft_ms_p50"] <= summary["e2e_ms_p50"] <= summary["e2e_ms_p99"]
    assert set(report["added_ms"]) == {"loaded_e2e_p50", "loaded_e2e_p99", "loaded_ttft_p50", "loaded_ttft_p99",
                                       "paired_e2e_p50", "paired_e2e_p99"}
    md = (tmp_path / "http_load_cpu.md").read_text()
    assert "python -m bench.serving.http_load --grpc" in md and "| paired E2E, per request |" in md
    assert "Verdict: PASS" in md
