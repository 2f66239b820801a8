"""bench/programs/ticket.py keeps one result per device: a run merges into the file by (answer setting,
version, concurrency), every run's command kept, each answer setting its own table."""

import json

from bench.programs import ticket


def _rows(p50: float, *loads: int) -> list[dict]:
    return [{"kind": kind, "concurrency": c, "num_tickets": 2, "wall_s": 1.0, "p50_s": p50, "p99_s": p50,
             "prefilled_tokens": 10, "answer_tokens": 6, "node_mean_s": {"answer": 0.5} if kind == "program" else {}}
            for c in loads for kind in ("sequential", "program")]


def _write(tmp_path, monkeypatch, argv: list[str], rows: list[dict]) -> dict:
    monkeypatch.setattr(ticket.sys, "argv", ["ticket", *argv])
    ticket.write(ticket.parse_args([*argv, "--out", str(tmp_path)]), rows, "services/model/demo")
    return json.loads((tmp_path / "programs_cpu.json").read_text())


def test_runs_merge_by_answer_setting_version_and_concurrency(tmp_path, monkeypatch):
    _write(tmp_path, monkeypatch, ["--concurrency", "1,16"], _rows(2.0, 1, 16))
    report = _write(tmp_path, monkeypatch, ["--answer-tokens", "32", "--concurrency", "1"], _rows(3.0, 1))
    assert [r["command"].split(" ", 3)[-1] for r in report["runs"]] == ["--concurrency 1,16",
                                                                         "--answer-tokens 32 --concurrency 1"]
    assert [(r["answers"], r["kind"], r["concurrency"], r["run"]) for r in report["rows"]] == [
        (None, "sequential", 1, 0), (None, "program", 1, 0), (None, "sequential", 16, 0), (None, "program", 16, 0),
        (32, "sequential", 1, 1), (32, "program", 1, 1)]
    text = (tmp_path / "programs_cpu.md").read_text()
    assert "## Answers up to 48 tokens" in text and "## Answers exactly 32 tokens" in text
    assert "| program | 16 | 2 | 2.0 | 2.0 | 1.0 | 10 | 6 | 0 |" in text

    report = _write(tmp_path, monkeypatch, ["--concurrency", "16"], _rows(4.0, 16))   # measures c16 again
    free = {(r["kind"], r["concurrency"]): (r["p50_s"], r["run"]) for r in report["rows"] if r["answers"] is None}
    assert free == {("sequential", 1): (2.0, 0), ("program", 1): (2.0, 0),
                    ("sequential", 16): (4.0, 2), ("program", 16): (4.0, 2)}
    assert len(report["runs"]) == 3 and len(report["rows"]) == 6


def test_a_result_written_before_merging_is_its_first_run():
    old = {"command": "python -m bench.programs.ticket --answer-tokens 32", "commit": "abc", "model": "m",
           "device": "cpu", "rows": _rows(1.0, 1)}
    new = ticket.normalized(old, answers=32)
    assert new["runs"] == [{"command": old["command"], "commit": "abc", "model": "m", "device": "cpu", "answers": 32}]
    assert {(r["answers"], r["run"]) for r in new["rows"]} == {(32, 0)}
    assert ticket.normalized(new) is new
    assert "answers exactly 32 tokens" in ticket.markdown(new)
