"""Load and soak: a mesh driven past its capacity for minutes, with no request lost.

    python -m bench.serving.soak --model DIR --minutes 10
    python -m bench.serving.soak --model DIR --minutes 0.25 --rate 15 --burst-every-s 5 --burst-size 120   # CI

Starts its own mesh (moemesh.launcher.Mesh, 127.0.0.1 only) with a small
gateway queue, then sends greedy requests open loop: Poisson arrivals at
`--rate` per second, plus every `--burst-every-s` a burst of `--burst-size`
requests at once, well beyond what the gateway queues, so backpressure
(RESOURCE_EXHAUSTED) is exercised all the time. The load is bounded in time
(`--minutes`, then at most `--drain-s` for the last answers) and in count
(`--max-in-flight` client-side streams; arrivals beyond it are counted as
shed, not sent).

Every request ends in exactly one outcome: completed (a stream whose last
message has the finish reason, with exactly max_new_tokens tokens, equal to
the reference greedy tokens of its prompt taken on the idle mesh first), or
failed with a status code. A request still open after the drain is lost.
The run passes when nothing is lost or wrong, RESOURCE_EXHAUSTED is the only
error, every process is alive at the end, and no process's resident memory
(VmRSS from /proc) grew more than `--max-rss-growth` between the end of the
warm-up and the end of the run. RSS is sampled at the start, every
`--sample-every-s` and at the end. Results: a markdown table on stdout and
`soak.json` / `soak.md` under `--out` (default bench/results/).
"""

import argparse
import asyncio
import collections
import dataclasses
import logging
import os
import pathlib
import random
import shlex
import sys
import time

import grpc

from bench.serving.serve import RESULTS_DIR, write_result
from bench.serving.workloads import ID_HIGH, ID_LOW
from gateway.stats import percentile
from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc

EXPECTED_ERRORS = frozenset({"RESOURCE_EXHAUSTED"})
# The gateway's queue and batch in the soak: small, so that bursts overflow them.
GATEWAY_ARGS = ["--max-waiting-requests", "64", "--max-running-requests", "32"]


@dataclasses.dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt and its reference: the greedy tokens the idle mesh generates for it."""

    ids: tuple[int, ...]
    reference: tuple[int, ...] = ()


@dataclasses.dataclass(slots=True)
class Tally:
    """What the client saw; every sent request ends in exactly one outcome."""

    num_sent: int = 0
    num_shed: int = 0  # arrivals beyond --max-in-flight, never sent
    num_bursts: int = 0
    burst_rejected: list[int] = dataclasses.field(default_factory=list)  # RESOURCE_EXHAUSTED per burst
    outcomes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    e2e_s: list[float] = dataclasses.field(default_factory=list)
    ttft_s: list[float] = dataclasses.field(default_factory=list)
    num_tokens: int = 0


def rss_kib(pid: int) -> int | None:
    """Resident memory of a process from /proc/<pid>/status, None once it is gone."""
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def make_prompts(num: int, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    return [Prompt(tuple(rng.randrange(ID_LOW, ID_HIGH) for _ in range(rng.randint(4, 96))))
            for _ in range(num)]


async def generate(stub, request_id: str, prompt_ids, max_new_tokens: int, timeout_s: float):
    """(token ids, seconds to the first token, last message) of one greedy request."""
    request = gateway_pb2.GenerateRequest(
        request_id=request_id, input_ids=gateway_pb2.TokenIds(ids=prompt_ids),
        sampling=gateway_pb2.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True))
    start, ttft, token_ids, last = time.perf_counter(), None, [], None
    async for response in stub.Generate(request, timeout=timeout_s):
        if ttft is None and response.token_ids:
            ttft = time.perf_counter() - start
        token_ids += response.token_ids
        last = response
    return token_ids, ttft, last


async def send(stub, tally: Tally, request_id: str, prompt: Prompt, max_new_tokens: int, timeout_s: float,
               burst: int | None = None):
    """Sends one request and records its one outcome (and a rejection against its burst, if any)."""
    start = time.perf_counter()
    try:
        token_ids, ttft, last = await generate(stub, request_id, prompt.ids, max_new_tokens, timeout_s)
    except grpc.aio.AioRpcError as error:
        tally.outcomes[error.code().name] += 1
        if burst is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            tally.burst_rejected[burst] += 1
        return
    if last is None or last.finish_reason != gateway_pb2.FINISH_REASON_LENGTH \
            or last.usage.completion_tokens != len(token_ids):
        tally.outcomes["bad stream"] += 1
    elif tuple(token_ids) != prompt.reference[:max_new_tokens]:
        tally.outcomes["wrong tokens"] += 1
    else:
        tally.outcomes["completed"] += 1
        tally.e2e_s.append(time.perf_counter() - start)
        tally.ttft_s.append(ttft)
        tally.num_tokens += len(token_ids)


class Sampler:
    """RSS of every process of the mesh (and of this client) over the run."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids
        self.samples: list[dict] = []

    def take(self, label: str, t0: float, tally: Tally) -> dict:
        sample = {"t_s": round(time.monotonic() - t0, 1), "label": label, "sent": tally.num_sent,
                  "done": sum(tally.outcomes.values()),
                  "rss_kib": {name: rss_kib(pid) for name, pid in self.pids.items()}}
        self.samples.append(sample)
        return sample

    def growth(self, label: str = "warm") -> dict[str, dict]:
        """Per process: RSS at start, after the warm-up, at the end, the peak, and the growth since the warm-up."""
        first = self.samples[0]["rss_kib"]
        warm = next((s for s in self.samples if s["label"] == label), self.samples[0])["rss_kib"]
        end = self.samples[-1]["rss_kib"]
        table = {}
        for name in self.pids:
            seen = [s["rss_kib"][name] for s in self.samples if s["rss_kib"][name] is not None]
            growth = (end[name] - warm[name]) / warm[name] if end[name] and warm[name] else None
            table[name] = {"start_mib": mib(first[name]), "warm_mib": mib(warm[name]), "end_mib": mib(end[name]),
                           "peak_mib": mib(max(seen, default=None)),
                           "growth": None if growth is None else round(growth, 4)}
        return table


def mib(kib: int | None) -> float | None:
    return None if kib is None else round(kib / 1024, 1)


async def reference_tokens(stub, prompts: list[Prompt], num_tokens: int, timeout_s: float) -> list[Prompt]:
    """Each prompt's greedy tokens on the idle mesh, one request at a time."""
    out = []
    for i, prompt in enumerate(prompts):
        token_ids, _, _ = await generate(stub, f"reference-{i}", prompt.ids, num_tokens, timeout_s)
        out.append(Prompt(prompt.ids, tuple(token_ids)))
    return out


async def drive(stub, args, prompts: list[Prompt], tally: Tally, sampler: Sampler) -> dict:
    """Open-loop load for args.minutes, bursts included, then the drain; returns timings."""
    rng = random.Random(args.seed)
    tasks: set[asyncio.Task] = set()
    t0 = time.monotonic()
    end = t0 + 60 * args.minutes
    warm_at = t0 + args.warmup_fraction * (end - t0)
    next_sample, next_burst, is_warm = t0 + args.sample_every_s, t0 + args.burst_every_s, False
    sampler.take("start", t0, tally)

    def launch(kind: str, burst: int | None = None) -> None:
        if len(tasks) >= args.max_in_flight:
            tally.num_shed += 1
            return
        prompt = rng.choice(prompts)
        n = rng.randint(1, args.max_new_tokens)
        tally.num_sent += 1
        task = asyncio.create_task(send(stub, tally, f"{kind}-{tally.num_sent}", prompt, n, args.request_timeout_s,
                                        burst))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    while (now := time.monotonic()) < end:
        if now >= next_burst:
            tally.burst_rejected.append(0)
            for _ in range(args.burst_size):
                launch("burst", tally.num_bursts)
            tally.num_bursts += 1
            next_burst += args.burst_every_s
        if now >= next_sample or (not is_warm and now >= warm_at):
            sampler.take("periodic" if is_warm or now < warm_at else "warm", t0, tally)
            is_warm = is_warm or now >= warm_at
            while next_sample <= now:
                next_sample += args.sample_every_s
        launch("poisson")
        await asyncio.sleep(min(rng.expovariate(args.rate), max(0.0, end - time.monotonic())))
    load_s = time.monotonic() - t0
    pending = set(tasks)
    if pending:
        _, pending = await asyncio.wait(pending, timeout=args.drain_s)
    for task in pending:  # still open after the drain: lost
        task.cancel()
    if pending:
        tally.outcomes["lost"] += len(pending)
        await asyncio.wait(pending, timeout=10)
    sampler.take("end", t0, tally)
    return {"load_s": round(load_s, 1), "drain_s": round(time.monotonic() - t0 - load_s, 1)}


async def soak(target: str, args, sampler: Sampler) -> tuple[Tally, dict]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        prompts = await reference_tokens(stub, make_prompts(args.num_prompts, args.seed), args.max_new_tokens,
                                         args.request_timeout_s)
        tally = Tally()
        timings = await drive(stub, args, prompts, tally, sampler)
    return tally, timings


def verdict(tally: Tally, memory: dict, alive: dict, max_growth: float) -> list[str]:
    """Why the run fails; empty if it passes."""
    problems = []
    if sum(tally.outcomes.values()) != tally.num_sent:
        problems.append(f"{tally.num_sent} sent but {sum(tally.outcomes.values())} outcomes")
    for outcome, count in tally.outcomes.items():
        if outcome != "completed" and outcome not in EXPECTED_ERRORS:
            problems.append(f"{count} {outcome}")
    if not tally.outcomes["completed"]:
        problems.append("nothing completed")
    problems += [f"{name} died" for name, is_alive in alive.items() if not is_alive]
    problems += [f"{name} RSS grew {row['growth']:.0%} after the warm-up" for name, row in memory.items()
                 if row["growth"] is not None and row["growth"] > max_growth]
    return problems


def markdown(report: dict) -> str:
    t = report["client"]
    errors = ", ".join(f"{k} {v}" for k, v in sorted(t["outcomes"].items()) if k != "completed") or "none"
    lines = [
        "| minutes | rate/s | bursts | sent | completed | failed by code | lost | shed | req/s done "
        "| out tok/s | E2E p50/p99 ms | TTFT p50/p99 ms | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {report['config']['minutes']} | {report['config']['rate']} | {t['num_bursts']} x "
        f"{report['config']['burst_size']} | {t['num_sent']} | {t['outcomes'].get('completed', 0)} | {errors} "
        f"| {t['outcomes'].get('lost', 0)} | {t['num_shed']} | {t['completed_per_s']} | {t['output_tokens_per_s']} "
        f"| {t['e2e_ms_p50']} / {t['e2e_ms_p99']} | {t['ttft_ms_p50']} / {t['ttft_ms_p99']} "
        f"| {'PASS' if not report['problems'] else 'FAIL: ' + '; '.join(report['problems'])} |",
        "",
        "| process | RSS start MiB | after warm-up MiB | end MiB | peak MiB | growth after warm-up | alive |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in report["memory"].items():
        growth = "n/a" if row["growth"] is None else f"{row['growth']:+.1%}"
        lines.append(f"| {name} | {row['start_mib']} | {row['warm_mib']} | {row['end_mib']} | {row['peak_mib']} "
                     f"| {growth} | {report['alive'].get(name, True)} |")
    return "\n".join(lines)


def timeline(report: dict) -> str:
    """RSS (MiB) of every process at every sample, with the requests sent and answered by then."""
    names = list(report["memory"])
    lines = ["| t s | sample | sent | answered | " + " | ".join(names) + " |",
             "|" + "---|" * (4 + len(names))]
    for sample in report["samples"]:
        rss = " | ".join(str(mib(sample["rss_kib"][name])) for name in names)
        lines.append(f"| {sample['t_s']} | {sample['label']} | {sample['sent']} | {sample['done']} | {rss} |")
    return "\n".join(lines)


def client_summary(tally: Tally, timings: dict) -> dict:
    load_s = max(timings["load_s"], 1e-9)

    def ms(values: list[float], q: float) -> float:
        return round(1e3 * percentile(values, q), 1)

    return {
        "num_sent": tally.num_sent, "num_shed": tally.num_shed, "num_bursts": tally.num_bursts,
        "burst_rejected": tally.burst_rejected,
        "outcomes": dict(sorted(tally.outcomes.items())),
        "completed_per_s": round(tally.outcomes["completed"] / load_s, 2),
        "output_tokens_per_s": round(tally.num_tokens / load_s, 1),
        "e2e_ms_p50": ms(tally.e2e_s, 50), "e2e_ms_p99": ms(tally.e2e_s, 99),
        "ttft_ms_p50": ms(tally.ttft_s, 50), "ttft_ms_p99": ms(tally.ttft_s, 99),
        **timings,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.serving.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory (the tiny model on the CPU)")
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the load (default 10)")
    parser.add_argument("--rate", type=float, default=40.0,
                        help="Poisson arrivals per second (default 40: about the tiny model's capacity on 2 cores)")
    parser.add_argument("--burst-every-s", type=float, default=15.0, help="seconds between bursts (default 15)")
    parser.add_argument("--burst-size", type=int, default=300, help="requests per burst (default 300)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="each request asks for 1..this (default 16)")
    parser.add_argument("--num-prompts", type=int, default=32, help="distinct prompts (default 32)")
    parser.add_argument("--max-in-flight", type=int, default=2000, help="client-side bound on open streams")
    parser.add_argument("--request-timeout-s", type=float, default=300.0, help="gRPC deadline of each request")
    parser.add_argument("--drain-s", type=float, default=120.0, help="wait for the last answers (default 120)")
    parser.add_argument("--sample-every-s", type=float, default=30.0, help="RSS sampling period (default 30)")
    parser.add_argument("--warmup-fraction", type=float, default=0.1,
                        help="share of the run before the RSS baseline (default 0.1)")
    parser.add_argument("--max-rss-growth", type=float, default=0.2,
                        help="flag a process whose RSS grew more than this after the warm-up (default 0.2)")
    parser.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                        help=f"an extra gateway flag (after the soak's own: {' '.join(GATEWAY_ARGS)})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS_DIR, help="where soak.json and soak.md go")
    args = parser.parse_args(argv)
    for name in ("minutes", "rate", "burst_every_s", "max_new_tokens", "num_prompts", "max_in_flight",
                 "request_timeout_s", "sample_every_s"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.burst_size < 0 or args.drain_s < 0 or not 0 <= args.warmup_fraction < 1:
        parser.error("--burst-size and --drain-s must be >= 0 and --warmup-fraction in [0, 1)")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from moemesh.launcher import Mesh, MeshSpec

    load_start = os.getloadavg()
    mesh = Mesh(MeshSpec(model_dir=args.model, extra_args={"gateway": [*GATEWAY_ARGS, *args.gateway_arg]}))
    mesh.start()
    try:
        pids = {role.name: role.proc.pid for role in mesh.roles}
        if mesh.etcd is not None:
            pids["etcd"] = mesh.etcd.process.pid
        sampler = Sampler({**pids, "soak client": os.getpid()})
        tally, timings = asyncio.run(soak(mesh.gateway_address, args, sampler))
        alive = {role.name: role.proc.poll() is None for role in mesh.roles}
    finally:
        mesh.stop()
    memory = sampler.growth()
    report = {
        "command": shlex.join(["python", "-m", "bench.serving.soak", *argv]),
        "config": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()},
        "gateway_args": [*GATEWAY_ARGS, *args.gateway_arg],
        "machine": {"cpus": os.cpu_count(), "load_start": [round(x, 2) for x in load_start],
                    "load_end": [round(x, 2) for x in os.getloadavg()]},
        "client": client_summary(tally, timings),
        "memory": memory,
        "alive": alive,
        "samples": sampler.samples,
        "problems": verdict(tally, memory, alive, args.max_rss_growth),
    }
    table = markdown(report)
    machine = report["machine"]
    write_result(args.out, "soak", report,
        f"# Soak run\n\n`{report['command']}`\n\n{machine['cpus']} CPUs, load average {machine['load_start']} at "
        f"the start and {machine['load_end']} at the end (the machine is shared).\n\n{table}\n\n"
        f"RSS over the run (MiB):\n\n{timeline(report)}\n")
    print(table)
    print(f"\nwrote {args.out / 'soak.json'} and {args.out / 'soak.md'}")
    return 0 if not report["problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
