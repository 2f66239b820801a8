"""bench/failover/multihost.py without namespaces: which rank each failure strikes (never the
control plane's host) and what the summary and its files say (tests/e2e/test_multihost.py runs
the same mesh and failures for real)."""

import json
import types

import pytest

from bench.failover import multihost as bench
from bench.failover.chaos import Load
from services.cluster import GroupAssignment, RankInfo


def _mesh(hosts: dict[str, str]):
    roles = {name: types.SimpleNamespace(host=host) for name, host in hosts.items()}
    return types.SimpleNamespace(roles=roles, spec=types.SimpleNamespace(control_host="a"))


def _group(*members: str) -> GroupAssignment:
    return GroupAssignment(group_id="g0", epoch=3, term=1, world_size=len(members),
                           rendezvous_address="10.213.97.1:1",
                           ranks=[RankInfo(i, m, f"10.213.97.{i + 1}:2") for i, m in enumerate(members)])


def test_the_victim_is_a_rank_off_the_control_host():
    runner = bench.Bench(_mesh({"expert-a": "a", "expert-b": "b", "expert-c": "c"}), None, Load(), None)
    assert runner.victim(_group("expert-a", "expert-c")) == ("expert-c", "c")
    assert runner.victim(_group("expert-b", "expert-a")) == ("expert-b", "b")
    with pytest.raises(RuntimeError, match="off the control host"):
        runner.victim(_group("expert-a"))


def test_the_summary_and_its_files_report_each_run_and_every_request(tmp_path):
    load = Load(num_sent=10, num_ok=9)
    load.failed["UNAVAILABLE"] = 1
    runner = bench.Bench(_mesh({}), None, load, None)
    runner.results = {"host": [1.0, 2.0, 3.0], "partition": [4.0]}
    args = types.SimpleNamespace(clients=4, new_tokens=8, collective_timeout_s=3.0)
    result = bench.summary(runner, load, 12.3, args)
    assert result["cases"]["host"]["recovery_ms_p50"] == pytest.approx(2000)
    assert result["cases"]["partition"]["recovery_ms_max"] == pytest.approx(4000)
    bench.write(result, tmp_path)
    assert json.loads((tmp_path / "multihost.json").read_text())["requests_failed"] == {"UNAVAILABLE": 1}
    text = (tmp_path / "multihost.md").read_text()
    assert "| host | 3 | 2000 |" in text and "1000, 2000, 3000 |" in text and "failed: UNAVAILABLE 1" in text
