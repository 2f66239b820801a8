"""Dynamic expert scaling on skewed routing: the slowest rank's step time without and with spare slots.

    source bench/gpu_env.sh && python -m bench.serving.skew --kind nvidia-h200-x2          # 2 GPUs
    python -m bench.serving.skew --device cpu --preset tiny-skewed --concurrency 8 \\
        --prompt-tokens 64 --new-tokens 16 --requests 32 --settle-s 10 --prompt-scale 0.05 \\
        --scale-up-window-s 2 --out /tmp/skew                  # CPU smoke

Two meshes on `--ranks` ranks (moemesh.launcher.Mesh, one expert service per
GPU) on the random weights of a skewed preset (services/model/random_weights.py:
most tokens prefer top_k experts of the first half, which rank 0 of 2 holds),
one started with `--num-spare-expert-slots 0`, one with `auto`, and a router
with short windows (`--scale-up-window-s`, the scale-down window four times
that, the default thresholds: a 10% share up, 3% down, 3 copies). Each mesh:

1. warm-up (bench/serving/gpu_speed.py's: graph captures, Triton compiles);
2. settle: the measured workload for `--settle-s` seconds, so that the router
   sees the skew and, with spares, the replicas are staged and installed
   (the expert logs say which placement epochs were installed);
3. measure: `--requests` requests of `--prompt-tokens` random prompt tokens and
   `--new-tokens` new tokens at `--concurrency`, the ranks' step-duration
   histograms read before and after (/metrics): each rank's mean step time,
   the slowest rank's, output tokens/s.

Every rank waits for the others in each MoE layer's exchange, so a rank's step
time includes its wait for the slowest: what replicas should lower is the
step time of the group. Results: skew_<kind>.json and .md under --out.
"""

import argparse
import asyncio
import pathlib
import sys
import tempfile
import time

from bench.serving.gpu_speed import scrape_steps, step_attribution, warm_up
from bench.serving.serve import print_role_logs, role_metrics, run_load, summarize, write_result
from bench.serving.workloads import RequestSpec, make_workload

VARIANTS = ("0", "auto")


def workload(args, count: int, seed: int) -> list[RequestSpec]:
    """count requests of random prompts (the skewed presets' tokens are mostly A tokens)."""
    return make_workload("1k1k", count, scale=args.prompt_tokens / 1024, output_scale=args.new_tokens / 1024,
                         seed=seed)


async def drive(target: str, args, metrics: dict[str, str]) -> dict:
    """Warm-up, settle, measure (see the module doc)."""
    await warm_up(target, args, args.concurrency)
    load = argparse.Namespace(rate=0.0, seed=args.seed, request_timeout_s=args.request_timeout_s,
                              concurrency=args.concurrency)
    deadline, round_ = time.monotonic() + args.settle_s, 0
    while time.monotonic() < deadline:
        await run_load(target, workload(args, args.concurrency, seed=args.seed + 1000 + round_), load, f"settle{round_}")
        round_ += 1
    before = await asyncio.to_thread(scrape_steps, metrics)
    results, wall_s = await run_load(target, workload(args, args.requests, seed=args.seed), load, "measure")
    steps = step_attribution(before, await asyncio.to_thread(scrape_steps, metrics), wall_s)
    ranks = {role: row for role, row in steps.items() if role.startswith("expert")}
    slowest = max((row["mean_step_ms"] or 0.0 for row in ranks.values()), default=0.0)
    return {"client": summarize(results, wall_s), "steps": steps, "slowest_rank_step_ms": slowest}


def run_variant(args, model_dir: pathlib.Path, spares: str) -> dict:
    """One mesh with --num-spare-expert-slots `spares`: its results and installed placement epochs."""
    from moemesh.launcher import Mesh, MeshSpec

    window = args.scale_up_window_s
    per_rank = max(1, -(-args.concurrency // args.ranks))
    extra = {"expert_svc": ["--random-weights", args.preset, *args.expert_arg],
             "router_svc": ["--policy-interval-s", "1", "--scale-up-window-s", str(window),
                            "--scale-down-window-s", str(4 * window), "--rebalance-interval-s", "0"],
             "gateway": ["--max-running-requests", str(per_rank), "--no-enable-prefix-cache"]}
    with tempfile.TemporaryDirectory(prefix="skew-") as work_dir:
        spec = MeshSpec(model_dir=str(model_dir), num_ranks=args.ranks, device=args.device, extra_args=extra,
                        work_dir=work_dir, ready_timeout_s=args.ready_timeout_s, num_spare_expert_slots=spares)
        mesh = Mesh(spec)
        try:
            mesh.start()
            metrics = role_metrics(mesh)
            out = asyncio.run(drive(mesh.gateway_address, args, metrics))
            logs = {r.name: r.log_path.read_text(errors="replace") for r in mesh.roles if r.name.startswith("expert")}
        except BaseException:
            print_role_logs(mesh)
            raise
        finally:
            mesh.stop()
    out["spare_slots"] = {name: [line.split("auto: ", 1)[1] for line in text.splitlines()
                                 if "--num-spare-expert-slots auto" in line] for name, text in logs.items()}
    out["installed_epochs"] = {name: text.count("installed expert placement epoch") for name, text in logs.items()}
    return out


def report(args, results: dict) -> str:
    lines = [f"# Skewed routing on {args.ranks} ranks ({args.kind}, {args.preset})", "",
             f"c{args.concurrency}, {args.requests} requests of {args.prompt_tokens} prompt / {args.new_tokens} new "
             f"tokens after {args.settle_s:.0f} s of settling; scale-up window {args.scale_up_window_s:.0f} s.", "",
             "| spare slots | slowest rank step ms | per-rank mean step ms | output tok/s | placements installed |",
             "|---|---|---|---|---|"]
    for spares, r in results.items():
        per_rank = ", ".join(f"{role} {row['mean_step_ms']}" for role, row in sorted(r["steps"].items())
                             if role.startswith("expert"))
        lines.append(f"| {spares} | {r['slowest_rank_step_ms']} | {per_rank} | "
                     f"{r['client'].get('output_tokens_per_s')} | {max(r['installed_epochs'].values(), default=0)} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.serving.skew", description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="nvidia-h200-x2", help="machine name, for the result files")
    parser.add_argument("--preset", default="qwen3-30b-a3b-skewed", help="a skewed random-weights preset")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="the --num-spare-expert-slots values")
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--settle-s", type=float, default=60.0, help="load before measuring (replicas come)")
    parser.add_argument("--scale-up-window-s", type=float, default=10.0, help="the router's; down is 4x")
    parser.add_argument("--expert-arg", action="append", default=[], metavar="ARG")
    parser.add_argument("--prompt-scale", type=float, default=0.5, help="warm-up prompts, as gpu_speed's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    parser.add_argument("--ready-timeout-s", type=float, default=300.0)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/results"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from services.model.random_weights import write_model_dir

    args = parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(pathlib.Path(tmp) / args.preset, args.preset)
        for spares in args.variants.split(","):
            results[spares] = run_variant(args, model_dir, spares)
            print(f"spare slots {spares}: slowest rank {results[spares]['slowest_rank_step_ms']} ms a step", flush=True)
    text = report(args, results)
    print(text)
    write_result(args.out, f"skew_{args.kind}", {"command": sys.argv, "args": {k: str(v) for k, v in vars(args).items()},
                                                  "results": results}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
