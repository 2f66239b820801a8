"""bench/serving/sampling_cost.py runs on the CPU and reports the op count of one step's draws."""

from bench.serving import sampling_cost


def test_sampling_cost_reports_ops_and_time(capsys):
    assert sampling_cost.main(["--rows", "4", "--vocab", "64"]) == 0
    out = capsys.readouterr().out
    assert "rows 4, vocab 64, top_p 0.95, cpu:" in out and "aten ops" in out
    assert int(out.split(" aten ops")[0].rsplit(" ", 1)[1]) > 0
