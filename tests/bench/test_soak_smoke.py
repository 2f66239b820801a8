"""The soak run in miniature on the tiny model: its own mesh, bursts past the
gateway's queue, every request accounted for, RSS sampled per process."""

import json

from bench import soak


def test_short_soak_loses_nothing_and_sees_only_backpressure(tiny_model_dir, tmp_path):
    # Memory flatness means little in 15 s; the 10-minute run checks it (bench/results/soak.md).
    rc = soak.main(["--model", str(tiny_model_dir), "--minutes", "0.25", "--rate", "15", "--burst-every-s", "5",
                    "--burst-size", "120", "--max-new-tokens", "8", "--num-prompts", "6", "--sample-every-s", "5",
                    "--max-rss-growth", "1.0", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "soak.json").read_text())
    assert rc == 0, report["problems"]
    client = report["client"]
    outcomes = client["outcomes"]
    assert set(outcomes) == {"completed", "RESOURCE_EXHAUSTED"}, outcomes
    assert outcomes["completed"] + outcomes["RESOURCE_EXHAUSTED"] == client["num_sent"]
    assert client["num_bursts"] >= 2 and client["num_shed"] == 0
    # Each burst overflows the queue. How far depends on how much the gateway drains while the burst is still
    # arriving (less than 120 - 64 - 32 when it is quick), so the check is only that every burst saw rejections.
    assert len(client["burst_rejected"]) == client["num_bursts"]
    assert all(n > 0 for n in client["burst_rejected"]), client["burst_rejected"]
    assert [s["label"] for s in report["samples"]][::len(report["samples"]) - 1] == ["start", "end"]
    assert len(report["samples"]) >= 4
    for name in ("gateway", "expert-0", "router", "scheduler-0", "etcd", "soak client"):
        assert report["memory"][name]["end_mib"] > 10, (name, report["memory"][name])
    assert all(report["alive"].values())
    md = (tmp_path / "soak.md").read_text()
    assert "python -m bench.soak --model" in md and "| gateway |" in md
