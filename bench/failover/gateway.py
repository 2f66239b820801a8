"""Gateway failover: how long a group goes unserved after its gateway dies.

    python -m bench.failover.gateway [--iterations 10] [--streams 2]

Starts a mesh (moemesh.launcher.Mesh: etcd, three schedulers, the router,
one expert service and two gateways) on the tiny model. Per iteration it
opens `--streams` long Generate streams on the gateway serving the group,
SIGKILLs that gateway, and measures from the signal:

- `streams`: until every open stream has ended (they must end with
  UNAVAILABLE, not hang: their clients can retry elsewhere);
- `lease`: until the dead gateway's member key is gone from etcd (the
  scheduler leader's gateway probe found its port refusing and revoked its
  lease; with `--no-gateway-probe`, once the lease TTL ran out);
- `assigned`: until the group's record names the standby (the scheduler
  leader reassigned it);
- `takeover` (what the table reports): until the standby has served a
  greedy request, sent every 20 ms and answered UNAVAILABLE until then.

The killed gateway is restarted (Mesh.restart) and becomes the next standby.
Writes `--out`/gateway_failover.{json,md}.
"""

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import shlex
import signal
import sys
import time

import grpc

from bench.failover.scheduler import RESULTS_DIR, tiny_model
from gateway.stats import percentile
from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from services.cluster import ClusterClient

PROMPT_IDS = [9707, 11, 1879, 0, 220, 1234, 5678]


async def generate(stub, request_id: str, max_new_tokens: int, timeout_s: float = 60) -> list[int]:
    sampling = gateway_pb2.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    request = gateway_pb2.GenerateRequest(request_id=request_id, input_ids=gateway_pb2.TokenIds(ids=PROMPT_IDS),
                                          sampling=sampling)
    ids = []
    async for response in stub.Generate(request, timeout=timeout_s):
        ids.extend(response.token_ids)
    return ids


async def open_stream(stub, request_id: str) -> tuple[asyncio.Task, asyncio.Event]:
    """A long stream; its task returns (status code name, when it ended)."""
    first = asyncio.Event()

    async def consume() -> tuple[str, float]:
        try:
            sampling = gateway_pb2.SamplingParams(max_new_tokens=4000, temperature=0.0, ignore_eos=True)
            request = gateway_pb2.GenerateRequest(request_id=request_id, sampling=sampling,
                                                  input_ids=gateway_pb2.TokenIds(ids=PROMPT_IDS))
            async for _ in stub.Generate(request, timeout=120):
                first.set()
        except grpc.RpcError as error:
            return error.code().name, time.perf_counter()
        return "OK", time.perf_counter()

    return asyncio.create_task(consume()), first


class Bench:
    def __init__(self, mesh, cluster: ClusterClient, args):
        self.mesh, self.cluster, self.args = mesh, cluster, args
        self.samples: list[dict] = []

    def gateways(self) -> dict[str, str]:
        """member id -> address of every gateway role."""
        return {(f"gateway-{r.name.rsplit('-', 1)[1]}" if "-" in r.name else "gateway-0"): f"127.0.0.1:{r.port}"
                for r in self.mesh.roles if r.name.startswith("gateway")}

    def role_of(self, member_id: str):
        name = "gateway" if member_id == "gateway-0" else member_id
        return next(r for r in self.mesh.roles if r.name == name)

    async def serving_gateway(self) -> str:
        """The member id of the gateway the group is assigned to, once it serves."""
        for _ in range(3000):
            groups = await self.cluster.list_groups()
            if groups and groups[0].gateway_id:
                member_id = groups[0].gateway_id
                with contextlib.suppress(grpc.RpcError):
                    async with grpc.aio.insecure_channel(self.gateways()[member_id]) as ch:
                        await generate(gateway_pb2_grpc.GenerationServiceStub(ch), "probe", 1)
                        return member_id
            await asyncio.sleep(0.02)
        raise RuntimeError("no gateway serves the group")

    async def failover(self, i: int) -> dict:
        active = await self.serving_gateway()
        [standby] = [g for g in self.gateways() if g != active]
        addresses = self.gateways()
        async with grpc.aio.insecure_channel(addresses[active]) as ch_a, \
                grpc.aio.insecure_channel(addresses[standby]) as ch_b:
            stub_a, stub_b = gateway_pb2_grpc.GenerationServiceStub(ch_a), gateway_pb2_grpc.GenerationServiceStub(ch_b)
            streams = [await open_stream(stub_a, f"open-{i}-{k}") for k in range(self.args.streams)]
            await asyncio.gather(*(first.wait() for _, first in streams))
            with contextlib.suppress(grpc.RpcError):  # the standby's channel is connected already
                await generate(stub_b, "warm", 1, timeout_s=2)
            started = time.perf_counter()
            os.kill(self.role_of(active).proc.pid, signal.SIGKILL)
            watch = asyncio.create_task(self.watch_etcd(active, standby, started))
            num_refused = 0
            while True:
                try:
                    await generate(stub_b, f"after-{i}", 1, timeout_s=10)
                    break
                except grpc.RpcError as error:
                    if error.code() != grpc.StatusCode.UNAVAILABLE or time.perf_counter() - started > 60:
                        raise
                    num_refused += 1
                    await asyncio.sleep(0.02)
            takeover_at = time.perf_counter()
            ended = await asyncio.gather(*(task for task, _ in streams))
            lease_at, assigned_at = await watch
        await asyncio.to_thread(self.mesh.restart, self.role_of(active).name)
        return {"killed": active, "standby": standby, "takeover_ms": 1000 * (takeover_at - started),
                "lease_ms": 1000 * (lease_at - started), "assigned_ms": 1000 * (assigned_at - started),
                "streams_ms": 1000 * (max(t for _, t in ended) - started),
                "stream_codes": sorted(code for code, _ in ended), "refused_before": num_refused}

    async def watch_etcd(self, killed: str, standby: str, started: float) -> tuple[float, float]:
        """(when the killed gateway's member key was gone, when the group named the standby)."""
        lease_at = assigned_at = None
        while lease_at is None or assigned_at is None:
            snapshot = await self.cluster.snapshot()
            now = time.perf_counter()
            if lease_at is None and killed not in {m.member_id for m in snapshot.members}:
                lease_at = now
            if assigned_at is None and any(g.gateway_id == standby for g in snapshot.groups):
                assigned_at = now
            if now - started > 60:
                raise RuntimeError("the standby was not assigned the group within 60 s")
            await asyncio.sleep(0.01)
        return lease_at, assigned_at

    async def run(self) -> None:
        for i in range(self.args.iterations):
            sample = await self.failover(i)
            self.samples.append(sample)
            print(f"{i + 1}/{self.args.iterations}: {sample['killed']} -> {sample['standby']}: streams ended "
                  f"{sample['streams_ms']:.0f} ms ({','.join(sample['stream_codes'])}), lease gone "
                  f"{sample['lease_ms']:.0f} ms, assigned {sample['assigned_ms']:.0f} ms, takeover "
                  f"{sample['takeover_ms']:.0f} ms", flush=True)


def summarize(bench: Bench, args, argv: list[str], load_at_start) -> dict:
    def stats(key: str) -> dict:
        values = [s[key] for s in bench.samples]
        return {"p50": percentile(values, 50), "p99": percentile(values, 99), "max": max(values, default=0.0)}

    return {
        "command": "python -m bench.failover.gateway " + shlex.join(argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": {"cpus": os.cpu_count(), "load_avg_at_start": load_at_start, "load_avg_at_end": os.getloadavg()},
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "n": len(bench.samples),
        "ms": {key: stats(f"{key}_ms") for key in ("streams", "lease", "assigned", "takeover")},
        "all_streams_unavailable": all(c == "UNAVAILABLE" for s in bench.samples for c in s["stream_codes"]),
        "samples": bench.samples,
    }


def markdown(report: dict) -> str:
    lines = ["| from the kill until | p50 ms | p99 ms | max ms |", "|---|---|---|---|"]
    names = {"streams": "the open streams ended (UNAVAILABLE)", "lease": "the gateway's member key is gone",
             "assigned": "the group names the standby", "takeover": "**the standby served a request**"}
    for key, name in names.items():
        s = report["ms"][key]
        lines.append(f"| {name} | {s['p50']:.0f} | {s['p99']:.0f} | {s['max']:.0f} |")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.failover.gateway", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=pathlib.Path, help="checkpoint dir (default: the tiny preset)")
    parser.add_argument("--iterations", type=int, default=10, help="gateway kills (default 10)")
    parser.add_argument("--streams", type=int, default=2, help="streams open on the killed gateway (default 2)")
    parser.add_argument("--gateway-lease-ttl-s", type=int, default=0,
                        help="--lease-ttl-s of the gateways (default: theirs, 2 s)")
    parser.add_argument("--no-gateway-probe", action="store_true",
                        help="schedulers with --gateway-probe-interval-s 0: detection by the lease TTL alone")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS_DIR, help="where gateway_failover.{json,md} go")
    parser.add_argument("--work-dir", default="", help="keep the mesh's logs here (default: a temporary dir)")
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.streams < 1:
        parser.error("--iterations and --streams must be >= 1")
    return args


async def run_bench(mesh, args) -> Bench:
    cluster = ClusterClient(mesh.etcd_endpoint)
    await cluster.connect()
    try:
        bench = Bench(mesh, cluster, args)
        await bench.run()
        return bench
    finally:
        await cluster.close()


def main(argv: list[str] | None = None) -> int:
    from moemesh.launcher import Mesh, MeshSpec

    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    model = tiny_model(args.model)
    extra = {"gateway": ["--lease-ttl-s", str(args.gateway_lease_ttl_s)]} if args.gateway_lease_ttl_s else {}
    if args.no_gateway_probe:
        extra["scheduler_svc"] = ["--gateway-probe-interval-s", "0"]
    load_at_start = os.getloadavg()
    spec = MeshSpec(model_dir=str(model), num_ranks=1, device="cpu", work_dir=args.work_dir, num_gateways=2,
                    extra_args=extra)
    with Mesh(spec) as mesh:
        bench = asyncio.run(run_bench(mesh, args))
    report = summarize(bench, args, argv, load_at_start)
    table = markdown(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gateway_failover.json").write_text(json.dumps(report, indent=2) + "\n")
    load = report["machine"]["load_avg_at_start"][0], report["machine"]["load_avg_at_end"][0]
    detection = ("the lease TTL alone (--no-gateway-probe)" if args.no_gateway_probe
                 else "the scheduler leader probes the gateways every 100 ms")
    (args.out / "gateway_failover.md").write_text(
        f"# Gateway failover\n\n`{report['command']}` on {report['date']}: {os.cpu_count()} CPUs shared with "
        f"other work (1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end), the tiny "
        f"model on the CPU, one expert service, two gateways; {report['n']} kill -9 of the serving gateway "
        f"with {args.streams} streams open on it. Detection: {detection}. Times from the signal "
        f"(nearest-rank percentiles).\n\n"
        f"{table}\n\nEvery open stream ended with UNAVAILABLE: "
        f"{'yes' if report['all_streams_unavailable'] else 'no'}.\n")
    print(table)
    print(f"\nwrote {args.out / 'gateway_failover.json'} and {args.out / 'gateway_failover.md'}")
    return 0 if report["all_streams_unavailable"] else 1


if __name__ == "__main__":
    sys.exit(main())
