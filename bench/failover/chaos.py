"""Expert-service chaos under load: does losing a rank lose a request, and for how long does it stall?

    python -m bench.failover.chaos --model DIR [--iterations 10] [--cases kill,hang] [--clients 16]

Starts a mesh (moemesh.launcher.Mesh) of 2 ranks and 1 standby expert
service on the CPU and keeps `--clients` greedy Generate streams in flight
the whole time (closed loop, one prompt per client). Each client's first
answer, before any disruption, is its reference; every later answer must
equal it token for token (a lost or repeated token would show). Then, per
case and iteration, a rank of the group (alternately rank 0 and rank 1) is

- kill: SIGKILLed, then restarted (Mesh.restart), to be the next standby;
- hang: SIGSTOPped; once the group serves again, SIGCONTed (it finds its
  rank taken and exits to restart clean) and restarted.

Recovery time: from the signal to the first token that ends the longest
gap in the token stream of all clients after the signal (failure -> first
token after the resume). Before each iteration the standby is registered
and the group serves. Writes `--out`/chaos.{json,md}.
"""

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import grpc

from gateway.stats import percentile
from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from moemesh import launcher
from services.cluster import ClusterClient, GroupAssignment

RESULTS_DIR = pathlib.Path(__file__).resolve().parents[1] / "results"
CASES = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP}


@dataclasses.dataclass(slots=True)
class Load:
    """What the clients saw."""

    num_sent: int = 0
    num_ok: int = 0
    num_mismatched: int = 0  # completed, but not with the client's reference tokens
    failed: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    first_errors: list[str] = dataclasses.field(default_factory=list)
    arrivals: list[float] = dataclasses.field(default_factory=list)  # every token's arrival time


async def client_loop(stub, load: Load, stop: asyncio.Event, client: int, args) -> None:
    """Sends one Generate after another until stop is set; checks each answer."""
    rng = random.Random(client)
    prompt_ids = [rng.randrange(200, 20_000) for _ in range(8 + client % 7)]
    sampling = gateway_pb2.SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    reference = None
    for n in range(sys.maxsize):
        if stop.is_set():
            return
        request = gateway_pb2.GenerateRequest(request_id=f"chaos-{client}-{n}", sampling=sampling,
                                              input_ids=gateway_pb2.TokenIds(ids=prompt_ids))
        load.num_sent += 1
        token_ids = []
        try:
            async for response in stub.Generate(request, timeout=120):
                token_ids += response.token_ids
                load.arrivals += [time.monotonic()] * len(response.token_ids)
        except grpc.RpcError as error:
            load.failed[error.code().name] += 1
            if len(load.first_errors) < 5:
                load.first_errors.append(f"{error.code().name}: {error.details()}")
            continue
        load.num_ok += 1
        reference = reference or token_ids
        load.num_mismatched += token_ids != reference


def recovery_s(arrivals: list[float], struck_at: float) -> float:
    """From the strike to the token that ends the longest gap after it."""
    after = sorted(t for t in arrivals if t >= struck_at)
    if not after:
        return float("nan")
    times = [struck_at, *after]
    gaps = [(b - a, b) for a, b in zip(times, times[1:])]
    _, resumed_at = max(gaps)
    return resumed_at - struck_at


class Bench:
    """The disruption loop over one running mesh."""

    def __init__(self, mesh: launcher.Mesh, cluster: ClusterClient, load: Load, args, num_experts: int = 3):
        self.mesh, self.cluster, self.load, self.args = mesh, cluster, load, args
        self.num_experts = num_experts  # registered when the mesh is whole (ranks + standbys)
        self.results: dict[str, list[float]] = {case: [] for case in args.cases}

    async def group(self) -> GroupAssignment:
        [group] = await self.cluster.list_groups()
        return group

    async def wait_healthy(self, timeout_s: float = 60.0) -> GroupAssignment:
        """Until every expert is registered and the group's epoch is ready, and tokens flow."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            experts = await self.cluster.list_members("expert")
            group = await self.group()
            ready = await self.cluster.ready_ranks(group.group_id, group.epoch)
            if len(experts) == self.num_experts and ready == set(range(group.world_size)) and self.load.arrivals \
                    and self.load.arrivals[-1] > time.monotonic() - 0.5:
                return group
            await asyncio.sleep(0.2)
        raise TimeoutError(f"the mesh did not settle within {timeout_s} s")

    async def iteration(self, case: str, i: int) -> None:
        group, name, role, struck_at = await self.strike(case, i)
        await self.wait_recovered(case, i, group, struck_at)
        if case == "hang":
            os.kill(role.proc.pid, signal.SIGCONT)  # awake, it finds its rank taken and exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(role.proc.wait, 30)
        await asyncio.to_thread(self.mesh.restart, name)

    async def strike(self, case: str, i: int) -> tuple[GroupAssignment, str, launcher.Role, float]:
        """Signals rank i % world_size of the healthy group: (group, victim's name and role, when)."""
        group = await self.wait_healthy()
        await asyncio.sleep(self.args.settle_s)
        name = group.ranks[i % group.world_size].member_id
        role = next(r for r in self.mesh.roles if r.name == name)
        struck_at = time.monotonic()
        os.kill(role.proc.pid, CASES[case])
        return group, name, role, struck_at

    async def wait_recovered(self, case: str, i: int, group: GroupAssignment, struck_at: float) -> None:
        """Until tokens flow on a newer epoch; records the recovery time."""
        reformed_at = None
        while reformed_at is None or self.load.arrivals[-1] < reformed_at:
            if time.monotonic() - struck_at > 90:
                raise TimeoutError(f"{case} {i}: no recovery within 90 s")
            if reformed_at is None and (await self.group()).epoch != group.epoch:
                reformed_at = time.monotonic()  # the requests resume only on the new epoch
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        took = recovery_s(self.load.arrivals, struck_at)
        self.results[case].append(took)
        print(f"{case} {i}: rank {i % group.world_size}, recovered in {took * 1000:.0f} ms", flush=True)


def summary(bench: Bench, load: Load, wall_s: float, args) -> dict:
    cases = {case: {"iterations": len(v), "recovery_ms_p50": percentile(v, 50) * 1000,
                    "recovery_ms_p99": percentile(v, 99) * 1000, "recovery_ms_max": max(v, default=0) * 1000}
             for case, v in bench.results.items()}
    return {"clients": args.clients, "new_tokens": args.new_tokens, "collective_timeout_s": args.collective_timeout_s,
            "requests_sent": load.num_sent, "requests_completed": load.num_ok,
            "requests_mismatched": load.num_mismatched, "requests_failed": dict(load.failed),
            "first_errors": load.first_errors, "cases": cases, "wall_s": round(wall_s, 1),
            "recovery_s": {case: [round(x, 3) for x in v] for case, v in bench.results.items()}}


def write(result: dict, out: pathlib.Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "chaos.json").write_text(json.dumps(result, indent=2) + "\n")
    failed = ", ".join(f"{k} {v}" for k, v in result["requests_failed"].items()) or "none"
    lines = [
        "# Expert-service chaos (bench/failover/chaos.py)", "",
        f"2 ranks + 1 standby on the CPU (tiny model), {result['clients']} greedy clients of "
        f"{result['new_tokens']} tokens in a closed loop, collective timeout {result['collective_timeout_s']} s, "
        f"{result['wall_s']} s in all.", "",
        f"Requests sent {result['requests_sent']}, completed {result['requests_completed']} "
        f"(of which not equal to the undisturbed reference: {result['requests_mismatched']}), "
        f"failed: {failed}. In flight at the end: "
        f"{result['requests_sent'] - result['requests_completed'] - sum(result['requests_failed'].values())}.", "",
        "| case | iterations | recovery p50 (ms) | p99 (ms) | max (ms) |", "|---|---|---|---|---|",
    ]
    for case, c in result["cases"].items():
        lines.append(f"| {case} | {c['iterations']} | {c['recovery_ms_p50']:.0f} | {c['recovery_ms_p99']:.0f} | "
                     f"{c['recovery_ms_max']:.0f} |")
    lines += ["", "Recovery: from the signal to the first token after the longest gap in all clients' tokens "
              "(failure -> first token after the resume). kill: lease expiry (1 s TTL) -> the standby takes the "
              "rank -> rejoin without reload -> re-prefill. hang: the survivor's collective times out first "
              "(the collective timeout bounds it from below)."]
    (out / "chaos.md").write_text("\n".join(lines) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.failover.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory (the tiny model on the CPU)")
    parser.add_argument("--iterations", type=int, default=10, help="disruptions per case")
    parser.add_argument("--cases", type=lambda s: s.split(","), default=list(CASES), help="kill,hang")
    parser.add_argument("--clients", type=int, default=16, help="concurrent streams")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens per request")
    parser.add_argument("--collective-timeout-s", type=float, default=3.0)
    parser.add_argument("--settle-s", type=float, default=1.0, help="load before each disruption")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if bad := [c for c in args.cases if c not in CASES]:
        parser.error(f"unknown cases {bad}; choose from {list(CASES)}")
    return args


async def run(args) -> dict:
    spec = launcher.MeshSpec(model_dir=args.model, num_ranks=2, num_standby=1, extra_args={
        "expert_svc": ["--collective-timeout-s", str(args.collective_timeout_s), "--lease-ttl-s", "1"],
        "scheduler_svc": ["--reform-settle-s", "2"],
        "gateway": ["--resume-timeout-s", "60"],
    })
    started = time.monotonic()
    with launcher.Mesh(spec) as mesh:
        bench, load = await drive(mesh, args)
    return summary(bench, load, time.monotonic() - started, args)


async def drive(mesh: launcher.Mesh, args, *, num_experts: int = 3, bench_type=None) -> tuple[Bench, Load]:
    """Keeps `args.clients` streams in flight on the mesh while every case's iterations run
    (bench_type's, Bench by default); returns the bench and what the clients saw."""
    async with ClusterClient(mesh.etcd_endpoint) as cluster, \
            grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        load, stop = Load(), asyncio.Event()
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        clients = [asyncio.create_task(client_loop(stub, load, stop, c, args)) for c in range(args.clients)]
        bench = (bench_type or Bench)(mesh, cluster, load, args, num_experts)
        try:
            for case in args.cases:
                for i in range(args.iterations):
                    await bench.iteration(case, i)
            await bench.wait_healthy()
        finally:
            stop.set()
            await asyncio.wait(clients, timeout=120)
    return bench, load


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    write(result, args.out)
    print(json.dumps({k: v for k, v in result.items() if k != "recovery_s"}, indent=2))
    return 0 if not result["requests_failed"] and not result["requests_mismatched"] else 1


if __name__ == "__main__":
    sys.exit(main())
