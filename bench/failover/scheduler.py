"""Scheduler failover under load: how long the mesh goes without a leader.

    python -m bench.failover.scheduler [--iterations 20] [--cases crash,graceful,hung] [--clients 2]

Starts a mesh (moemesh.launcher.Mesh: etcd, three schedulers, the router,
one expert service and the gateway, as `moemesh up` does) on the tiny model
and keeps `--clients` Generate streams in flight through the gateway the
whole time, counting every failed request by status code. Then, per case
and iteration, it finds the leader (GetClusterState), disrupts its process
and measures from the signal until a new leader holds `/leader` in etcd
(`key`) and answers GetClusterState saying it is the leader (`serving`,
what the table reports):

- crash: SIGKILL. The followers' health checks fail; one revokes its lease.
  The killed replica is restarted (Mesh.restart) and rejoins as a follower.
- graceful: SIGTERM. The leader revokes its own lease; restarted likewise.
- hung: SIGSTOP. The followers' checks time out. Then SIGCONT: the replica
  finds its lease gone, steps down and registers again by itself (it is
  restarted only if it has not within 10 s, which is recorded).

Before each iteration all three replicas are registered and the followers
have been probing the leader for `--settle-s`. A leader change that the
benchmark did not cause counts as spurious (a false positive of the
probes), and the worker group is checked to be untouched (same group, epoch
and term) after every failover. Writes `--out`/failover.{json,md}.
"""

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import pathlib
import shlex
import signal
import sys
import time

import grpc

from gateway.stats import percentile
from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from moe.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.cluster import ClusterClient, LeaderInfo

RESULTS_DIR = pathlib.Path(__file__).resolve().parents[1] / "results"
CASES = {"crash": signal.SIGKILL, "graceful": signal.SIGTERM, "hung": signal.SIGSTOP}
TARGETS_MS = {"crash": 800.0, "graceful": 50.0, "hung": 1000.0}  # p99, from issue 5
PROMPT_IDS = [9707, 11, 1879, 0, 220, 1234, 5678, 42, 4321, 77]
_REJOIN_S = 10.0
# How long the benchmark waits between GetClusterState calls to a new leader that does not lead yet.
_POLL_S = 0.002


@dataclasses.dataclass(slots=True)
class Load:
    """What the clients saw."""

    num_ok: int = 0
    failed: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    first_errors: list[str] = dataclasses.field(default_factory=list)


async def client_loop(stub, load: Load, stop: asyncio.Event, client: int, max_new_tokens: int) -> None:
    """Sends one Generate after another until stop is set."""
    sampling = gateway_pb2.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    for n in range(sys.maxsize):
        if stop.is_set():
            return
        request = gateway_pb2.GenerateRequest(request_id=f"load-{client}-{n}", sampling=sampling,
                                              input_ids=gateway_pb2.TokenIds(ids=PROMPT_IDS))
        try:
            async for _ in stub.Generate(request, timeout=60):
                pass
            load.num_ok += 1
        except grpc.RpcError as error:
            load.failed[error.code().name] += 1
            if len(load.first_errors) < 5:
                load.first_errors.append(f"{error.code().name}: {error.details()}")


class LeaderLog:
    """Every change of /leader as this process's watch saw it, timestamped."""

    def __init__(self, cluster: ClusterClient):
        self._cluster = cluster
        self.changes: list[tuple[float, LeaderInfo | None]] = []
        self._changed = asyncio.Event()

    async def run(self) -> None:
        async with contextlib.aclosing(self._cluster.watch_leader()) as leaders:
            async for leader in leaders:
                self.changes.append((time.perf_counter(), leader))
                self._changed.set()

    async def wait_term_above(self, term: int, timeout_s: float) -> tuple[float, LeaderInfo]:
        """(when it was seen, the leader) of the first leader with a larger term."""
        deadline = time.monotonic() + timeout_s
        while True:
            for seen_at, leader in self.changes:
                if leader is not None and leader.term > term:
                    return seen_at, leader
            self._changed.clear()
            await asyncio.wait_for(self._changed.wait(), max(0.0, deadline - time.monotonic()))

    def terms(self) -> list[int]:
        return sorted({leader.term for _, leader in self.changes if leader is not None})


class Schedulers:
    """GetClusterState on any replica, over one channel per address."""

    def __init__(self):
        self._stubs: dict[str, scheduler_pb2_grpc.SchedulerServiceStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    async def state(self, address: str, timeout_s: float = 1.0) -> scheduler_pb2.GetClusterStateResponse | None:
        if address not in self._stubs:
            self._channels.append(grpc.aio.insecure_channel(address))
            self._stubs[address] = scheduler_pb2_grpc.SchedulerServiceStub(self._channels[-1])
        try:
            return await self._stubs[address].GetClusterState(scheduler_pb2.GetClusterStateRequest(),
                                                              timeout=timeout_s)
        except grpc.RpcError:
            return None

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels))


def group_view(state: scheduler_pb2.GetClusterStateResponse) -> list[tuple]:
    """What a failover must not change: each group's id, epoch, term, ranks and gateway."""
    return [(g.group_id, g.placement_epoch, g.term, tuple(r.member_id for r in g.ranks), g.gateway_id)
            for g in state.groups]


class Bench:
    """The measurement loop over one running mesh."""

    def __init__(self, mesh, cluster: ClusterClient, args):
        self.mesh, self.cluster, self.args = mesh, cluster, args
        self.leaders = LeaderLog(cluster)
        self.schedulers = Schedulers()
        self.samples: dict[str, list[dict]] = {case: [] for case in args.cases}
        self.num_restarted_after_hang = 0
        self.num_group_changes = 0
        self.started_at = time.perf_counter()
        self.load_avg_at_start = os.getloadavg()

    def role(self, name: str):
        return next(r for r in self.mesh.roles if r.name == name)

    async def current(self) -> scheduler_pb2.GetClusterStateResponse:
        """The cluster state from any replica that answers, once it names a leader."""
        for _ in range(1000):
            for address in self.mesh.scheduler_addresses:
                state = await self.schedulers.state(address)
                if state is not None and state.HasField("leader"):
                    return state
            await asyncio.sleep(0.01)
        raise RuntimeError("no scheduler names a leader")

    async def settle(self) -> None:
        """All three replicas registered, then --settle-s for the probes to start."""
        deadline = time.monotonic() + 30
        while len(await self.cluster.list_members("scheduler")) < 3:
            if time.monotonic() > deadline:
                raise RuntimeError("a scheduler replica did not register again")
            await asyncio.sleep(0.05)
        for address in self.mesh.scheduler_addresses:  # a client's channels are open already
            await self.schedulers.state(address)
        await asyncio.sleep(self.args.settle_s)

    async def failover(self, case: str) -> dict:
        """One disruption of the leader; returns its sample."""
        state = await self.current()
        name, old_term, groups = state.leader.member_id, state.leader.term, group_view(state)
        proc = self.role(name).proc
        load_avg = os.getloadavg()[0]
        signalled_at = time.time()  # to find the failover in the processes' logs
        started = time.perf_counter()
        os.kill(proc.pid, CASES[case])
        key_at, leader = await self.leaders.wait_term_above(old_term, 10.0)
        serving_at, new_state = await self.leading(leader, 10.0)
        if group_view(new_state) != groups:
            self.num_group_changes += 1
        exited_at = await self.restore(case, name)
        return {"old": name, "new": leader.member_id, "term": leader.term, "signalled_at": signalled_at,
                "load_avg_1m": load_avg, "exit_ms": None if exited_at is None else 1000 * (exited_at - started),
                "key_ms": 1000 * (key_at - started), "serving_ms": 1000 * (serving_at - started)}

    async def leading(self, leader: LeaderInfo,
                      timeout_s: float) -> tuple[float, scheduler_pb2.GetClusterStateResponse]:
        """(when it arrived, the answer) of the first GetClusterState answer
        from the replica that `leader` names saying that it leads in that term,
        asked again _POLL_S after each answer."""
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            state = await self.schedulers.state(leader.address, timeout_s=0.5)
            if state is not None and state.is_leader and state.leader.term == leader.term:
                return time.perf_counter(), state
            await asyncio.sleep(_POLL_S)
        raise RuntimeError(f"{leader.member_id} did not say it leads term {leader.term} within {timeout_s} s")

    async def restore(self, case: str, name: str) -> float | None:
        """Brings the disrupted replica back as a follower; returns when a
        replica stopped with SIGTERM had exited (perf_counter), else None."""
        role, exited_at = self.role(name), None
        if case == "hung":
            os.kill(role.proc.pid, signal.SIGCONT)
            if await self.rejoined(name):
                return None
            self.num_restarted_after_hang += 1
        elif case == "graceful":
            deadline = time.perf_counter() + 60
            while role.proc.poll() is None and time.perf_counter() < deadline:
                await asyncio.sleep(0.01)
            exited_at = time.perf_counter()
            if role.proc.returncode != 0:
                raise RuntimeError(f"{name} exited with {role.proc.returncode} after SIGTERM")
        await asyncio.to_thread(self.mesh.restart, name)
        return exited_at

    async def rejoined(self, name: str) -> bool:
        """True once name is registered again and says it follows."""
        deadline = time.monotonic() + _REJOIN_S
        address = f"127.0.0.1:{self.role(name).port}"
        while time.monotonic() < deadline:
            members = {m.member_id for m in await self.cluster.list_members("scheduler")}
            state = await self.schedulers.state(address, timeout_s=0.5)
            if name in members and state is not None and state.HasField("leader") and not state.is_leader:
                return True
            await asyncio.sleep(0.05)
        return False

    async def run(self) -> Load:
        load, stop = Load(), asyncio.Event()
        watch = asyncio.create_task(self.leaders.run())
        async with grpc.aio.insecure_channel(self.mesh.gateway_address) as channel:
            stub = gateway_pb2_grpc.GenerationServiceStub(channel)
            clients = [asyncio.create_task(client_loop(stub, load, stop, i, self.args.max_new_tokens))
                       for i in range(self.args.clients)]
            try:
                await self.settle()
                for case in self.args.cases:
                    for i in range(self.args.iterations):
                        sample = await self.failover(case)
                        self.samples[case].append(sample)
                        print(f"{case} {i + 1}/{self.args.iterations}: {sample['old']} -> {sample['new']} "
                              f"key {sample['key_ms']:.0f} ms, serving {sample['serving_ms']:.0f} ms", flush=True)
                        await self.settle()
            finally:
                stop.set()
                if clients:
                    await asyncio.wait(clients, timeout=90)
                watch.cancel()
                await self.schedulers.close()
        return load


def summarize(bench: Bench, load: Load, args, argv: list[str]) -> dict:
    cases = {}
    for case, samples in bench.samples.items():
        serving = [s["serving_ms"] for s in samples]
        key = [s["key_ms"] for s in samples]
        cases[case] = {
            "n": len(samples), "p50_ms": percentile(serving, 50), "p99_ms": percentile(serving, 99),
            "max_ms": max(serving, default=0.0), "key_p50_ms": percentile(key, 50),
            "exit_max_ms": max((s["exit_ms"] for s in samples if s["exit_ms"] is not None), default=None),
            "key_p99_ms": percentile(key, 99), "target_p99_ms": TARGETS_MS[case],
            "is_met": bool(samples) and percentile(serving, 99) < TARGETS_MS[case], "samples": samples,
        }
    caused = {s["term"] for samples in bench.samples.values() for s in samples}
    first_term = bench.leaders.terms()[0] if bench.leaders.terms() else 0
    spurious = [{"term": leader.term, "leader": leader.member_id, "at_s": round(seen_at - bench.started_at, 3)}
                for seen_at, leader in bench.leaders.changes
                if leader is not None and leader.term != first_term and leader.term not in caused]
    return {
        "command": "python -m bench.failover.scheduler " + shlex.join(argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": {"cpus": os.cpu_count(), "load_avg_at_start": bench.load_avg_at_start,
                    "load_avg_at_end": os.getloadavg()},
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "cases": cases,
        "requests": {"ok": load.num_ok, "failed": dict(load.failed), "first_errors": load.first_errors},
        "spurious_leader_changes": len(spurious),
        "spurious_terms": spurious,
        "group_changes": bench.num_group_changes,
        "hung_leaders_restarted": bench.num_restarted_after_hang,
    }


def markdown(report: dict) -> str:
    lines = ["| case | n | p50 ms | p99 ms | max ms | key p50 ms | target p99 | met |",
             "|---|---|---|---|---|---|---|---|"]
    for case, c in report["cases"].items():
        lines.append(f"| {case} | {c['n']} | {c['p50_ms']:.0f} | {c['p99_ms']:.0f} | {c['max_ms']:.0f} | "
                     f"{c['key_p50_ms']:.0f} | < {c['target_p99_ms']:.0f} | {'yes' if c['is_met'] else 'no'} |")
    requests = report["requests"]
    failed = sum(requests["failed"].values())
    lines += ["", f"Client requests during the run: {requests['ok']} ok, {failed} failed"
              + (f" ({requests['failed']})" if failed else "") + ".",
              f"Spurious leader changes: {report['spurious_leader_changes']}; worker group changed by a "
              f"failover: {report['group_changes']}; hung leaders that needed a restart: "
              f"{report['hung_leaders_restarted']}."]
    return "\n".join(lines)


def tiny_model(path: pathlib.Path | None) -> pathlib.Path:
    """--model, or the tiny preset built once under the moemesh cache."""
    if path is not None:
        return path
    from moemesh import launcher
    from services.model import make_model

    path = launcher.cache_dir() / "models" / "tiny-seed1234"
    if not (path / "config.json").is_file():
        make_model.make_random_checkpoint(path, make_model.PRESETS["tiny"], seed=1234)
    return path


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.failover.scheduler", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=pathlib.Path, help="checkpoint dir (default: the tiny preset)")
    parser.add_argument("--iterations", type=int, default=20, help="failovers per case (default 20)")
    parser.add_argument("--cases", type=lambda s: s.split(","), default=list(CASES),
                        help="comma-separated, of crash, graceful, hung (default all)")
    parser.add_argument("--clients", type=int, default=2, help="Generate streams kept in flight (default 2)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="tokens per load request (default 16)")
    parser.add_argument("--settle-s", type=float, default=0.5, help="wait before each failover (default 0.5)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS_DIR, help="where failover.{json,md} go")
    parser.add_argument("--work-dir", default="", help="keep the mesh's logs here (default: a temporary dir)")
    args = parser.parse_args(argv)
    if unknown := set(args.cases) - set(CASES):
        parser.error(f"unknown --cases {sorted(unknown)}; choose from {list(CASES)}")
    if args.iterations < 1 or args.clients < 0:
        parser.error("--iterations must be >= 1 and --clients >= 0")
    return args


async def run_bench(mesh, args) -> tuple[Bench, Load]:
    cluster = ClusterClient(mesh.etcd_endpoint)
    await cluster.connect()
    try:
        bench = Bench(mesh, cluster, args)
        return bench, await bench.run()
    finally:
        await cluster.close()


def main(argv: list[str] | None = None) -> int:
    from moemesh.launcher import Mesh, MeshSpec

    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    model = tiny_model(args.model)
    with Mesh(MeshSpec(model_dir=str(model), num_ranks=1, device="cpu", work_dir=args.work_dir)) as mesh:
        bench, load = asyncio.run(run_bench(mesh, args))
    report = summarize(bench, load, args, argv)
    table = markdown(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "failover.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    load_avg = report["machine"]["load_avg_at_start"][0], report["machine"]["load_avg_at_end"][0]
    (args.out / "failover.md").write_text(
        f"# Scheduler failover\n\n`{report['command']}` on {report['date']}: {os.cpu_count()} CPUs shared "
        f"with other work (1-minute load average {load_avg[0]:.1f} at the start, {load_avg[1]:.1f} at the end), the "
        f"tiny model on the CPU, {args.clients} client streams in flight throughout. Times from the signal; "
        f"`key`: this process's watch saw a new /leader; p50/p99/max: that replica also answers "
        f"GetClusterState (asked every {1000 * _POLL_S:.0f} ms from `key` on) that it is the leader, its "
        f"election holding the term (nearest-rank percentiles: with 20 samples p99 is the maximum).\n\n{table}\n")
    print(table)
    print(f"\nwrote {args.out / 'failover.json'} and {args.out / 'failover.md'}")
    return 0 if all(c["is_met"] for c in report["cases"].values()) and not load.failed else 1


if __name__ == "__main__":
    sys.exit(main())
