"""GatewayStats: percentiles, the hit rate and the JSON file bench/serve.py reads."""

import json

from gateway.stats import GatewayStats, percentile


def test_percentile_is_the_nearest_rank():
    values = list(range(1, 101))
    assert [percentile(values, q) for q in (0, 50, 99, 100)] == [1, 50, 99, 100]
    assert percentile([], 50) == 0.0 and percentile([7], 99) == 7


def test_snapshot_and_file_hold_the_counters_and_timings(tmp_path):
    stats = GatewayStats(num_prompt_tokens=200, num_cached_prompt_tokens=50, num_preemptions=3)
    for ms in (1, 2, 3, 4):
        stats.record_step(num_tokens=10, plan_s=ms / 1e3)
    stats.write_json(tmp_path / "stats.json")
    snap = json.loads((tmp_path / "stats.json").read_text())
    assert snap == stats.snapshot()
    assert snap["prefix_hit_rate"] == 0.25 and snap["num_preemptions"] == 3
    assert (snap["num_steps"], snap["num_step_tokens"]) == (4, 40)
    assert (snap["plan_ms_mean"], snap["plan_ms_p50"], snap["plan_ms_p99"]) == (2.5, 2.0, 4.0)
    assert snap["apply_ms_p99"] == 0.0
    assert list(tmp_path.iterdir()) == [tmp_path / "stats.json"]      # no temporary file left
