"""`moemesh measure-links` (moemesh/link_probe.py): two gloo processes on loopback measure the local
link and rank 0 prints an --ep-link-costs line that the cost model takes, with finite positive
figures; bad flags are refused before any process group starts."""

import json
import math
import subprocess

import pytest

from moemesh import etcd, link_probe
from services.model.exchange.cost_model import LinkCosts, parse_overrides

# The largest three well past the latency (about 0.2-0.3 ms on loopback), so the slope is the bytes':
# with sizes of a few KiB gloo's noise can make it flat. The whole run still takes a few seconds.
SIZES = "64,256,1024,1048576,4194304,8388608"


def test_two_processes_on_loopback_measure_the_local_link(tmp_path):
    init = f"tcp://127.0.0.1:{etcd.free_port()}"
    out = tmp_path / "links.json"
    flags = ("--sizes", SIZES, "--repeats", "2", "--timeout-s", "60")
    procs = [subprocess.Popen(link_probe.rank_command(init, 2, rank, "here", *flags, "--json", str(out)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        results = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert [proc.returncode for proc in procs] == [0, 0], [err for _, err in results]
    printed, silent = results[0][0], results[1][0]
    assert silent == "" and "pairs local: 0-1" in printed
    line = printed.strip().splitlines()[-1]
    values = parse_overrides(line)
    assert set(values) == {"local_latency_us", "local_gbps"}
    assert all(math.isfinite(v) and v > 0 for v in values.values())
    costs = LinkCosts.for_device("cpu", line)
    assert costs.local.latency_s == pytest.approx(values["local_latency_us"] / 1e6)
    assert costs.network == LinkCosts.for_device("cpu").network  # no network pair, no network figure
    data = json.loads(out.read_text())
    assert data["ep_link_costs"] == line and data["nodes"] == ["here", "here"]
    assert set(data["times_us"]["local"]["all_to_all"]) == set(SIZES.split(","))


@pytest.mark.parametrize("flags, message", [
    (["--world-size", "2", "--rank", "0"], "--init-method is required"),
    (["--init-method", "tcp://127.0.0.1:1", "--world-size", "1", "--rank", "0"], "a world size of at least 2"),
    (["--init-method", "tcp://127.0.0.1:1", "--world-size", "2", "--rank", "0", "--sizes", "64,128"],
     "more than 3 distinct values"),
    (["--init-method", "tcp://127.0.0.1:1", "--world-size", "2", "--rank", "0", "--collectives", "broadcast"],
     "collectives must be of"),
    (["--init-method", "tcp://127.0.0.1:1", "--world-size", "2", "--rank", "0", "--ep-interface", "nosuch0"],
     "interface 'nosuch0' has no IPv4 address"),
])
def test_bad_flags_are_refused_before_the_measurement(flags, message, capsys, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert link_probe.main(["--node", "n", *flags]) == 2
    assert message in capsys.readouterr().err
