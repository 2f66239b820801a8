"""The serving benchmark: a gRPC load generator against a moemesh gateway.

    python -m bench.serving.serve --model DIR --ranks 2 --device cpu --workload mix --scale 0.01 \\
        --num-requests 32 --concurrency 8
    python -m bench.serving.serve --target 127.0.0.1:50051 --workload 1k1k --rate 2.5 --num-requests 200

It talks to the gateway like a real client (grpc.aio, one Generate stream per
request, input_ids prompts with ignore_eos so every length is exact), either
closed-loop (`--concurrency N` requests in flight at all times) or open-loop
(`--rate R`: Poisson arrivals at R requests per second, whatever the server
does). Workloads and their scaling are in bench/serving/workloads.py.

It reports requests/s, output tokens/s, time to first token (TTFT) p50/p99,
inter-token latency (ITL, between successive streamed tokens) p50/p99,
end-to-end latency p50/p99 and errors by status code, prints a markdown
table and writes JSON plus the table under bench/results/ (or --out).

The gateway's own counters (prefix-cache hit rate, preemptions, host time to
plan a step) are not in the public API: the gateway writes them to its
`--stats-file`. With `--model DIR` the benchmark starts its own mesh
(moemesh.launcher.Mesh) with that flag, reads the file after the warm-up
and again once the mesh has stopped, and reports the difference (the
per-step timing percentiles cover the gateway's last 20,000 steps, warm-up
included). With `--target`, pass `--gateway-stats FILE` to read a gateway's
file the same way (it lags by that gateway's --stats-interval-s), or the
gateway columns stay empty.
"""

import argparse
import asyncio
import collections
import dataclasses
import json
import logging
import pathlib
import random
import sys
import tempfile
import time

import grpc

from bench.serving.workloads import WORKLOADS, RequestSpec, ideal_hit_rate, longest_request, make_workload
from gateway.stats import percentile
from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc

RESULTS_DIR = pathlib.Path(__file__).resolve().parents[1] / "results"
# Gateway counters reported as the difference between the end and the start of the run.
_COUNTERS = ("num_requests", "num_prompt_tokens", "num_cached_prompt_tokens", "num_preemptions",
             "num_recomputed_tokens", "num_steps", "num_step_tokens", "num_rejected_queue_full")


@dataclasses.dataclass(slots=True)
class RequestResult:
    """What the client saw of one request (times in seconds, perf_counter)."""

    kind: str
    start_s: float
    end_s: float = 0.0
    first_token_s: float | None = None
    num_output_tokens: int = 0
    # Seconds between successive streamed tokens (a message of n tokens counts n gaps of 1/n).
    itl_s: list[float] = dataclasses.field(default_factory=list)
    # The gRPC status code name of a failed request.
    error: str | None = None


def generate_request(spec: RequestSpec, request_id: str) -> gateway_pb2.GenerateRequest:
    """The request for a spec: token ids in, exactly max_new_tokens out (ignore_eos), greedy
    unless the spec has a temperature (then seeded)."""
    request = gateway_pb2.GenerateRequest(
        request_id=request_id, input_ids=gateway_pb2.TokenIds(ids=spec.prompt_ids),
        sampling=gateway_pb2.SamplingParams(max_new_tokens=spec.max_new_tokens, temperature=spec.temperature,
                                            top_p=spec.top_p, ignore_eos=True))
    if spec.temperature:
        request.sampling.seed = spec.seed
    return request


async def send(stub, spec: RequestSpec, request_id: str, timeout_s: float) -> RequestResult:
    """Sends one request and times its stream."""
    request = generate_request(spec, request_id)
    result = RequestResult(spec.kind, time.perf_counter())
    last = result.start_s
    try:
        async for response in stub.Generate(request, timeout=timeout_s):
            now = time.perf_counter()
            num = len(response.token_ids)
            if not num:
                continue
            if result.first_token_s is None:
                result.first_token_s = now
                result.itl_s += [0.0] * (num - 1)  # arrived with the first token
            else:
                result.itl_s += [(now - last) / num] * num
            result.num_output_tokens += num
            last = now
    except grpc.aio.AioRpcError as error:
        result.error = error.code().name
    result.end_s = time.perf_counter()
    return result


async def run_closed(stub, specs: list[RequestSpec], concurrency: int, timeout_s: float,
                     tag: str) -> list[RequestResult]:
    """Keeps `concurrency` requests in flight until every spec was sent."""
    queue = collections.deque(enumerate(specs))
    results: list[RequestResult] = []

    async def worker() -> None:
        while queue:
            i, spec = queue.popleft()
            results.append(await send(stub, spec, f"{tag}-{i}", timeout_s))

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(specs)))))
    return results


async def run_open(stub, specs: list[RequestSpec], rate: float, seed: int, timeout_s: float,
                   tag: str) -> list[RequestResult]:
    """Sends the specs at Poisson arrivals of `rate` per second, not waiting for answers."""
    rng = random.Random(seed)
    tasks = []
    for i, spec in enumerate(specs):
        tasks.append(asyncio.create_task(send(stub, spec, f"{tag}-{i}", timeout_s)))
        if i + 1 < len(specs):
            await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


async def run_load(target: str, specs: list[RequestSpec], args, tag: str) -> tuple[list[RequestResult], float]:
    """Runs the specs closed- or open-loop against target; (results, wall seconds)."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        start = time.perf_counter()
        if args.rate:
            results = await run_open(stub, specs, args.rate, args.seed, args.request_timeout_s, tag)
        else:
            results = await run_closed(stub, specs, args.concurrency, args.request_timeout_s, tag)
        return results, time.perf_counter() - start


def summarize(results: list[RequestResult], duration_s: float) -> dict:
    """The client-side metrics of a run."""
    ok = [r for r in results if r.error is None]
    errors = collections.Counter(r.error for r in results if r.error is not None)
    ttft = [r.first_token_s - r.start_s for r in ok if r.first_token_s is not None]
    itl = [gap for r in ok for gap in r.itl_s]
    e2e = [r.end_s - r.start_s for r in ok]
    ms = 1e3
    return {
        "num_requests": len(results),
        "num_ok": len(ok),
        "errors": dict(sorted(errors.items())),
        "duration_s": round(duration_s, 3),
        "requests_per_s": round(len(ok) / duration_s, 3),
        "output_tokens_per_s": round(sum(r.num_output_tokens for r in ok) / duration_s, 2),
        "ttft_ms_p50": round(ms * percentile(ttft, 50), 2),
        "ttft_ms_p99": round(ms * percentile(ttft, 99), 2),
        "itl_ms_p50": round(ms * percentile(itl, 50), 2),
        "itl_ms_p99": round(ms * percentile(itl, 99), 2),
        "e2e_ms_p50": round(ms * percentile(e2e, 50), 2),
        "e2e_ms_p99": round(ms * percentile(e2e, 99), 2),
    }


def read_stats(path: str | pathlib.Path | None) -> dict | None:
    """The gateway's stats file, None if there is none (yet)."""
    if not path:
        return None
    try:
        return json.loads(pathlib.Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def gateway_metrics(before: dict | None, after: dict | None) -> dict | None:
    """The gateway's counters over the run (after - before) and its step timings."""
    if after is None:
        return None
    before = before or {}
    delta = {name: after.get(name, 0) - before.get(name, 0) for name in _COUNTERS}
    prompt = delta["num_prompt_tokens"]
    delta["prefix_hit_rate"] = round(delta["num_cached_prompt_tokens"] / prompt, 4) if prompt else 0.0
    for name in ("plan_ms_mean", "plan_ms_p50", "plan_ms_p99", "apply_ms_mean", "apply_ms_p99"):
        delta[name] = after.get(name, 0.0)
    return delta


COLUMNS = (
    ("workload", lambda r: r["config"]["workload"]),
    ("load", lambda r: (f"rate {r['config']['rate']}/s" if r["config"]["rate"]
                        else f"conc {r['config']['concurrency']}")),
    ("ok/sent", lambda r: f"{r['client']['num_ok']}/{r['client']['num_requests']}"),
    ("req/s", lambda r: r["client"]["requests_per_s"]),
    ("out tok/s", lambda r: r["client"]["output_tokens_per_s"]),
    ("TTFT p50/p99 ms", lambda r: f"{r['client']['ttft_ms_p50']} / {r['client']['ttft_ms_p99']}"),
    ("ITL p50/p99 ms", lambda r: f"{r['client']['itl_ms_p50']} / {r['client']['itl_ms_p99']}"),
    ("E2E p99 ms", lambda r: r["client"]["e2e_ms_p99"]),
    ("errors", lambda r: ", ".join(f"{k} {v}" for k, v in r["client"]["errors"].items()) or "none"),
    ("prefix hit", lambda r: f"{r['gateway']['prefix_hit_rate']:.1%}" if r["gateway"] else "n/a"),
    ("ideal hit", lambda r: f"{r['ideal_hit_rate']:.1%}" if "ideal_hit_rate" in r else "n/a"),
    ("preempt", lambda r: r["gateway"]["num_preemptions"] if r["gateway"] else "n/a"),
    ("plan ms/step mean/p99", lambda r: (f"{r['gateway']['plan_ms_mean']:.3f} / {r['gateway']['plan_ms_p99']:.3f}"
                                         if r["gateway"] else "n/a")),
)


def markdown_table(report: dict) -> str:
    """One header row and one result row."""
    header = "| " + " | ".join(name for name, _ in COLUMNS) + " |"
    rule = "|" + "|".join("---" for _ in COLUMNS) + "|"
    row = "| " + " | ".join(str(cell(report)) for _, cell in COLUMNS) + " |"
    return "\n".join([header, rule, row])


def role_metrics(mesh) -> dict[str, str]:
    """The /metrics addresses of a running Mesh's expert services and gateways, by role name."""
    return {r.name: f"127.0.0.1:{r.metrics_port}" for r in mesh.roles
            if r.metrics_port and r.name.startswith(("expert", "gateway"))}


def print_role_logs(mesh, lines: int = 30) -> None:
    """The last lines of every role's log on stderr: what a failed mesh run leaves to read."""
    from moemesh.launcher import tail

    for role in mesh.roles:
        print(f"--- {role.name} log\n{tail(role.log_path, lines)}", file=sys.stderr)


def write_result(out_dir: pathlib.Path, name: str, report: dict, text: str) -> None:
    """Writes a benchmark's current result: <name>.json (the report) and <name>.md (`text`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / f"{name}.md").write_text(text)


def write_report(report: dict, out_dir: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """Writes <name>.json and <name>.md; returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = report["config"]
    load = f"rate{config['rate']:g}" if config["rate"] else f"c{config['concurrency']}"
    name = f"serve-{config['workload']}-{load}-{time.strftime('%Y%m%d-%H%M%S')}"
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    setup = ", ".join(f"{k}={v}" for k, v in config.items() if v not in (None, "", []))
    md_path.write_text(f"# {name}\n\n{setup}\n\n{markdown_table(report)}\n")
    return json_path, md_path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.serving.serve", description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="address of a running gateway, host:port")
    where.add_argument("--model", help="checkpoint directory: start a mesh on it for the run")
    parser.add_argument("--ranks", type=int, default=1, help="with --model: expert services (default 1)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="with --model (default cpu)")
    parser.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                        help="with --model: an extra gateway flag, e.g. --gateway-arg=--policy=lpm (repeatable)")
    parser.add_argument("--expert-arg", action="append", default=[], metavar="ARG",
                        help="with --model: an extra expert-service flag, e.g. --expert-arg=--kv-blocks=512")
    parser.add_argument("--gateway-stats", help="with --target: the gateway's --stats-file to read")
    parser.add_argument("--workload", choices=WORKLOADS, default="mix")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8, help="closed loop: requests in flight (default 8)")
    parser.add_argument("--rate", type=float, default=0.0,
                        help="open loop: Poisson arrivals per second (replaces --concurrency)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the prompt lengths")
    parser.add_argument("--output-scale", type=float, default=1.0, help="multiplies the generated lengths")
    parser.add_argument("--warmup", type=int, default=2, help="requests sent before measuring (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout-s", type=float, default=600.0, help="gRPC deadline of each request")
    parser.add_argument("--stats-settle-s", type=float, default=0.5,
                        help="wait before reading the gateway's stats file, for it to catch up (default 0.5)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS_DIR, help="where results go")
    args = parser.parse_args(argv)
    for name in ("num_requests", "concurrency", "ranks"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.rate < 0 or args.warmup < 0 or args.request_timeout_s <= 0:
        parser.error("--rate and --warmup must be >= 0 and --request-timeout-s positive")
    return args


async def measure(target: str, args, stats_path) -> tuple[list[RequestResult], float, dict | None]:
    """Warm-up, then the measured run; (results, seconds, gateway stats at the start)."""
    specs = make_workload(args.workload, args.num_requests, scale=args.scale, output_scale=args.output_scale,
                          seed=args.seed)
    if args.warmup:
        # Another seed: a different system prompt, so the warm-up caches nothing the run reuses.
        warmup = make_workload(args.workload, args.warmup, scale=args.scale, output_scale=args.output_scale,
                               seed=args.seed + 1)
        await run_load(target, warmup, argparse.Namespace(**{**vars(args), "rate": 0.0}), "warmup")
    if stats_path:
        await asyncio.sleep(args.stats_settle_s)
    before = read_stats(stats_path)
    results, duration_s = await run_load(target, specs, args, "bench")
    return results, duration_s, before


def run_with_own_mesh(args) -> tuple[list[RequestResult], float, dict | None, dict | None]:
    """Starts a mesh on --model, measures, stops it: (results, seconds, gateway stats
    after the warm-up, gateway stats at exit)."""
    from moemesh.launcher import Mesh, MeshSpec
    from services.model.config import ModelConfig

    max_context = ModelConfig.from_model_dir(args.model).max_position_embeddings
    specs = make_workload(args.workload, args.num_requests, scale=args.scale, output_scale=args.output_scale,
                          seed=args.seed)
    if longest_request(specs) > max_context:
        raise SystemExit(f"a request needs {longest_request(specs)} tokens, more than the model's context "
                         f"{max_context}: lower --scale or --output-scale")
    with tempfile.TemporaryDirectory(prefix="moemesh-bench-") as tmp:
        stats_path = pathlib.Path(tmp) / "gateway-stats.json"
        extra = {"gateway": ["--stats-file", str(stats_path), "--stats-interval-s", "0.2", *args.gateway_arg],
                 "expert_svc": list(args.expert_arg)}
        mesh = Mesh(MeshSpec(model_dir=args.model, num_ranks=args.ranks, device=args.device, extra_args=extra))
        mesh.start()
        try:
            results, duration_s, before = asyncio.run(measure(mesh.gateway_address, args, stats_path))
        finally:
            mesh.stop()  # the gateway writes its final stats as it exits
        return results, duration_s, before, read_stats(stats_path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.model:
        results, duration_s, before, after = run_with_own_mesh(args)
    else:
        results, duration_s, before = asyncio.run(measure(args.target, args, args.gateway_stats))
        if args.gateway_stats:
            time.sleep(args.stats_settle_s)
        after = read_stats(args.gateway_stats)
    gateway = gateway_metrics(before, after)
    mesh_only = () if args.model else ("ranks", "device", "gateway_arg", "expert_arg")
    report = {
        "config": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()
                   if k not in mesh_only},
        "client": summarize(results, duration_s),
        "gateway": gateway,
        # What one cache shared by every rank would hit on the same requests: the placement's bound.
        "ideal_hit_rate": round(ideal_hit_rate(make_workload(args.workload, args.num_requests, scale=args.scale,
                                                             output_scale=args.output_scale, seed=args.seed)), 4),
    }
    json_path, md_path = write_report(report, args.out)
    print(markdown_table(report))
    print(f"\nwrote {json_path} and {md_path}")
    return 0 if report["client"]["num_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
