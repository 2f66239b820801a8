"""The programs benchmark in miniature on the shared mesh: both versions measured, the results written.
One round each (--rounds 1): the tickets of a run go in one batch, so at concurrency 2 the two run together
(at 1, one ticket: --num-tickets per concurrency)."""

import json

from bench.programs import ticket


def test_ticket_bench_measures_both_versions_and_writes_its_results(mesh, tmp_path):
    rc = ticket.main(["--target", mesh.gateway_address, "--num-tickets", "1,2", "--concurrency", "1,2",
                      "--api-delay", "0.01", "--rounds", "1", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "programs_cpu.json").read_text())
    assert rc == 0 and report["command"].startswith("python -m bench.programs.ticket")
    assert [(r["kind"], r["concurrency"]) for r in report["rows"]] == [
        ("sequential", 1), ("program", 1), ("sequential", 2), ("program", 2)]
    for row in report["rows"]:
        assert row["num_tickets"] == row["concurrency"] and 0 < row["p50_s"] <= row["p99_s"]
        assert row["prefilled_tokens"] > 0
    assert "| program | 1 | 1 |" in (tmp_path / "programs_cpu.md").read_text()


def test_ticket_bench_with_fixed_answers_compares_equal_work(mesh, tmp_path):
    rc = ticket.main(["--target", mesh.gateway_address, "--num-tickets", "2", "--concurrency", "2",
                      "--api-delay", "0.01", "--rounds", "1", "--answer-tokens", "3", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "programs_cpu.json").read_text())
    assert rc == 0 and report["commit"] and [r["answer_tokens"] for r in report["rows"]] == [6, 6]
    assert "exactly 3 tokens" in (tmp_path / "programs_cpu.md").read_text()
