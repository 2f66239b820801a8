"""Recovery from losing an expert service: kill -9 and SIGSTOP of a rank, p50/p99 over repeated runs.

    python -m bench.failover.rank_recovery --model DIR [--iterations 10] [--modes standby,supervised]

Two meshes (moemesh.launcher.Mesh) of 2 ranks on the CPU, with `moemesh up`'s
defaults (lease TTL, re-form settings, probes) but a long collective timeout
(30 s, so that no recovery comes from waiting it out), each under
`--clients` greedy Generate streams in a closed loop (bench/failover/chaos.py:
each client's first answer is its reference, every later answer must equal
it token for token):

- standby: 1 standby expert service. kill: SIGKILL; hang: SIGSTOP (then
  SIGCONT once recovered: it finds its rank taken and exits). The scheduler
  leader's rank probe revokes the victim's lease, the group is re-formed on
  the standby, a survivor stuck on the hung peer severs its old connections.
  The victim is restarted to be the next standby.
- supervised: no standby; `Mesh.restart_exited` runs every 0.2 s as under
  `moemesh up` (0.5 s there), with its supervisor: a killed rank is
  restarted, a frozen one is killed (silent on /readyz) and restarted;
  the group re-forms with the restarted process, so recovery includes a
  process start and a weight load.

Recovery: from the signal to the first token that ends the longest gap in
all clients' tokens after it (failure -> first resumed token). Writes
`--out`/rank_recovery.{json,md}.
"""

import argparse
import asyncio
import json
import pathlib
import sys
import threading
import time

from bench.failover import chaos
from moemesh import launcher

MODES = ("standby", "supervised")
TARGET_P99_MS = 1000.0


class SupervisedBench(chaos.Bench):
    """No standby: the supervision of `moemesh up` restarts the victim (killing it first if frozen)."""

    async def iteration(self, case: str, i: int) -> None:
        group, _, _, struck_at = await self.strike(case, i)
        await self.wait_recovered(case, i, group, struck_at)


async def run_mode(mode: str, args) -> dict:
    work_dir = str(args.work_dir / mode) if args.work_dir else ""
    spec = launcher.MeshSpec(model_dir=args.model, num_ranks=2, num_standby=1 if mode == "standby" else 0,
                             work_dir=work_dir, extra_args={"expert_svc": ["--collective-timeout-s", str(args.collective_timeout_s)]})
    started = time.monotonic()
    with launcher.Mesh(spec) as mesh:
        stop_supervising = threading.Event()
        supervising = None
        if mode == "supervised":
            # The bench kills each rank every few seconds on purpose: not the crash loop that
            # `moemesh up` gives up on after MAX_RESTARTS_PER_WINDOW restarts.
            launcher.MAX_RESTARTS_PER_WINDOW = max(launcher.MAX_RESTARTS_PER_WINDOW, 2 * args.iterations + 2)

            def supervise() -> None:
                while not stop_supervising.wait(0.2):
                    for name in mesh.restart_exited():
                        print(f"supervisor: restarted {name}", flush=True)

            supervising = threading.Thread(target=supervise, name="supervise", daemon=True)
            supervising.start()
        try:
            bench, load = await chaos.drive(mesh, args, num_experts=3 if mode == "standby" else 2,
                                            bench_type=SupervisedBench if mode == "supervised" else chaos.Bench)
        finally:
            stop_supervising.set()
            if supervising is not None:
                await asyncio.to_thread(supervising.join, 60)
        killed = list(mesh.supervisor.killed) if mesh.supervisor is not None else []
    result = chaos.summary(bench, load, time.monotonic() - started, args)
    result["supervisor_kills"] = killed
    return result


def write(results: dict, args, out: pathlib.Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "rank_recovery.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = ["# Rank recovery (bench/failover/rank_recovery.py)", "",
             f"`python -m bench.failover.rank_recovery --iterations {args.iterations}` on the CPU (tiny model, "
             f"2 ranks, `moemesh up`'s defaults, collective timeout {args.collective_timeout_s:g} s), "
             f"{args.clients} greedy clients of {args.new_tokens} tokens in a closed loop. Recovery: from the "
             f"signal to the first token after the longest gap in all clients' tokens (nearest-rank "
             f"percentiles). Target: p99 < {TARGET_P99_MS:.0f} ms.", "",
             "| mode | case | n | p50 ms | p99 ms | max ms | p99 < 1 s |", "|---|---|---|---|---|---|---|"]
    for mode, result in results["modes"].items():
        for case, c in result["cases"].items():
            met = "yes" if c["recovery_ms_p99"] < TARGET_P99_MS else "no"
            lines.append(f"| {mode} | {case} | {c['iterations']} | {c['recovery_ms_p50']:.0f} | "
                         f"{c['recovery_ms_p99']:.0f} | {c['recovery_ms_max']:.0f} | {met} |")
    lines += ["", "| mode | requests sent | completed exactly | completed, other tokens | failed | wall s |",
              "|---|---|---|---|---|---|"]
    for mode, r in results["modes"].items():
        exact = r["requests_completed"] - r["requests_mismatched"]
        failed = ", ".join(f"{k} {v}" for k, v in r["requests_failed"].items()) or "0"
        lines.append(f"| {mode} | {r['requests_sent']} | {exact} | {r['requests_mismatched']} | {failed} | "
                     f"{r['wall_s']} |")
    lines += ["", "standby: the leader's rank probe (a check every 0.1 s; 2 refusals, or 0.45 s without an answer "
              "after a serving one) revokes the lease of the dead or frozen rank, the group is re-formed on the "
              "standby (which loads its experts), the survivor severs the old epoch's connections, the gateway "
              "re-prefills every stream. supervised: the restarted process's start and weight load come on top "
              "(the supervisor kills a frozen one 1 s after its last /readyz answer)."]
    (out / "rank_recovery.md").write_text("\n".join(lines) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.failover.rank_recovery",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory (the tiny model on the CPU)")
    parser.add_argument("--iterations", type=int, default=10, help="disruptions per case and mode")
    parser.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES), help="standby,supervised")
    parser.add_argument("--cases", type=lambda s: s.split(","), default=list(chaos.CASES), help="kill,hang")
    parser.add_argument("--clients", type=int, default=16, help="concurrent streams")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens per request")
    parser.add_argument("--collective-timeout-s", type=float, default=30.0)
    parser.add_argument("--settle-s", type=float, default=1.0, help="load before each disruption")
    parser.add_argument("--out", type=pathlib.Path, default=chaos.RESULTS_DIR)
    parser.add_argument("--work-dir", type=pathlib.Path, default=None,
                        help="keep each mesh's logs in WORK_DIR/<mode> (default: a temporary directory)")
    args = parser.parse_args(argv)
    if bad := [m for m in args.modes if m not in MODES] + [c for c in args.cases if c not in chaos.CASES]:
        parser.error(f"unknown modes or cases {bad}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = {"modes": {}}
    for mode in args.modes:
        results["modes"][mode] = asyncio.run(run_mode(mode, args))
    write(results, args, args.out)
    print((args.out / "rank_recovery.md").read_text())
    bad = any(r["requests_failed"] or r["requests_mismatched"] for r in results["modes"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
