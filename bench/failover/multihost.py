"""Host loss and partition across real networks: how long do the streams stall, is a request lost?

    python -m bench.failover.multihost --model DIR [--iterations 3] [--clients 16]

Runs the mesh of tests/e2e/test_multihost.py (moemesh/multihost.py): three
network namespaces on a bridge, host a with etcd, the schedulers, the router,
the gateway and a standby expert service, hosts b and c the group's two
ranks (gloo across the bridge). `--clients` greedy Generate streams run in
a closed loop the whole time from the root namespace, each checked against
its first answer (bench/failover/chaos.py's clients). Each iteration:

- host: the host of a rank on b or c loses every process at once (SIGKILL
  of its namespace); a standby takes the rank; the host's expert service is
  started again and is the next standby;
- partition: the other such rank's host has its link to the bridge taken
  down; the rank fences itself and the group re-forms with the standby;
  the link comes back, the cut-off rank exits (its rank taken) and its
  restart is the next standby.

Recovery: from the failure to the first token ending the longest gap in
all clients' tokens after it (chaos.recovery_s). Writes `--out`/multihost.{json,md}.
Needs root and iproute2 (moemesh/netns.py).
"""

import argparse
import asyncio
import json
import pathlib
import sys
import tempfile
import time

import grpc

from bench.failover import chaos
from bench.failover.chaos import Load, client_loop, recovery_s
from moe.gateway.v1 import gateway_pb2_grpc
from moemesh import multihost, netns
from services.cluster import ClusterClient, GroupAssignment

RESULTS_DIR = pathlib.Path(__file__).resolve().parents[1] / "results"
CASES = ("host", "partition")
NUM_EXPERTS = 3  # the group's two ranks and one standby


class Bench(chaos.Bench):
    """The failure loop over one running mesh: chaos.Bench's group and settling, this mesh's cases."""

    def __init__(self, mesh: multihost.HostMesh, cluster: ClusterClient, load: Load, args):
        super().__init__(mesh, cluster, load, argparse.Namespace(cases=CASES), num_experts=NUM_EXPERTS)
        self.args = args

    async def wait_healthy(self, timeout_s: float = 90.0) -> GroupAssignment:
        return await super().wait_healthy(timeout_s)

    def victim(self, group: GroupAssignment) -> tuple[str, str]:
        """(member id, host) of the group's rank on another host than the control plane's."""
        for rank in group.ranks:
            host = self.mesh.roles[rank.member_id].host
            if host != self.mesh.spec.control_host:
                return rank.member_id, host
        raise RuntimeError(f"no rank of {group} is off the control host")

    async def recovered(self, case: str, group: GroupAssignment, struck_at: float) -> float:
        """Waits for the new epoch and the tokens after it; the recovery time."""
        reformed_at = None
        while reformed_at is None or self.load.arrivals[-1] < reformed_at:
            if time.monotonic() - struck_at > 90:
                raise TimeoutError(f"{case}: no recovery within 90 s")
            if reformed_at is None and (await self.group()).epoch != group.epoch:
                reformed_at = time.monotonic()  # the requests resume only on the new epoch
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        return recovery_s(self.load.arrivals, struck_at)

    async def iteration(self, i: int) -> None:
        net = self.mesh.net
        group = await self.wait_healthy()
        await asyncio.sleep(self.args.settle_s)
        name, host = self.victim(group)
        struck_at = time.monotonic()
        net.kill_host(host)
        self.record("host", i, name, host, await self.recovered("host", group, struck_at))
        await asyncio.to_thread(self.mesh.restart, name)  # the host is back: its expert is the next standby

        group = await self.wait_healthy()
        await asyncio.sleep(self.args.settle_s)
        name, host = self.victim(group)
        struck_at = time.monotonic()
        net.set_link(host, up=False)
        try:
            self.record("partition", i, name, host, await self.recovered("partition", group, struck_at))
        finally:
            net.set_link(host, up=True)
        # Back on the network it finds its rank taken and exits; its restart is the next standby.
        await asyncio.to_thread(self.mesh.roles[name].proc.wait, 60)
        await asyncio.to_thread(self.mesh.restart, name)

    def record(self, case: str, i: int, name: str, host: str, took: float) -> None:
        self.results[case].append(took)
        print(f"{case} {i}: host {host} ({name}), recovered in {took * 1000:.0f} ms", flush=True)


def summary(bench: Bench, load: Load, wall_s: float, args) -> dict:
    """chaos.summary's figures, with the experts' lease TTL this mesh runs."""
    return {**chaos.summary(bench, load, wall_s, args), "lease_ttl_s": 1}


def write(result: dict, out: pathlib.Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "multihost.json").write_text(json.dumps(result, indent=2) + "\n")
    failed = ", ".join(f"{k} {v}" for k, v in result["requests_failed"].items()) or "none"
    lines = [
        "# Host loss and partition (bench/failover/multihost.py)", "",
        f"Three network namespaces on a bridge, one CPU machine: host a with etcd, the schedulers, the router, "
        f"the gateway and a standby expert service; hosts b and c the group's two ranks (tiny model, gloo across "
        f"the bridge). {result['clients']} greedy clients of {result['new_tokens']} tokens in a closed loop from "
        f"the root namespace; lease TTL {result['lease_ttl_s']} s, collective timeout "
        f"{result['collective_timeout_s']} s; {result['wall_s']} s in all.", "",
        f"Requests sent {result['requests_sent']}, completed {result['requests_completed']} "
        f"(of which not equal to the undisturbed reference: {result['requests_mismatched']}), failed: {failed}. "
        f"In flight at the end: "
        f"{result['requests_sent'] - result['requests_completed'] - sum(result['requests_failed'].values())}.", "",
        "| case | iterations | recovery p50 (ms) | p99 (ms) | max (ms) | each run (ms) |", "|---|---|---|---|---|---|",
    ]
    for case, c in result["cases"].items():
        runs = ", ".join(f"{x * 1000:.0f}" for x in result["recovery_s"][case])
        lines.append(f"| {case} | {c['iterations']} | {c['recovery_ms_p50']:.0f} | {c['recovery_ms_p99']:.0f} | "
                     f"{c['recovery_ms_max']:.0f} | {runs} |")
    lines += ["", "Recovery: from the failure to the first token after the longest gap in all clients' tokens. "
              "host: every process of the rank's host SIGKILLed at once; partition: the rank's host cut off the "
              "bridge (nothing errors at once). The scheduler leader's rank probe loses the rank (2 refused checks, "
              "or 0.45 s without an answer after a serving one) and revokes its lease, the survivor severs the old epoch's connections, "
              "and the standby joins it; without the probe the lease TTL and the collective timeout bound it."]
    (out / "multihost.md").write_text("\n".join(lines) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.failover.multihost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory (the tiny model on the CPU)")
    parser.add_argument("--iterations", type=int, default=3, help="host losses and partitions, each")
    parser.add_argument("--clients", type=int, default=16, help="concurrent streams")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens per request")
    parser.add_argument("--collective-timeout-s", type=float, default=3.0)
    parser.add_argument("--settle-s", type=float, default=1.0, help="load before each failure")
    parser.add_argument("--work-dir", default="", help="logs and port files (default: a temporary directory)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS_DIR)
    return parser.parse_args(argv)


async def run(args) -> dict:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="moemesh-multihost-") as tmp, netns.Network(["a", "b", "c"]) as net:
        spec = multihost.HostMeshSpec(
            model_dir=args.model, work_dir=args.work_dir or tmp,
            ranks={"expert-b": "b", "expert-c": "c"}, standbys={"expert-a": "a"},
            extra_args={"expert_svc": ["--collective-timeout-s", str(args.collective_timeout_s), "--lease-ttl-s", "1"],
                        "scheduler_svc": ["--reform-settle-s", "2"], "gateway": ["--resume-timeout-s", "60"]})
        with multihost.HostMesh(net, spec) as mesh:
            async with ClusterClient(mesh.etcd_endpoint) as cluster, \
                    grpc.aio.insecure_channel(mesh.gateway_address) as channel:
                load, stop = Load(), asyncio.Event()
                stub = gateway_pb2_grpc.GenerationServiceStub(channel)
                clients = [asyncio.create_task(client_loop(stub, load, stop, c, args)) for c in range(args.clients)]
                bench = Bench(mesh, cluster, load, args)
                try:
                    for i in range(args.iterations):
                        await bench.iteration(i)
                    await bench.wait_healthy()
                finally:
                    stop.set()
                    await asyncio.wait(clients, timeout=120)
    return summary(bench, load, time.monotonic() - started, args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    write(result, args.out)
    print(json.dumps({k: v for k, v in result.items() if k != "recovery_s"}, indent=2))
    return 0 if not result["requests_failed"] and not result["requests_mismatched"] else 1


if __name__ == "__main__":
    sys.exit(main())
