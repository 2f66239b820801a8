"""Host time per step at high concurrency, on the CPU: where the gap between GPU steps goes (issue 8).

    .venv/bin/python -m bench.serving.step_overhead --cases 1x256,2x256,2x512 --label after --out bench/results
    .venv/bin/python -m bench.serving.step_overhead --cases 2x512 --profile

The real gateway (Engine, Batcher, EngineObserver, GenerationServicer over
gRPC, the Qwen3 tokenizer's incremental detokenizer) drives real ranks
(ExpertServicer, pipelined StepExecutor, StepRunner with a DecodeGraphRunner
whose capture is a stand-in), one process per rank, whose model is fake and
whose "device" is a timeline: a step takes --step-ms after the one before it
ends (plus --prefill-ms-per-1k per thousand prompt tokens), and reading its
tokens sleeps until then, releasing the GIL as a CUDA event wait does. A
client process streams the requests of each case RANKSxCONCURRENCY
(bench/serving/serve.py's client, the 1K-in/1K-out shape scaled by --prompt-tokens
and --output-tokens).

Reported as means over the steady decode steps (every sequence decoding),
step k's figures in ms:
- wall_ms_per_step: between the last rank's results of steps k-1 and k;
  execute_ms_per_step: the ranks' execute_seconds (launch, or the previous
  read if launched ahead, to tokens read), busy their ratio, as
  bench/serving/gpu_speed.py reads it from /metrics: 1 - busy is what the host loses;
- turnaround_ms: from the last rank's results of step k read to the plan of
  step k+2 going out (the first line of its write): the gateway's part of
  the critical path. Its parts: apply_ms (results to outputs: detokenize,
  stop strings; before issue 8's change also the outputs' delivery),
  plan_wait_ms, plan_ms (schedule + protobuf), send_ms (from the plan built
  to its write starting: before the change, every stream woken by the
  outputs ran first);
- gateway_cpu_ms_per_step: the gateway process's CPU time per step (its
  step loop plus every response stream); with --profile, the gateway's top
  functions by own and by cumulative time (cProfile, which slows it down).
- wall_ms_p99 / wall_ms_max: the slowest steps of that window; gc_freeze:
  whether the gateway and the ranks froze their heap once set up, as the
  services do (services/gc_pauses.py; --gc-freeze false to compare);
  gateway_gc_ms: the gateway's garbage-collector pauses over the case, in
  all; gateway_gc_max_ms / rank_gc_max_ms: the longest pause of the gateway
  and of any rank.
Results: bench/results/step_overhead.md and .json (--out).
"""

import argparse
import asyncio
import concurrent.futures
import cProfile
import dataclasses
import gc
import io
import json
import pathlib
import pstats
import subprocess
import sys
import time
import types

import torch

from services import gc_pauses

RESULTS_DIR = pathlib.Path(__file__).resolve().parents[1] / "results"
BLOCK_SIZE = 16
VOCAB_SIZE = 64  # the fake model's tokens: ids of ASCII characters in the Qwen vocabulary (cheap logits)


# The rank: a fake model on a fake device timeline.


class FakeDevice:
    """A device timeline: each step starts when the last one ends, or at its launch."""

    def __init__(self, step_s: float, prefill_s_per_token: float):
        self.step_s, self.prefill_s_per_token = step_s, prefill_s_per_token
        self.busy_until = 0.0

    def enqueue(self, num_prefill_tokens: int) -> "FakeEvent":
        start = max(time.perf_counter(), self.busy_until)
        self.busy_until = start + self.step_s + num_prefill_tokens * self.prefill_s_per_token
        return FakeEvent(self.busy_until)


@dataclasses.dataclass(frozen=True)
class FakeEvent:
    """torch.cuda.Event's synchronize: waits (GIL released) until the step is done."""

    done_at: float

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.done_at - time.perf_counter()))


class FakeModel:
    """What StepRunner and DecodeGraphRunner call; logits pick a token from the position."""

    def __init__(self, max_context: int):
        self.config = types.SimpleNamespace(num_experts_per_tok=8, vocab_size=VOCAB_SIZE,
                                            max_position_embeddings=max_context)
        self.num_local_slots = 128
        self.device = "cpu"
        self.hit_counts_LE = torch.zeros(1, 1, dtype=torch.int64)
        self.comm = types.SimpleNamespace(max_over_ranks=lambda n, device: n)

    @staticmethod
    def dispatch_capacity(max_tokens_per_rank: int) -> int:
        return 1 << max(0, 8 * max_tokens_per_rank - 1).bit_length()

    def forward_at_capacity(self, batch, kv_pool, capacity, *, logits_SV=None, last_row_hits_LE=None):
        rows_S = batch.sample_indices_S
        token_ids_S = (batch.positions_T.index_select(0, rows_S) * 7 + 3) % VOCAB_SIZE
        if logits_SV is None:
            logits_SV = torch.zeros(rows_S.shape[0], VOCAB_SIZE)
        else:
            logits_SV.zero_()
        logits_SV.scatter_(1, token_ids_S[:, None], 1.0)
        if last_row_hits_LE is not None:
            last_row_hits_LE.zero_()
        return logits_SV


def make_fake_runner(device: FakeDevice, num_blocks: int, max_context: int, buckets: tuple[int, ...]):
    from expert_svc.graph_runner import DecodeGraphRunner
    from expert_svc.runner import StepRunner

    class FakeDeviceRunner(StepRunner):
        """The real StepRunner whose steps end on the fake device's timeline."""

        def launch(self, plan):
            step = super().launch(plan)
            num_prefill = sum(len(s.token_ids) for s in plan.scheduled)
            return dataclasses.replace(step, ready=device.enqueue(num_prefill))

    model = FakeModel(max_context)
    # No KV is stored (the fake logits depend on the position only): a block copy has nothing to move.
    kv_pool = types.SimpleNamespace(block_size=BLOCK_SIZE, num_blocks=num_blocks, copy_blocks=lambda copies: None)
    graphs = DecodeGraphRunner(model, kv_pool, BLOCK_SIZE, buckets=buckets,
                               max_blocks=-(-max_context // BLOCK_SIZE), capture=lambda fn: fn)
    return FakeDeviceRunner(model, kv_pool, BLOCK_SIZE, vocab_size=151_936, group_id="g", placement_epoch=1,
                            graphs=graphs)


async def serve_rank(args) -> None:
    """One rank process: prints its port, serves until stdin closes."""
    from expert_svc.executor import StepExecutor
    from expert_svc.servicer import ExpertServicer
    from expert_svc.state import RankState
    from moe.expert.v1 import expert_pb2_grpc
    from services import grpc_util

    torch.set_num_threads(1)
    runner = make_fake_runner(FakeDevice(args.step_ms / 1e3, args.prefill_ms_per_1k / 1e6),
                              args.num_blocks, args.max_context, (1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
    model_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model")
    reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="reader")
    state = RankState(member_id=f"rank-{args.rank}", model_name="fake", group_id="g", rank=args.rank,
                      world_size=args.ranks, placement_epoch=1, num_kv_blocks=args.num_blocks,
                      kv_block_size=BLOCK_SIZE)
    state.executor = StepExecutor(runner, model_thread, reader=reader)
    server = await grpc_util.start_server(
        [lambda s: expert_pb2_grpc.add_ExpertServiceServicer_to_server(ExpertServicer(state), s)], [])
    gc_pauses.freeze("the rank's set-up", enabled=args.gc_freeze == "true")  # as expert_svc/server.py once ready
    print(server.port, flush=True)
    with gc_pauses.recording() as pauses:
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(0)
    print(json.dumps(pause_summary(pauses)), flush=True)


def pause_summary(pauses: list[tuple[int, float]]) -> dict:
    """Garbage-collector pauses: count, total and longest ms, and the full collections."""
    seconds = [s for _, s in pauses]
    return {"num": len(seconds), "total_ms": round(1e3 * sum(seconds), 1),
            "max_ms": round(1e3 * max(seconds, default=0.0), 2),
            "full": [round(1e3 * s, 1) for g, s in pauses if g == 2]}


# The client.


async def run_client(args) -> None:
    """The client process: streams the workload, prints bench/serving/serve.py's summary as JSON."""
    from bench.serving.serve import run_load, summarize
    from bench.serving.workloads import make_workload

    specs = make_workload("1k1k", args.concurrency, scale=args.prompt_tokens / 1024,
                          output_scale=args.output_tokens / 1024, seed=1)
    load = argparse.Namespace(rate=0, concurrency=args.concurrency, request_timeout_s=600.0, seed=1)
    results, wall_s = await run_load(args.target, specs, load, "c")
    print(json.dumps(summarize(results, wall_s)), flush=True)


# The gateway, with the spans of its critical path.


class StepClock:
    """Timestamps of one gateway's steps (perf_counter), kept by TimedEngine."""

    def __init__(self):
        self.steps: dict[int, dict] = {}

    def mark(self, step_id: int, name: str, value: float | None = None) -> None:
        self.steps.setdefault(step_id, {})[name] = time.perf_counter() if value is None else value


def timed_engine_class():
    from gateway.engine import Engine

    class TimedEngine(Engine):
        """The Engine with a timestamp at each edge of a step's host work."""

        clock: StepClock

        def _plan(self):
            start = time.perf_counter()
            planned = super()._plan()  # None when empty, before the reordering of issue 8
            if planned is not None and not planned[0].is_empty:
                self.clock.mark(planned[0].step_id, "plan_start", start)
                self.clock.mark(planned[0].step_id, "plan_end")
            return planned

        async def _receive(self, planned):
            batch = planned[0]
            self.clock.mark(batch.step_id, "receive_start")
            events = await super()._receive(planned)
            self.clock.mark(batch.step_id, "applied")
            self.clock.mark(batch.step_id, "cpu", time.process_time())
            self.clock.mark(batch.step_id, "tokens", sum(len(p.scheduled) for p in batch.plans))
            self.clock.mark(batch.step_id, "decode", all(
                not s.token_ids for p in batch.plans for s in p.scheduled))
            return events

    return TimedEngine


class TimedStream:
    """A rank's step stream noting when each result arrived and its execute_seconds."""

    def __init__(self, call, rank: int, clock: StepClock):
        self._call, self._rank, self._clock = call, rank, clock

    async def write(self, request) -> None:
        self._clock.mark(request.plan.step_id, f"write_{self._rank}")
        await self._call.write(request)

    async def read(self):
        response = await self._call.read()
        result = getattr(response, "result", None)
        if result is not None:
            self._clock.mark(result.step_id, f"read_{self._rank}")
            self._clock.mark(result.step_id, f"exec_{self._rank}", result.execute_seconds)
        return response

    def cancel(self) -> None:
        self._call.cancel()


async def run_case(args, num_ranks: int, concurrency: int) -> dict:
    """One gateway over num_ranks rank processes and one client process; the step timings."""
    from gateway.batcher import Batcher
    from gateway.kv_accounting import RankKV
    from gateway.model_info import ModelInfo
    from gateway.observability import EngineObserver
    from gateway.servicer import SERVICE_NAME, GenerationServicer
    from gateway.validation import RequestLimits
    from moe.expert.v1 import expert_pb2_grpc
    from moe.gateway.v1 import gateway_pb2_grpc
    from services import grpc_util
    from services.text import IncrementalDetokenizer
    from services.tokenizer import Tokenizer

    per_rank = -(-concurrency // num_ranks)
    max_context = args.prompt_tokens + args.output_tokens + BLOCK_SIZE
    num_blocks = per_rank * -(-max_context // BLOCK_SIZE) + 64
    common = ["--ranks", str(num_ranks), "--num-blocks", str(num_blocks), "--max-context", str(max_context),
              "--step-ms", str(args.step_ms), "--prefill-ms-per-1k", str(args.prefill_ms_per_1k),
              "--gc-freeze", args.gc_freeze]
    ranks = [subprocess.Popen([sys.executable, "-m", "bench.serving.step_overhead", "--role", "rank", "--rank", str(r),
                               *common], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for r in range(num_ranks)]
    ports = [int(p.stdout.readline()) for p in ranks]
    tokenizer = Tokenizer.qwen3()
    clock = StepClock()
    channels = [grpc_util.channel(f"127.0.0.1:{port}") for port in ports]
    streams = [TimedStream(expert_pb2_grpc.ExpertServiceStub(c).ExecuteSteps(), r, clock)
               for r, c in enumerate(channels)]
    batcher = Batcher([RankKV(num_blocks, BLOCK_SIZE) for _ in ports], max_running_requests=per_rank,
                      max_batch_tokens=max(4096, per_rank), max_context=max_context,
                      eos_token_ids=tokenizer.eos_token_ids)
    engine = timed_engine_class()(batcher, streams, make_detokenizer=lambda: IncrementalDetokenizer(tokenizer),
                                  group_id="g", placement_epoch=1, observer=EngineObserver(num_ranks),
                                  stream_interval=args.stream_interval)
    engine.clock = clock
    limits = RequestLimits(vocab_size=151_936, max_context=max_context, max_new_tokens_default=16,
                           max_new_tokens_limit=max_context)
    info = ModelInfo(model_name="step-overhead", architecture="Qwen3MoeForCausalLM", context_length=max_context,
                     vocab_size=limits.vocab_size, dtype="bfloat16", num_experts=128, num_experts_per_tok=8)
    servicer = GenerationServicer(tokenizer=tokenizer, limits=limits, model_info=info, get_engine=lambda: engine)
    server = await grpc_util.start_server(
        [lambda s: gateway_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, s)], [SERVICE_NAME])
    loop_task = asyncio.create_task(engine.run())
    thresholds = gc.get_threshold()
    gc_pauses.freeze("the gateway's set-up", enabled=args.gc_freeze == "true",  # as gateway/main.py
                     young_threshold=args.gc_young_threshold)
    client = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.serving.step_overhead", "--role", "client", "--target", f"127.0.0.1:{server.port}",
        "--concurrency", str(concurrency), "--prompt-tokens", str(args.prompt_tokens),
        "--output-tokens", str(args.output_tokens), stdout=subprocess.PIPE)
    profile = cProfile.Profile() if args.profile else None
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    if profile is not None:
        profile.enable()
    with gc_pauses.recording() as pauses:
        out, _ = await client.communicate()
    if profile is not None:
        profile.disable()
    cpu_s, wall_s = time.process_time() - cpu_start, time.perf_counter() - wall_start
    loop_task.cancel()
    for stream in streams:
        stream.cancel()
    await server.stop(0)
    for channel in channels:
        await channel.close()
    rank_pauses = [json.loads(process.communicate("")[0].splitlines()[-1]) for process in ranks]
    gc.unfreeze()  # this process may go on (a test): its heap collectable again
    gc.set_threshold(*thresholds)
    gateway_pauses = pause_summary(pauses)
    report = {"ranks": num_ranks, "concurrency": concurrency, "client": json.loads(out),
              "gateway_cpu_share": round(cpu_s / wall_s, 3), **summarize_steps(clock, num_ranks, concurrency),
              "stream_interval": args.stream_interval, "gc_freeze": args.gc_freeze, "gc_young_threshold": args.gc_young_threshold,
              "gateway_gc_ms": gateway_pauses["total_ms"],
              "gateway_gc_max_ms": gateway_pauses["max_ms"],
              "rank_gc_max_ms": max(r["max_ms"] for r in rank_pauses),
              "gc_pauses": {"gateway": gateway_pauses, "ranks": rank_pauses}}
    if profile is not None:
        report["profile"] = profile_text(profile)
    return report


def summarize_steps(clock: StepClock, num_ranks: int, concurrency: int) -> dict:
    """Per-step means over the steady decode steps (every sequence decoding)."""
    steps = clock.steps
    reads = {k: max(v[f"read_{r}"] for r in range(num_ranks)) for k, v in steps.items()
             if all(f"read_{r}" in v for r in range(num_ranks))}
    window = [k for k, v in sorted(steps.items()) if v.get("decode") and v.get("tokens") == concurrency
              and k - 1 in reads and k in reads and k + 2 in steps and f"write_{num_ranks - 1}" in steps[k + 2]]
    window = window[2:-2]  # away from the edges of the decode phase
    if not window:
        return {"num_steps": 0}
    mean = lambda values: round(1e3 * sum(values) / len(values), 3)  # noqa: E731 (ms)
    wall = [reads[k] - reads[k - 1] for k in window]
    wall_sorted = sorted(wall)
    cpu = [steps[k]["cpu"] - steps[k - 1]["cpu"] for k in window]
    sent = {k: max(steps[k + 2][f"write_{r}"] for r in range(num_ranks)) for k in window}
    execute = [sum(steps[k][f"exec_{r}"] for r in range(num_ranks)) / num_ranks for k in window]
    parts = {
        "apply": [steps[k]["applied"] - reads[k] for k in window],
        "plan": [steps[k + 2]["plan_end"] - steps[k + 2]["plan_start"] for k in window],
        "plan_wait": [steps[k + 2]["plan_start"] - steps[k]["applied"] for k in window],
        "send": [sent[k] - steps[k + 2]["plan_end"] for k in window],
        "turnaround": [sent[k] - reads[k] for k in window],
    }
    return {"num_steps": len(window), "wall_ms_per_step": mean(wall), "execute_ms_per_step": mean(execute),
            "busy": round(sum(execute) / sum(wall), 4),
            "wall_ms_p99": round(1e3 * wall_sorted[int(0.99 * (len(wall) - 1))], 3),
            "wall_ms_max": round(1e3 * wall_sorted[-1], 3),
            "gateway_cpu_ms_per_step": mean(cpu), **{f"{name}_ms": mean(v) for name, v in parts.items()}}


def profile_text(profile: cProfile.Profile, num_lines: int = 30) -> dict:
    out = {}
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(key).print_stats(num_lines)
        out[key] = text.getvalue()
    return out


COLUMNS = ("label", "ranks", "concurrency", "num_steps", "wall_ms_per_step", "wall_ms_p99", "wall_ms_max",
           "execute_ms_per_step", "busy", "turnaround_ms", "apply_ms", "plan_wait_ms", "plan_ms", "send_ms",
           "gateway_cpu_ms_per_step", "stream_interval", "gc_freeze", "gc_young_threshold", "gateway_gc_ms", "gateway_gc_max_ms", "rank_gc_max_ms",
           "out_tok_s")


def write_results(reports: list[dict], out_dir: pathlib.Path) -> None:
    """Merges the reports (by label, ranks, concurrency) into step_overhead.json and rewrites the .md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "step_overhead.json"
    old = json.loads(path.read_text()) if path.exists() else {"runs": []}
    keys = {(r["label"], r["ranks"], r["concurrency"]) for r in reports}
    runs = [r for r in old["runs"] if (r["label"], r["ranks"], r["concurrency"]) not in keys] + reports
    path.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    lines = ["# Gateway and rank host time per step at high concurrency (CPU, fake device)", "",
             "Written by bench/serving/step_overhead.py (see its docstring for what each column means).", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for run in sorted(runs, key=lambda r: (r["ranks"], r["concurrency"], r["label"])):
        lines.append("| " + " | ".join(str(run.get(c, "")) for c in COLUMNS) + " |")
    lines += ["", "Commands (the `before` runs from a checkout of the commit before issue 8's changes):", ""]
    lines += sorted({f"- `{r['command']}`" for r in runs}) + [""]
    md = out_dir / "step_overhead.md"
    notes = md.read_text().partition("\n## Notes")[2] if md.exists() else ""  # kept across runs
    md.write_text("\n".join(lines) + (f"\n## Notes{notes}" if notes else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=("gateway", "rank", "client"), default="gateway")
    parser.add_argument("--cases", default="1x256,2x256,2x512", help="RANKSxCONCURRENCY, comma-separated")
    parser.add_argument("--step-ms", type=float, default=20.0, help="the fake device's decode step")
    parser.add_argument("--prefill-ms-per-1k", type=float, default=10.0, help="added per 1K prompt tokens")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=192)
    parser.add_argument("--profile", action="store_true", help="cProfile the gateway (slows it down)")
    parser.add_argument("--gc-freeze", choices=("true", "false"), default="true",
                        help="freeze the heap of the gateway and the ranks once set up, as the services do")
    parser.add_argument("--gc-young-threshold", type=int, default=gc_pauses.DEFAULT_YOUNG_THRESHOLD,
                        help="the gateway's --gc-young-threshold (0: Python's 700)")
    parser.add_argument("--stream-interval", type=int, default=1, help="the gateway's --stream-interval")
    parser.add_argument("--label", default="", help="tag of the runs in the results (e.g. before, after)")
    parser.add_argument("--out", default="", help="directory of step_overhead.md/.json (nothing written if empty)")
    # Internal: the rank and client processes.
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--num-blocks", type=int, default=0)
    parser.add_argument("--max-context", type=int, default=0)
    parser.add_argument("--target", default="")
    parser.add_argument("--concurrency", type=int, default=0)
    args = parser.parse_args()
    if args.role == "rank":
        asyncio.run(serve_rank(args))
        return
    if args.role == "client":
        asyncio.run(run_client(args))
        return
    reports = []
    for case in args.cases.split(","):
        num_ranks, concurrency = (int(x) for x in case.split("x"))
        report = asyncio.run(run_case(args, num_ranks, concurrency))
        report.update(label=args.label, command=" ".join(["python -m bench.serving.step_overhead", *sys.argv[1:]]),
                      out_tok_s=report["client"]["output_tokens_per_s"])
        profile = report.pop("profile", None)
        print(json.dumps({k: v for k, v in report.items() if k != "client"}), flush=True)
        if profile is not None:
            print(profile["tottime"], profile["cumulative"], sep="\n")
        reports.append(report)
    if args.out:
        write_results(reports, pathlib.Path(args.out))


if __name__ == "__main__":
    main()
