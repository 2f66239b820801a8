"""bench/kernels/ep_links.py without processes: the per-key median over the rounds' lines, the
runs' JSON refitted to the same figures, and what its result file says (tests/moemesh/
test_link_probe.py runs the measuring processes)."""

import pytest

from bench.kernels import ep_links
from services.model.exchange import link_fit


def _run(link_class: str, latency_s: float, bytes_per_s: float) -> dict:
    times = {size: latency_s + size / bytes_per_s for size in link_fit.DEFAULT_SIZES}
    return {"nodes": ["a", "b"], **link_fit.Measurement.fitted({link_class: {"all_to_all": times}}).as_json()}


def test_the_figures_are_per_key_medians_of_the_rounds():
    lines = ["local_latency_us=300,local_gbps=1", "local_latency_us=100,local_gbps=3",
             "local_latency_us=200,local_gbps=2"]
    assert ep_links.median_line(lines) == "local_latency_us=200,local_gbps=2"


def test_a_runs_json_refits_to_its_own_figures():
    run = _run("network", 400e-6, 0.75e9)
    assert ep_links.measurement_of(run).overrides_line() == run["ep_link_costs"]
    assert ep_links.measurement_of(run).links["network"].bytes_per_s == pytest.approx(0.75e9)


def test_the_result_names_every_round_the_median_and_a_skipped_case():
    rounds = [_run("local", 250e-6, 1e9), _run("local", 300e-6, 0.9e9)]
    report = {"command": "python -m bench.kernels.ep_links", "commit": "abc1234", "date": "now",
              "machine": {"cpus": 2, "cpu": "x", "torch": "2", "load_start": [0], "load_end": [1]},
              "sizes": list(link_fit.DEFAULT_SIZES), "repeats": 5, "cases": {"local": rounds, "network": []},
              "skipped": {"network": "network namespaces need root"},
              "round_lines": [r["ep_link_costs"] for r in rounds]}
    report["ep_link_costs"] = ep_links.median_line(report["round_lines"])
    text = ep_links.markdown(report)
    assert f"| 2 | `{rounds[1]['ep_link_costs']}` |" in text
    assert f"Median: `{report['ep_link_costs']}`" in text and "local_gbps=0.95" in report["ep_link_costs"]
    # the latency: the small sizes' median, 256 B at 0.9 GB/s on top of the 300 us
    assert "## local: the last round" in text and "| local | all_to_all | 300.3 | 0.900 |" in text
    assert "## network: skipped (network namespaces need root)" in text
