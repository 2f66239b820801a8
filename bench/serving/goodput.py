"""Goodput on the production mix: an SLA curve over Poisson arrival rates (issue 30).

    source bench/gpu_env.sh && python -m bench.serving.goodput --kind nvidia-h200 --rates 2,4,6,8,10,12,16
    python -m bench.serving.goodput --device cpu --preset tiny --prompt-scale 0.01 --rates 1,2 --duration-s 5
    python -m bench.serving.goodput --plot bench/results/goodput_nvidia-h200.json   # the PNG, where matplotlib is

Starts a mesh on random weights (bench/serving/gpu_speed.py's run_mesh and warm-up), then for
each rate sends the production mix (60% 4K-in/32-out, 30% 2K/128, 10% 8K/16;
bench/serving/workloads.py) as Poisson arrivals for --duration-s seconds, open loop, and waits
for every answer. Per rate: completed requests/s, TTFT p50/p99, time per output token (TPOT,
a request's (end - first token) / (output tokens - 1)) p50/p99, E2E p99, the share of requests
that met the SLO (TTFT <= --slo-ttft-ms and TPOT <= --slo-tpot-ms; a failed request misses it),
the GPU's busy share (the rank's step time over the wall time, from its /metrics), the prompt
tokens/s achieved and that rate's FLOPs against the bf16 peak; where the time goes at the knee: the
mean queueing (the gateway's time from queued to first scheduled) and the mean ms of the steps with
prefill against those without (how much the prefill chunks slow the decodes riding with them), and
a least-squares fit of the logged prefill steps' times: a fixed part a step, a prompt token's part and a
token-context pair's (fit_prefill_steps). The gateway sheds requests it
predicts past the TTFT SLO (`--ttft-target-ms`, docs/configuration.md; off with --no-shed):
a refused request counts as a miss, as any failed one; and its steps follow the SLO step budget
(`--tpot-target-ms` at the TPOT SLO, no per-sequence chunk cap; --no-step-budget: the gateway's
default scheduler).

Requests that arrive in the first --settle-s seconds of a rate are sent but not counted, so the
figures describe the steady state rather than the empty start. The sweep stops after two rates
in a row whose attainment is below --stop-below (past the knee, the queue only grows).

**Goodput** is the highest rate whose attainment is at least --slo-attainment (99%). Results:
bench/results/<name>_<kind>.md and .json (--name, goodput by default); --plot draws <name>_<kind>.png
(TTFT p99 and TPOT p99 against the offered rate) from the JSON, on any machine with matplotlib.
"""

import argparse
import asyncio
import json
import pathlib
import sys
import tempfile
import time

from bench.serving.gpu_speed import ALLOCATOR, run_mesh, scrape_steps, step_attribution, warm_up
from bench.serving.serve import RESULTS_DIR, RequestResult, run_load, write_result
from bench.serving.workloads import make_workload
from gateway.stats import percentile

# bf16 dense tensor-core peak of one H200 (without sparsity), the compute bound of prefill.
BF16_PEAK_FLOPS = 989e12


def flops_per_prompt(config, num_tokens: int) -> float:
    """FLOPs of prefilling one prompt of num_tokens: two per active weight per token (the trunk, the
    gate, the top-k experts; the embedding lookup is no matmul) plus causal attention's two matmuls."""
    from services.model.checkpoint import expected_tensors

    shapes = expected_tensors(config, [])  # the trunk and gates, no expert
    dense = sum(_numel(s) for n, s in shapes.items() if n != "model.embed_tokens.weight" and len(s) == 2)
    experts = len(config.moe_layers) * config.num_experts_per_tok * 3 * config.moe_intermediate_size * config.hidden_size
    weights = 2 * (dense + experts) * num_tokens
    # QK^T and PV: 2 FLOPs per multiply-add, 2 matmuls, each token against the ones before it.
    attention = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * num_tokens * (num_tokens + 1) / 2
    return weights + attention


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def tpot_s(result: RequestResult) -> float:
    """Mean time per output token after the first (0 for a one-token answer)."""
    if result.first_token_s is None or result.num_output_tokens <= 1:
        return 0.0
    return (result.end_s - result.first_token_s) / (result.num_output_tokens - 1)


def meets_slo(result: RequestResult, ttft_s: float, tpot_limit_s: float) -> bool:
    return (result.error is None and result.first_token_s is not None
            and result.first_token_s - result.start_s <= ttft_s and tpot_s(result) <= tpot_limit_s)


def rate_row(rate: float, results: list[RequestResult], prompt_lens: list[int], duration_s: float,
             settle_s: float, args, flops: list[float]) -> dict:
    """The figures of one rate; requests that arrived in the first settle_s are left out."""
    start = min(r.start_s for r in results)
    kept = [(r, n, f) for r, n, f in zip(results, prompt_lens, flops) if r.start_s - start >= settle_s]
    counted = [r for r, _, _ in kept]
    ok = [r for r in counted if r.error is None]
    ttft = [r.first_token_s - r.start_s for r in ok if r.first_token_s is not None]
    tpot = [tpot_s(r) for r in ok if r.num_output_tokens > 1]
    e2e = [r.end_s - r.start_s for r in ok]
    met = sum(meets_slo(r, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3) for r in counted)
    # Throughput over the window the counted requests were served in.
    window = max(r.end_s for r in counted) - min(r.start_s for r in counted) if counted else 0.0
    done_prompt = sum(n for r, n, _ in kept if r.error is None)
    done_flops = sum(f for r, _, f in kept if r.error is None)
    ms = 1e3
    errors: dict[str, int] = {}
    for r in counted:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "rate": rate, "sent": len(results), "counted": len(counted), "ok": len(ok), "errors": errors,
        "completed_per_s": round(len(ok) / window, 3) if window else 0.0,
        "slo_attainment": round(met / len(counted), 4) if counted else 0.0,
        "ttft_ms_p50": round(ms * percentile(ttft, 50), 1), "ttft_ms_p99": round(ms * percentile(ttft, 99), 1),
        "tpot_ms_p50": round(ms * percentile(tpot, 50), 2), "tpot_ms_p99": round(ms * percentile(tpot, 99), 2),
        "e2e_ms_p99": round(ms * percentile(e2e, 99), 1),
        "prompt_tokens_per_s": round(done_prompt / window) if window else 0,
        "prefill_share_of_peak": round(done_flops / window / BF16_PEAK_FLOPS, 4) if window else 0.0,
        "wall_s": round(duration_s, 1),
    }


def schedule_row(before: dict, after: dict) -> dict:
    """Where the steps of one rate went, from the gateway's stats file before and after it: steps/s is
    left to the caller; the share of steps with prefill, their prefill tokens (mean, p50, p99), the
    ranks' mean ms of steps with and without prefill, and the step-cost model's fit at the end."""
    def delta(key):
        return after.get(key, 0) - before.get(key, 0)

    prefill_steps, decode_steps = delta("num_prefill_steps"), delta("num_decode_steps")
    steps = prefill_steps + decode_steps
    recent = after.get("recent_prefill_tokens", [])
    window = [n for n in recent[max(0, len(recent) - steps):] if n] if steps else []
    return {
        "steps": steps,
        "prefill_step_share": round(prefill_steps / steps, 3) if steps else None,
        "prefill_tokens_per_prefill_step": round(delta("num_step_prefill_tokens") / prefill_steps) if prefill_steps else None,
        "prefill_tokens_p50": percentile(window, 50) if window else None,
        "prefill_tokens_p99": percentile(window, 99) if window else None,
        "prefill_step_ms": round(delta("prefill_step_ms") / prefill_steps, 2) if prefill_steps else None,
        "decode_step_ms": round(delta("decode_step_ms") / decode_steps, 2) if decode_steps else None,
        "fit": {"scale": after.get("step_cost_scale"), "floor_ms": after.get("step_floor_ms"),
                "decode_scale": after.get("step_decode_scale")},
        "shed": delta("num_rejected_overload"),
        # This rate's steps with prefill, the latest the gateway keeps (gateway.stats.RECENT_STEPS):
        # [prefill tokens, decodes, their mean context, model ms, measured ms], what fit_prefill_steps fits
        "last_steps": after.get("recent_steps", [])[-prefill_steps:] if prefill_steps > 0 else [],
    }


def _read_stats(path) -> dict:
    """The gateway's stats file (rewritten every 0.5 s: waited for once), {} if there is none."""
    time.sleep(0.7)
    try:
        return json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError):
        return {}


def goodput(rows: list[dict], attainment: float) -> float:
    """The highest rate whose SLO attainment is at least `attainment` (0 if none)."""
    return max((row["rate"] for row in rows if row["slo_attainment"] >= attainment), default=0.0)


async def _sweep(target: str, args, cases: list[str], max_context: int, metrics: dict[str, str]) -> dict:
    from services.model.random_weights import preset

    config = preset(args.preset)
    await warm_up(target, args, 64)
    load = argparse.Namespace(rate=0.0, seed=args.seed, request_timeout_s=args.request_timeout_s, concurrency=1)
    rows, below = [], 0
    for index, rate in enumerate(args.rate_list):
        count = max(1, round(rate * args.duration_s))
        specs = make_workload("mix", count, scale=args.prompt_scale, seed=args.seed + 1000 * (index + 1))
        assert max(len(s.prompt_ids) + s.max_new_tokens for s in specs) <= max_context
        load.rate = rate
        before = await asyncio.to_thread(scrape_steps, metrics)
        stats_before = await asyncio.to_thread(_read_stats, args.stats_path) if args.stats_path else {}
        results, duration_s = await run_load(target, specs, load, f"rate{rate:g}")
        steps = step_attribution(before, await asyncio.to_thread(scrape_steps, metrics), duration_s)
        stats_after = await asyncio.to_thread(_read_stats, args.stats_path) if args.stats_path else {}
        lens = [len(s.prompt_ids) for s in specs]
        row = rate_row(rate, results, lens, duration_s, args.settle_s, args,
                       [flops_per_prompt(config, n) for n in lens])
        experts = [v for role, v in steps.items() if role.startswith("expert")]
        row["busy_share"] = min((v["busy_share"] for v in experts if v["busy_share"] is not None), default=None)
        # Queueing: the gateway's mean time from queued to first scheduled, of the requests scheduled in the rate.
        row["queue_ms"] = next((v["queue_ms"] for v in steps.values() if "queue_ms" in v), None)
        row["steps"] = steps
        if stats_after:
            row["schedule"] = schedule_row(stats_before, stats_after)
            row["schedule"]["steps_per_s"] = round(row["schedule"]["steps"] / duration_s, 1)
        rows.append(row)
        print(f"rate {rate:g}: {json.dumps({k: v for k, v in row.items() if k not in ('steps', 'schedule')})}",
              flush=True)
        print(f"rate {rate:g} steps: {json.dumps(row.get('schedule'))}", flush=True)
        # The ranks' device ms a step (CUDA events), the device's gap before it, the host's launch ms and
        # the allocator's retries and cudaMallocs, beside the schedule's measured ms: the host's share.
        device = {role: {k: v for k, v in values.items()
                         if k.startswith(("device_", "gap_", "launch_")) or k in ALLOCATOR.values()}
                  for role, values in steps.items() if any(k.startswith("device_") for k in values)}
        if device:
            print(f"rate {rate:g} device: {json.dumps(device)}", flush=True)
        below = below + 1 if row["slo_attainment"] < args.stop_below else 0
        if below >= 2:
            print(f"two rates in a row below {args.stop_below:.0%} attainment: the sweep stops", flush=True)
            break
    return {"rates": rows}


def fit_prefill_steps(steps: list[list[float]]) -> dict | None:
    """Least squares of the logged prefill steps' measured ms (schedule_row's last_steps, every
    rate's pooled) against a fixed part, their prompt tokens and their token-context pairs (tokens
    times mean context: attention's quadratic part): what a step costs whatever it carries
    (weights read, decodes, launch) against what each token adds. None under 4 steps or where the
    steps do not tell the three apart, or without numpy."""
    try:
        import numpy as np
    except ImportError:
        return None
    if len(steps) < 4:
        return None
    a = np.array([[1.0, s[0], s[0] * s[2]] for s in steps])
    measured = np.array([s[4] for s in steps], dtype=float)
    coef, _, rank, _ = np.linalg.lstsq(a, measured, rcond=None)
    if rank < 3:
        return None
    rms = float(np.sqrt(np.mean((a @ coef - measured) ** 2)))
    return {"steps": len(steps), "fixed_ms": round(float(coef[0]), 2), "us_per_token": round(float(coef[1]) * 1e3, 3),
            "ns_per_pair": round(float(coef[2]) * 1e6, 3), "rms_ms": round(rms, 2)}


def markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [f"# Goodput on the production mix: {cfg['preset']} random weights, {cfg['kind']}", "",
             f"Command: `{report['command']}`", "", f"Date: {report['date']}", "",
             f"SLO: TTFT <= {cfg['slo_ttft_ms']} ms and TPOT <= {cfg['slo_tpot_ms']} ms for at least "
             f"{cfg['slo_attainment']:.0%} of the requests; {cfg['duration_s']} s of arrivals per rate, the first "
             f"{cfg['settle_s']} s not counted.", ""]
    mesh = report.get("mesh", {})
    if mesh.get("error"):
        lines += [f"The mesh run failed: `{mesh['error']}`", ""]
    rows = mesh.get("cases", {}).get("rates", [])
    if rows:
        lines += ["| offered req/s | counted (ok) | completed req/s | SLO met | TTFT p50/p99 ms | TPOT p50/p99 ms | "
                  "E2E p99 ms | GPU busy | prompt tok/s | prefill FLOPs / peak | queue ms (mean) | "
                  "step ms with / without prefill | errors |", "|" + "---|" * 13]
        for r in rows:
            lines.append(
                f"| {r['rate']:g} | {r['counted']} ({r['ok']}) | {r['completed_per_s']} | {r['slo_attainment']:.1%} | "
                f"{r['ttft_ms_p50']} / {r['ttft_ms_p99']} | {r['tpot_ms_p50']} / {r['tpot_ms_p99']} | "
                f"{r['e2e_ms_p99']} | {r.get('busy_share')} | {r['prompt_tokens_per_s']} | "
                f"{r['prefill_share_of_peak']:.1%} | {r.get('queue_ms')} | "
                f"{r.get('schedule', {}).get('prefill_step_ms')} / {r.get('schedule', {}).get('decode_step_ms')} | "
                f"{', '.join(f'{k} {v}' for k, v in r['errors'].items()) or 'none'} |")
        lines += ["", f"**Goodput: {report['goodput']:g} req/s** (target >= 12 req/s on one H200)", ""]
        fit = fit_prefill_steps([s for r in rows for s in r.get("schedule", {}).get("last_steps", [])])
        if fit:
            lines += [f"Prefill steps' measured time, fitted over {fit['steps']} logged steps (each rate's last): "
                      f"{fit['fixed_ms']} ms a step + {fit['us_per_token']} us a prompt token + {fit['ns_per_pair']} "
                      f"ns a token-context pair (prompt tokens x their mean context), rms error {fit['rms_ms']} ms.", ""]
    return "\n".join(lines) + "\n"


def plot(json_path: pathlib.Path) -> pathlib.Path:
    """Draws the SLA curve of a result file beside it; returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(json_path.read_text())
    cfg, rows = report["config"], report["mesh"]["cases"]["rates"]
    rates = [r["rate"] for r in rows]
    fig, (ttft, tpot) = plt.subplots(1, 2, figsize=(10, 4))
    ttft.plot(rates, [r["ttft_ms_p99"] for r in rows], "o-", label="TTFT p99")
    ttft.plot(rates, [r["ttft_ms_p50"] for r in rows], "o--", label="TTFT p50")
    ttft.axhline(cfg["slo_ttft_ms"], color="red", lw=1, label="SLO")
    tpot.plot(rates, [r["tpot_ms_p99"] for r in rows], "o-", label="TPOT p99")
    tpot.plot(rates, [r["tpot_ms_p50"] for r in rows], "o--", label="TPOT p50")
    tpot.axhline(cfg["slo_tpot_ms"], color="red", lw=1, label="SLO")
    for axis, name in ((ttft, "TTFT ms"), (tpot, "TPOT ms")):
        axis.set_xlabel("offered requests/s")
        axis.set_ylabel(name)
        axis.set_yscale("log")
        axis.axvline(report["goodput"], color="green", lw=1, ls=":")
        axis.legend()
    fig.suptitle(f"Production mix, {cfg['preset']}, {cfg['kind']}: goodput {report['goodput']:g} req/s")
    fig.tight_layout()
    out = json_path.with_suffix(".png")
    fig.savefig(out, dpi=100)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.serving.goodput", description=__doc__.split("\n\n")[0])
    parser.add_argument("--plot", type=pathlib.Path, help="only draw the PNG of this result JSON")
    parser.add_argument("--kind", default="nvidia-h200", help="machine name, for the result files")
    parser.add_argument("--name", default="goodput", help="result files' stem (NAME_KIND.md); e.g. goodput_fp8 "
                        "for another --preset, so that the bf16 result stays")
    parser.add_argument("--preset", default="qwen3-30b-a3b", help="random-weights shape")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--rates", default="2,4,6,8,10,12,16", help="comma list of offered requests/s")
    parser.add_argument("--duration-s", type=float, default=30.0, help="seconds of arrivals per rate")
    parser.add_argument("--settle-s", type=float, default=5.0, help="arrivals not counted at each rate's start")
    parser.add_argument("--slo-ttft-ms", type=float, default=500.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=40.0)
    parser.add_argument("--slo-attainment", type=float, default=0.99)
    parser.add_argument("--stop-below", type=float, default=0.5, help="attainment that ends the sweep (twice)")
    parser.add_argument("--prompt-scale", type=float, default=1.0, help="multiplies the prompt lengths")
    parser.add_argument("--max-running", type=int, default=256, help="the gateway's --max-running-requests")
    parser.add_argument("--max-batch-tokens", type=int, default=8192, help="the gateway's --max-batch-tokens")
    parser.add_argument("--step-budget", action=argparse.BooleanOptionalAction, default=True,
                        help="the gateway's SLO step budget (--tpot-target-ms --slo-tpot-ms, --prefill-chunk-size 0;"
                             " opt-in in the gateway); --no-step-budget: its default scheduler")
    parser.add_argument("--shed", action=argparse.BooleanOptionalAction, default=True,
                        help="the gateway sheds requests predicted past the TTFT SLO (--ttft-target-ms "
                             "--slo-ttft-ms); a --gateway-arg may still override it")
    parser.add_argument("--gateway-arg", action="append", default=[], metavar="ARG")
    parser.add_argument("--expert-arg", action="append", default=[], metavar="ARG")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout-s", type=float, default=120.0)
    parser.add_argument("--ready-timeout-s", type=float, default=300.0)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    try:
        args.rate_list = [float(r) for r in args.rates.split(",") if r]
    except ValueError:
        parser.error(f"--rates must be numbers, got {args.rates!r}")
    if not args.rate_list or min(args.rate_list) <= 0 or args.duration_s <= 0 or args.settle_s >= args.duration_s:
        parser.error("--rates must be positive, --duration-s positive and above --settle-s")
    # What gpu_speed.run_mesh and warm_up read; the stats file is main's.
    args.mix_concurrency, args.output_scale, args.stats_path = args.max_running, 1.0, ""
    # First, so that the caller's own gateway args win.
    budget = [f"--tpot-target-ms={args.slo_tpot_ms:g}", "--prefill-chunk-size=0"] if args.step_budget else []
    shed = [f"--ttft-target-ms={args.slo_ttft_ms:g}"] if args.shed else []
    args.gateway_arg = [*budget, *shed, *args.gateway_arg]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot:
        print(f"wrote {plot(args.plot)}")
        return 0
    from services.model.random_weights import write_model_dir

    report = {"command": " ".join(["python -m bench.serving.goodput", *(argv if argv is not None else sys.argv[1:])]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "config": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()
                         if k not in ("plot", "mix_concurrency", "output_scale")}}
    with tempfile.TemporaryDirectory(prefix="goodput-") as tmp:
        model_dir = write_model_dir(pathlib.Path(tmp) / args.preset, args.preset)
        # The gateway's counters, per rate: where the steps went (schedule_row).
        args.stats_path = str(pathlib.Path(tmp) / "gateway-stats.json")
        args.gateway_arg = [*args.gateway_arg, f"--stats-file={args.stats_path}", "--stats-interval-s=0.5"]
        try:
            report["mesh"] = run_mesh(args, [], model_dir, drive=_sweep)
        except Exception as error:
            report["mesh"] = {"error": repr(error)[-2000:]}
    rows = report["mesh"].get("cases", {}).get("rates", [])
    report["goodput"] = goodput(rows, args.slo_attainment)
    text = markdown(report)
    write_result(args.out, f"{args.name}_{args.kind}", report, text)
    print(text)
    for role, lines in report["mesh"].get("log_tails", {}).items():
        print(f"--- {role} log tail\n{lines}")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
