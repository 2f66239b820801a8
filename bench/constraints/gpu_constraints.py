"""Constrained decoding on the whole mesh: throughput, latency, compile time, jump-forward (issue 26).

    source bench/gpu_env.sh && python -m bench.constraints.gpu_constraints --kind h200
    python -m bench.constraints.gpu_constraints --device cpu --preset tiny --concurrency 4 \\
        --constrained-slots 1 --prompt-scale 0.01 --output-scale 0.02 --b1-requests 2 --out DIR   # smoke

Starts a mesh on random weights of a released shape (as bench/serving/gpu_speed.py does: the
expert services draw them, the gateway reads a directory with config.json and the Qwen3
tokenizer) and measures, with bench/constraints/load.py's loads:

- `c256`: --concurrency slots for --c256-window-s seconds, --constrained-slots of them (a quarter)
  asking for the ticket-classifier JSON of issue 26 one after the other, the others 1K-in/1K-out
  free decodes; then the same slots over the same window with every constrained answer replaced
  by its unconstrained twin (the same number of tokens, no mask). Output tokens received within
  the window, per second, of the two (target: constrained >= 90%).
- `b1`: --b1-requests constrained answers one at a time, then their twins: the mean decode time
  per token, (wall - TTFT) / (tokens - 1) (target: constrained <= 1.1x), beside the ITL p50/p99
  (a jump's tokens arrive together, so the median alone says little), wall time per answer and
  the gateway's steps per output token (a prefill step gives the first token; every other token
  costs a decode step unless jump-forward appends it).
- `compile`: the ticket schema compiled for the Qwen3 tokenizer (the gateway's Compiler): the
  tokenizer build, a cold compile (a schema the Compiler has not seen; --repeats distinct ones),
  a cached one, a new sequence's matcher.
- `jf`: `b1` again on a second mesh whose gateway runs with --jump-forward (the default is off),
  taking every jump (--jump-forward-min-tokens 1):
  the wall time of the answers and the steps per output token with and without it, and whether
  the texts are the same, reported, not judged: a jump's chunk runs as rows of a bigger decode
  graph (the rank's expanded steps; eagerly past its --cuda-graph-max-seq-tokens) than the
  one-token decodes, whose numerics differ, and with jump-forward off the rank does not restrict forced
  text to the tokenizer's tokens (tests/expert_svc/test_jump_forward_steps.py checks the
  same-numerics equality on the CPU).

A random model writes garbage: a constrained answer ends only because the schema is finite and
its JSON form bounded (services/constraints.py): each answer's finish reason and whether it
parses are reported. Results: --out/constraints_<kind>.md and .json (with the command).
"""

import argparse
import asyncio
import dataclasses
import json
import pathlib
import random
import statistics
import sys
import tempfile
import time

from bench.constraints import load
from bench.serving.gpu_speed import scrape_steps, step_attribution
from bench.serving.serve import RESULTS_DIR, print_role_logs, role_metrics, run_load, summarize, write_result
from bench.serving.workloads import ID_HIGH, ID_LOW, make_workload
from gateway.stats import percentile

CASES = ("c256", "b1", "compile", "jf")
CONSTRAINED_PROMPT_TOKENS = 128   # a ticket and its instruction, at --prompt-scale 1
FREE_SPECS_PER_SLOT = 4           # a free slot's requests in turn: more than a window finishes


def prompts(count: int, length: int, seed: int) -> list[tuple[int, ...]]:
    """Random prompts of ordinary Qwen3 token ids, seeded."""
    rng = random.Random(seed)
    return [tuple(rng.randrange(ID_LOW, ID_HIGH) for _ in range(max(1, length))) for _ in range(count)]


def jump_forward_supported() -> bool:
    """True if the gateway can turn jump-forward on (its jump_forward setting)."""
    from gateway.config import GatewayConfig

    return any(f.name == "jump_forward" for f in dataclasses.fields(GatewayConfig))


def decode_ms_per_token(answers: list) -> float | None:
    """The mean over answers of (wall - TTFT) / (tokens - 1): the time each decoded token cost."""
    per_answer = [(a.timing.end_s - a.timing.first_token_s) / (a.timing.num_output_tokens - 1) for a in answers
                  if a.is_done and a.timing.first_token_s is not None and a.timing.num_output_tokens > 1]
    return round(1e3 * statistics.mean(per_answer), 3) if per_answer else None


def run_row(free: list, constrained: list, duration_s: float, before: dict, after: dict) -> dict:
    """One run's figures: the client's (of the finished requests), the output tokens received in the
    run (a window's cut requests included), the constrained answers' checks, the steps."""
    done = [a for a in free + constrained if a.is_done]
    row = summarize([a.timing for a in done], duration_s)
    # Inter-token gaps of every stream, those a window's end cut included (a 1K answer may outlast it).
    itl = [gap for a in free + constrained for gap in a.timing.itl_s]
    row["itl_ms_p50"], row["itl_ms_p99"] = (round(1e3 * percentile(itl, q), 2) for q in (50, 99))
    out_tokens = sum(a.timing.num_output_tokens for a in free + constrained)
    row["window_output_tokens_per_s"] = round(out_tokens / duration_s, 2)
    row["num_cut"] = len(free) + len(constrained) - len(done)
    row["decode_ms_per_token"] = decode_ms_per_token(constrained)
    constrained = [a for a in constrained if a.is_done]
    row["steps"] = step_attribution(before, after, duration_s)
    gateway_steps = row["steps"].get("gateway", {}).get("steps", 0)
    row["gateway_steps_per_output_token"] = round(gateway_steps / out_tokens, 3) if out_tokens else None
    row["answers"] = load.check_answers(constrained) if constrained and constrained[0].timing.kind == "json" else None
    row["wall_ms_per_answer"] = (round(1e3 * statistics.mean(a.timing.end_s - a.timing.start_s for a in constrained), 2)
                                 if constrained else None)
    return row


async def drive(target: str, args, metrics: dict[str, str], cases: list[str], baselines: bool) -> dict:
    """Warm-up, then the mesh's cases; `baselines`: also the unconstrained twins' runs."""
    opts = argparse.Namespace(rate=0.0, seed=args.seed, request_timeout_s=args.request_timeout_s, concurrency=1)
    while opts.concurrency <= args.concurrency:  # every decode batch size once (CUDA-graph captures)
        warm = make_workload("1k1k", opts.concurrency, scale=16 / 1024, output_scale=4 / 1024, seed=args.seed + 1)
        await run_load(target, warm, opts, f"warmup{opts.concurrency}")
        opts.concurrency *= 2
    for concurrency in (1, 8):  # full-size prompts: prefill kernels compile before anything is measured
        opts.concurrency = concurrency
        warm = make_workload("1k1k", concurrency, scale=args.prompt_scale, output_scale=4 / 1024, seed=args.seed + 2)
        await run_load(target, warm, opts, f"warmup-prefill{concurrency}")
    # Constrained answers: the rank's Compiler (its tokenizer) is built on the first one.
    await load.serial(target, prompts(2, 16, args.seed + 3), args.max_new_tokens, args.request_timeout_s, "warmup")
    prompt_tokens = round(CONSTRAINED_PROMPT_TOKENS * args.prompt_scale)
    out = {}

    async def measured(name, coroutine):
        before = await asyncio.to_thread(scrape_steps, metrics)
        result = await coroutine
        after = await asyncio.to_thread(scrape_steps, metrics)
        free, constrained, seconds = result if len(result) == 3 else ([], *result)
        out[name] = row = run_row(free, constrained, seconds, before, after)
        print(f"{name}: {json.dumps({k: v for k, v in row.items() if k != 'steps'})}", flush=True)
        return constrained

    if "c256" in cases:
        free_slots = args.concurrency - args.constrained_slots

        def free_specs(seed: int) -> list[list]:
            specs = make_workload("1k1k", free_slots * FREE_SPECS_PER_SLOT, scale=args.prompt_scale,
                                  output_scale=args.output_scale, seed=seed)
            return [specs[i::free_slots] for i in range(free_slots)]

        answers = await measured("c256_constrained", load.mixed_load(
            target, free_specs(args.seed + 100), prompts(4096, prompt_tokens, args.seed + 101),
            args.constrained_slots, args.max_new_tokens, args.request_timeout_s, "c256", args.c256_window_s))
        if baselines:
            await measured("c256_unconstrained", load.mixed_load(
                target, free_specs(args.seed + 200), prompts(4096, prompt_tokens, args.seed + 201),
                args.constrained_slots, args.max_new_tokens, args.request_timeout_s, "c256-twin", args.c256_window_s,
                replay=[a.timing.num_output_tokens for a in answers if a.is_done] or [args.max_new_tokens]))
    if "b1" in cases:
        # The same prompts on every mesh (a fresh mesh has an empty prefix cache): the same answers.
        answers = await measured("b1_constrained", load.serial(
            target, prompts(args.b1_requests, prompt_tokens, args.seed + 300), args.max_new_tokens,
            args.request_timeout_s, "b1"))
        out["b1_constrained"]["texts"] = [a.text for a in answers]
        if baselines:
            await measured("b1_unconstrained", load.serial(
                target, prompts(args.b1_requests, prompt_tokens, args.seed + 400), args.max_new_tokens,
                args.request_timeout_s, "b1-twin", replay=[a.timing.num_output_tokens for a in answers]))
    return out


def run_mesh(args, cases: list[str], model_dir: pathlib.Path, gateway_args: list[str], baselines: bool) -> dict:
    """Starts a mesh on random weights, runs the cases, stops it."""
    from moemesh.launcher import Mesh, MeshSpec

    extra = {"expert_svc": ["--random-weights", args.preset, *args.expert_arg],
             "gateway": ["--max-running-requests", str(args.concurrency),
                         "--max-batch-tokens", str(max(args.max_batch_tokens, args.concurrency)),
                         *args.gateway_arg, *gateway_args]}
    mesh, start = Mesh(MeshSpec(model_dir=str(model_dir), num_ranks=1, device=args.device, extra_args=extra,
                                ready_timeout_s=args.ready_timeout_s)), time.perf_counter()
    try:
        mesh.start()
        startup_s = round(time.perf_counter() - start, 1)
        metrics = role_metrics(mesh)
        return {"startup_s": startup_s, "gateway_args": gateway_args,
                "cases": asyncio.run(drive(mesh.gateway_address, args, metrics, cases, baselines))}
    except BaseException:
        print_role_logs(mesh)
        raise
    finally:
        mesh.stop()


def compile_times(model_dir: pathlib.Path, repeats: int) -> dict:
    """The gateway's Compiler on the model's tokenizer: build, cold and cached compiles of the ticket schema."""
    from gateway.server import constraint_compiler
    from services.model.config import ModelConfig
    from services.step import Constraint
    from services.tokenizer import Tokenizer

    start = time.perf_counter()
    compiler = constraint_compiler(ModelConfig.from_model_dir(model_dir), Tokenizer.from_model_dir(model_dir))
    build_s = time.perf_counter() - start
    cold, cached, matcher = [], [], []
    for i in range(repeats):
        # A title changes the content, not the grammar: each is a cold compile.
        constraint = Constraint("json_schema", json.dumps({**load.TICKET_SCHEMA, "title": f"ticket {i}"}))
        for times in (cold, cached):
            start = time.perf_counter()
            compiler.compile(constraint)
            times.append(time.perf_counter() - start)
        start = time.perf_counter()
        compiler.matcher(constraint)
        matcher.append(time.perf_counter() - start)
    return {"tokenizer_build_s": round(build_s, 3), "cold_ms_median": round(1e3 * statistics.median(cold), 3),
            "cold_ms_max": round(1e3 * max(cold), 3), "cached_us_median": round(1e6 * statistics.median(cached), 2),
            "new_matcher_us_median": round(1e6 * statistics.median(matcher), 2), "repeats": repeats}


def add_targets(report: dict) -> None:
    """The issue's targets from the runs that measure them; jump-forward's figures, reported."""
    on = report.get("mesh", {}).get("cases", {})
    jf = report.get("mesh_jump_forward", {}).get("cases", {})
    targets, jump_forward = {}, {}
    if "c256_constrained" in on and "c256_unconstrained" in on:
        ratio = (on["c256_constrained"]["window_output_tokens_per_s"]
                 / max(on["c256_unconstrained"]["window_output_tokens_per_s"], 1e-9))
        report["c256_ratio"] = round(ratio, 3)
        targets["c256, a quarter constrained: output tok/s in the same window >= 90% of unconstrained"] = ratio >= 0.9
    if on.get("b1_constrained", {}).get("decode_ms_per_token") and on.get("b1_unconstrained", {}).get(
            "decode_ms_per_token"):
        ratio = on["b1_constrained"]["decode_ms_per_token"] / on["b1_unconstrained"]["decode_ms_per_token"]
        report["b1_decode_ratio"] = round(ratio, 3)
        targets["b1 with a JSON schema: mean decode ms per token <= 1.1x unconstrained"] = ratio <= 1.1
    if "b1_constrained" in on and "b1_constrained" in jf:
        off_b1, on_b1 = on["b1_constrained"], jf["b1_constrained"]
        report["jf_same_answers"] = on_b1["texts"] == off_b1["texts"]
        jump_forward = {"same answers as without (greedy)": report["jf_same_answers"],
                        "wall ms per answer, with / without": (on_b1["wall_ms_per_answer"],
                                                               off_b1["wall_ms_per_answer"]),
                        "gateway steps per output token, with / without": (
                            on_b1["gateway_steps_per_output_token"], off_b1["gateway_steps_per_output_token"])}
    report["targets"], report["jump_forward"] = targets, jump_forward


def markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [f"# Constrained decoding: {cfg['preset']} random weights, {cfg['kind']}", "",
             f"Command: `{report['command']}`", "", f"Date: {report['date']}", ""]
    if "compile" in report:
        c = report["compile"]
        lines += [f"Ticket schema on the Qwen3 tokenizer: tokenizer build {c['tokenizer_build_s']} s, cold compile "
                  f"{c['cold_ms_median']} ms (median of {c['repeats']}, max {c['cold_ms_max']}), cached "
                  f"{c['cached_us_median']} us, new matcher {c['new_matcher_us_median']} us", ""]
    header = ("| mesh | run | ok/sent (cut) | out tok/s in window | decode ms/token | ITL p50/p99 ms | wall ms/answer "
              "| answers: stop, valid, tokens mean/max | finish reasons | gateway steps/out token |")
    lines += [header, "|" + "---|" * 10]
    for mesh_key, label in (("mesh", "default (jump-forward off)"), ("mesh_jump_forward", "jump-forward on, min 1")):
        mesh = report.get(mesh_key, {})
        if mesh.get("error"):
            lines.append(f"| {label} | failed: `{mesh['error'][:300]}` |" + " |" * 8)
        for name, r in mesh.get("cases", {}).items():
            a = r.get("answers") or {}
            answers = f"{a['stopped']}, {a['valid_json']}, {a['tokens_mean']}/{a['tokens_max']}" if a else ""
            lines.append(f"| {label} | {name} | {r['num_ok']}/{r['num_requests']} ({r['num_cut']}) | "
                         f"{r['window_output_tokens_per_s']} | {r['decode_ms_per_token'] or ''} | "
                         f"{r['itl_ms_p50']} / {r['itl_ms_p99']} | {r.get('wall_ms_per_answer') or ''} | {answers} | "
                         f"{json.dumps(a.get('finish_reasons', {}))} | {r['gateway_steps_per_output_token']} |")
    lines += ["", "Targets:", ""] + [f"- {n}: {'met' if ok else 'NOT met'}" for n, ok in report["targets"].items()]
    if report.get("jump_forward"):
        # Reported, not judged: a chunk's rows and one-token decodes batch differently (numerics).
        lines += ["", "Jump-forward (b1, reported):", ""] + [f"- {n}: {v}" for n, v in report["jump_forward"].items()]
    if report.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.constraints.gpu_constraints",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", default="h200", help="machine name, for the result files")
    parser.add_argument("--preset", default="qwen3-30b-a3b", help="random-weights shape (tiny on the CPU)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    parser.add_argument("--concurrency", type=int, default=256, help="requests in flight in c256")
    parser.add_argument("--constrained-slots", type=int, default=64, help="of them, constrained ones")
    parser.add_argument("--prompt-scale", type=float, default=1.0,
                        help=f"multiplies the 1K free prompts and the {CONSTRAINED_PROMPT_TOKENS}-token constrained ones")
    parser.add_argument("--output-scale", type=float, default=1.0, help="multiplies the free requests' 1K outputs")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="a constrained answer's limit")
    parser.add_argument("--b1-requests", type=int, default=8)
    parser.add_argument("--c256-window-s", type=float, default=40.0,
                        help="c256: seconds each of the two runs (constrained, twins) lasts")
    parser.add_argument("--repeats", type=int, default=5, help="cold compiles (distinct schemas)")
    parser.add_argument("--max-batch-tokens", type=int, default=8192, help="the gateway's --max-batch-tokens")
    parser.add_argument("--gateway-arg", action="append", default=[], metavar="ARG")
    parser.add_argument("--expert-arg", action="append", default=[], metavar="ARG")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    parser.add_argument("--ready-timeout-s", type=float, default=300.0)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    bad = [c for c in args.cases.split(",") if c not in CASES]
    if bad:
        parser.error(f"unknown case(s) {bad}")
    if not 0 < args.constrained_slots < args.concurrency:
        parser.error("--constrained-slots must be between 0 and --concurrency, exclusive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cases = args.cases.split(",")
    from services.model.random_weights import write_model_dir

    report = {"command": " ".join(["python -m bench.constraints.gpu_constraints",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "config": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()}}
    serving = [c for c in cases if c in ("c256", "b1")]
    with tempfile.TemporaryDirectory(prefix="gpu-constraints-") as tmp:
        model_dir = write_model_dir(pathlib.Path(tmp) / args.preset, args.preset)
        if "compile" in cases:
            report["compile"] = compile_times(model_dir, args.repeats)
            print(f"compile: {json.dumps(report['compile'])}", flush=True)
        runs = [("mesh", [], True)] if serving else []
        if "jf" in cases and jump_forward_supported():
            # Every jump taken (not the default's long runs only): what a chunk step costs.
            runs.append(("mesh_jump_forward", ["--jump-forward", "--jump-forward-min-tokens", "1"], False))
        elif "jf" in cases:
            report["notes"] = ["jf skipped: the gateway has no jump_forward setting"]
        for key, gateway_args, baselines in runs:
            try:
                report[key] = run_mesh(args, serving if key == "mesh" else ["b1"], model_dir, gateway_args, baselines)
            except Exception as error:  # the report says what failed; the other mesh still runs
                report[key] = {"error": repr(error)[-2000:]}
            _write(report, args)
    _write(report, args)
    print(markdown(report))
    return 0 if not any("error" in report.get(k, {}) for k, _, _ in runs) else 1


def _write(report: dict, args) -> None:
    add_targets(report)
    write_result(args.out, f"constraints_{args.kind}", report, markdown(report))


if __name__ == "__main__":
    sys.exit(main())
