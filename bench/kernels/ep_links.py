"""The expert exchange's links on this machine: `moemesh measure-links` over loopback and across a bridge.

    python -m bench.kernels.ep_links [--rounds 3] [--repeats 5] [--out bench/results]   # as root

Two cases of two gloo ranks each (moemesh/link_probe.py, its default sizes:
64 B to 16 MiB to the peer, all_to_all_single, the CPU designs' collective):

- local: both processes in this network namespace, rendezvous on 127.0.0.1,
  one node: the link between ranks of one machine (loopback TCP);
- network: each process in its own network namespace (moemesh/netns.py: a
  veth pair from each onto a bridge, MTU 1500), gloo on their eth0
  (--ep-interface), two nodes: the link between hosts as the many-hosts test
  and bench run them. Not a physical network: the kernel copies the bytes
  between the namespaces. Skipped, and said so, where namespaces cannot be made.

Each round runs both cases in turn; the figures are the median over the rounds
of each round's fit (services/model/exchange/link_fit.py). Writes
ep_links_cpu.md and .json under --out; the last line printed is the
--ep-link-costs string of both link classes.
"""

import argparse
import contextlib
import json
import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from bench.serving.serve import RESULTS_DIR, write_result
from moemesh import etcd, link_probe, netns
from services.model.exchange import link_fit
from services.model.exchange.cost_model import parse_overrides

CASES = ("local", "network")
Popen = Callable[[int, list[str], pathlib.Path], subprocess.Popen]  # (rank, command, log) -> process


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="each case this many times, in turn")
    p.add_argument("--repeats", type=int, default=5, help="measure-links' --repeats")
    p.add_argument("--sizes", default=",".join(map(str, link_fit.DEFAULT_SIZES)), help="measure-links' --sizes")
    p.add_argument("--subnet", default="10.213.96.0/24", help="the namespaces' /24 (netns.Network)")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS_DIR)
    return p.parse_args(argv)


def run_ranks(popen: Popen, init_method: str, nodes: tuple[str, str], flags: list[str],
              work: pathlib.Path, name: str) -> dict:
    """One measurement of two ranks started by popen; rank 0's JSON (RuntimeError with the logs if one fails)."""
    out = work / f"{name}.json"
    logs = [work / f"{name}-rank{rank}.log" for rank in (0, 1)]
    procs = [popen(rank, link_probe.rank_command(init_method, 2, rank, nodes[rank], *flags,
                                                 *(["--json", str(out)] if rank == 0 else [])), logs[rank])
             for rank in (0, 1)]
    try:
        codes = [proc.wait(timeout=300) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    if codes != [0, 0]:
        raise RuntimeError(f"{name}: exit codes {codes}\n" + "\n".join(log.read_text()[-2000:] for log in logs))
    return json.loads(out.read_text())


def local_case(flags: list[str], work: pathlib.Path, name: str) -> dict:
    def popen(rank: int, command: list[str], log: pathlib.Path) -> subprocess.Popen:
        with open(log, "wb") as out:
            return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return run_ranks(popen, f"tcp://127.0.0.1:{etcd.free_port()}", ("local", "local"), flags, work, name)


def network_case(net: netns.Network, flags: list[str], work: pathlib.Path, name: str) -> dict:
    hosts = ("a", "b")
    return run_ranks(lambda rank, command, log: net.popen(hosts[rank], command, log),
                     f"tcp://{net.address('a')}:29500", hosts, [*flags, "--ep-interface", netns.INTERFACE],
                     work, name)


def median_line(lines: list[str]) -> str:
    """Per key, the median over the rounds' --ep-link-costs lines (in the first line's key order)."""
    rounds = [parse_overrides(line) for line in lines]
    return ",".join(f"{key}={statistics.median(r[key] for r in rounds):.4g}" for key in rounds[0])


def measurement_of(data: dict) -> link_fit.Measurement:
    """The Measurement of a run's JSON (its times refitted: the same figures)."""
    return link_fit.Measurement.fitted({c: {k: {int(s): us / 1e6 for s, us in by_size.items()}
                                            for k, by_size in by.items()} for c, by in data["times_us"].items()})


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or the architecture."""
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = ["# The expert exchange's links on a CPU machine (bench/kernels/ep_links.py)", "",
             f"`{report['command']}` at commit `{report['commit']}`, {report['date']}", "",
             f"{m['cpus']} CPUs ({m['cpu']}), torch {m['torch']}, load average {m['load_start']} at the start "
             f"and {m['load_end']} at the end (the machine is shared).", "",
             "Two gloo ranks per case, `moemesh measure-links` (all_to_all_single, the CPU designs' collective; "
             "a size is the bytes a rank sends its peer per call): local on loopback in one namespace, network "
             "across a veth bridge between two network namespaces (moemesh/netns.py, MTU 1500: the kernel "
             f"copies the bytes, no physical network). Latency: the median time of the {link_fit.NUM_SMALL} smallest "
             f"sizes; bandwidth: one over the least-squares slope over the {link_fit.NUM_LARGE} largest "
             f"({', '.join(f'{s:,}' for s in report['sizes'][-link_fit.NUM_LARGE:])} bytes). Each case ran once a "
             f"round, {report['repeats']} timed repeats a size (their median); the figures are the per-key "
             f"medians of the rounds.", "",
             "| round | --ep-link-costs |", "|---:|---|"]
    lines += [f"| {i + 1} | `{line}` |" for i, line in enumerate(report["round_lines"])]
    lines += ["", f"Median: `{report['ep_link_costs']}`", ""]
    for case in CASES:
        if report["cases"].get(case):
            lines += [f"## {case}: the last round", "", measurement_of(report["cases"][case][-1]).table(), ""]
        elif case in report["skipped"]:
            lines += [f"## {case}: skipped ({report['skipped'][case]})", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    flags = ["--sizes", args.sizes, "--repeats", str(args.repeats)]
    load_start = os.getloadavg()
    cases: dict[str, list[dict]] = {case: [] for case in CASES}
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="ep_links") as tmp:
        work = pathlib.Path(tmp)
        net = netns.Network(["a", "b"], subnet=args.subnet)
        try:
            net.start()
        except netns.Unavailable as why:
            net, skipped["network"] = None, str(why)
        try:
            for i in range(args.rounds):
                cases["local"].append(local_case(flags, work, f"local{i}"))
                if net is not None:
                    cases["network"].append(network_case(net, flags, work, f"network{i}"))
                print(f"round {i + 1}: " + ",".join(runs[-1]["ep_link_costs"] for runs in cases.values() if runs),
                      flush=True)
        finally:
            if net is not None:
                net.stop()
    round_lines = [",".join(cases[c][i]["ep_link_costs"] for c in CASES if cases[c]) for i in range(args.rounds)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=pathlib.Path(__file__).parent).stdout.strip()
    report = {"command": shlex.join(["python", "-m", "bench.kernels.ep_links", *argv]), "commit": commit,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": {"cpus": os.cpu_count(), "cpu": cpu_model(),
                          "torch": torch.__version__, "load_start": [round(x, 2) for x in load_start],
                          "load_end": [round(x, 2) for x in os.getloadavg()]},
              "sizes": list(link_fit.parse_sizes(args.sizes)), "repeats": args.repeats,
              "cases": cases, "skipped": skipped, "round_lines": round_lines,
              "ep_link_costs": median_line(round_lines)}
    text = markdown(report)
    write_result(args.out, "ep_links_cpu", report, text)
    print(text, flush=True)
    print(report["ep_link_costs"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
