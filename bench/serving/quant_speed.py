"""Quantized presets against bf16 on one GPU, in one call, each figure against its bound (issue 29).

    source bench/gpu_env.sh && python -m bench.serving.quant_speed --kind nvidia-h200 \\
        --presets qwen3-30b-a3b,qwen3-30b-a3b-fp8,qwen3-30b-a3b-awq --cases b1,c256,mix
    python -m bench.serving.quant_speed --kind nvidia-h200 --name quant235_speed \\
        --presets qwen3-235b-a22b-awq --cases b1,c16,c64,mix --mix-requests 32

One mesh per preset after the other (bench/serving/gpu_speed.run_mesh: random
weights on the device, quantized ones drawn in their stored layout), the same
cases and prompts for each: `b1` decode tokens/s of one 1K-in/1K-out request,
`cN` output tokens/s at concurrency N, `mix` the production mix's requests/s
(4K/32, 2K/128, 8K/16). Each figure sits beside its bound (quant_plan.py: the
HBM bound of the weights a decode step reads in the preset's stored layout,
with and without the KV reads; for the mix a roofline of prefill at the
tensor-core peak plus decode at the HBM bound) and beside the first preset's
figure of the same case (the bf16 baseline when it comes first). Before each
mesh the memory plan (quant_plan.memory_plan) gives the KV capacity and the
--kv-memory-fraction that leaves the activation and CUDA-graph reserve; the
KV blocks the service really made are read from its /metrics.

Results: <out>/<name>_<kind>.md and .json (one file per GPU kind), rewritten
after each preset. A run merges into the file it finds there by (preset,
case): the cases it measured replace those of earlier runs, the others stay,
each case's row naming its run (`"run"`: an index into `"runs"`, which keeps
every run's command, date, setup, config and per-preset figures: plan, KV
blocks, startup). So a run of one case (`--cases c256`) adds to the same
file as the full run. `--name` is for another subject (the 235B preset's
runs, quant235_speed), whose baseline is not the 30B's.
"""

import argparse
import asyncio
import json
import pathlib
import sys
import tempfile
import time
import urllib.request

from bench.serving import gpu_speed
from bench.serving.quant_plan import DEFAULT_KV_FRACTION, H200_BYTES, kv_fraction, memory_plan, mix_bound, quant_bound
from bench.serving.serve import RESULTS_DIR, write_result
from bench.serving.workloads import MIX
from services.model.random_weights import write_model_dir

# The targets on one H200: (preset, case) -> the least figure (b1, cN: tokens/s).
TARGETS = {("qwen3-30b-a3b-fp8", "b1"): 650, ("qwen3-30b-a3b-fp8", "c256"): 12_000, ("qwen3-30b-a3b-awq", "b1"): 900}
KV_BLOCK_SIZE = 16  # the expert service's default --kv-block-size


def case_context(case: str, prompt_scale: float, output_scale: float) -> int:
    """A 1K-in/1K-out case's mean context over its decode steps (gpu_speed's)."""
    return round(1024 * prompt_scale + 512 * output_scale)


def measured(case: str, row: dict) -> tuple[float, str]:
    """A case's headline figure and its unit: b1 decode tokens/s, cN output tokens/s, mix requests/s."""
    if case == "b1":
        return row.get("decode_tokens_per_s_per_seq", 0.0), "decode tok/s"
    if case == "mix":
        return row["requests_per_s"], "req/s"
    return row["output_tokens_per_s"], "out tok/s"


def normalized(report: dict) -> dict:
    """A result in the merged form ("runs", each case's row naming its run); a result written
    before results merged (one run, no "runs") becomes that one run."""
    if "runs" in report:
        return report
    run = {"command": report["command"], "date": report["date"], "setup": report.get("setup", {}),
           "config": report["config"], "presets": {p: _run_fields(r) for p, r in report["presets"].items()}}
    presets = {p: {**r, "cases": {c: {**row, "run": 0} for c, row in r.get("cases", {}).items()}}
               for p, r in report["presets"].items()}
    return {**report, "runs": [run], "presets": presets}


def _run_fields(preset_run: dict) -> dict:
    """What a run measured of a preset besides its cases (the logs are kept for the latest run only)."""
    return {k: v for k, v in preset_run.items() if k not in ("cases", "log_tails")}


def merged(old: dict | None, new: dict) -> dict:
    """`new` (one run) merged into `old` by (preset, case): new's cases replace old's, old's other
    cases stay; a preset's other fields are the newest run's (every run's stay in "runs"); the
    presets keep old's order, new ones after (the first is every ratio's baseline)."""
    new = normalized(new)
    if old is None:
        return new
    old = normalized(old)
    offset = len(old["runs"])
    presets = dict(old["presets"])
    for preset, run in new["presets"].items():
        before = presets.get(preset, {})
        cases = {**before.get("cases", {}),
                 **{c: {**row, "run": row["run"] + offset} for c, row in run.get("cases", {}).items()}}
        needed = {**before.get("kv_tokens_needed", {}), **run.get("kv_tokens_needed", {})}
        presets[preset] = {**run, "cases": cases, "kv_tokens_needed": needed}
    return {**new, "runs": old["runs"] + new["runs"], "presets": presets}


def read_result(path: pathlib.Path) -> dict | None:
    """The result already at path, None if there is none."""
    return json.loads(path.read_text()) if path.is_file() else None


def case_bound(preset: str, case: str, row: dict, config: dict) -> tuple[float, float]:
    """(bound of the headline figure on weights only, with the KV reads too) for one case."""
    kv_element = 1 if gpu_speed.kv_cache_dtype(config.get("expert_arg", [])) == "fp8_e4m3" else 2
    if case == "mix":
        shapes = [(max(1, round(s.num_prompt_tokens * config["prompt_scale"])), s.max_new_tokens, s.weight)
                  for s in MIX]
        b = mix_bound(preset, shapes, row["concurrency"], kv_element)["requests_per_s"]
        return b, b
    b = quant_bound(preset, row["concurrency"], case_context(case, config["prompt_scale"], config["output_scale"]),
                    kv_element)
    return b["tokens_per_s"], b["tokens_per_s_with_kv"]


def table(report: dict) -> list[dict]:
    """One row per (preset, case): the figure, its bounds, its share of them, its ratio to the
    first preset's same case, and the issue's target where it has one."""
    rows, baseline = [], {}
    for preset, run in report["presets"].items():
        for case, row in run.get("cases", {}).items():
            value, unit = measured(case, row)
            config = report["runs"][row["run"]]["config"] if "run" in row else report["config"]
            weights_bound, kv_bound = case_bound(preset, case, row, config)
            baseline.setdefault(case, (preset, value))
            base_preset, base_value = baseline[case]
            out = {"preset": preset, "case": case, "concurrency": row["concurrency"], "value": value, "unit": unit,
                   "bound": weights_bound, "share_of_bound": round(value / weights_bound, 3) if weights_bound else None,
                   "bound_with_kv": kv_bound,
                   "share_of_bound_with_kv": round(value / kv_bound, 3) if kv_bound else None,
                   "vs_first": round(value / base_value, 3) if base_value and base_preset != preset else None,
                   "run": row.get("run")}
            target = TARGETS.get((preset, case))
            if target is not None:
                out["target"], out["target_met"] = target, value >= target
            rows.append(out)
    return rows


def markdown(report: dict) -> str:
    runs = report.get("runs") or [{"command": report["command"], "date": report["date"], "config": report["config"]}]
    lines = [f"# Quantized serving speed, {report['config']['kind']}, one GPU", "",
             "Runs (each row of the table names its run; the latest run's setup below):", ""]
    for i, run in enumerate(runs):
        cfg = run["config"]
        lines.append(f"- run {i}, {run['date']}: `{run['command']}`; cN and b1 send "
                     f"{round(1024 * cfg['prompt_scale'])}-token prompts for {round(1024 * cfg['output_scale'])} new "
                     f"tokens, the mix {cfg.get('mix_requests')} requests at concurrency "
                     f"{cfg.get('mix_concurrency')}, prompts scaled by {cfg['prompt_scale']}")
    lines += ["", f"Setup: {json.dumps(report.get('setup', {}))}", "",
              "The issue's targets are at 1K-in/1K-out. Bounds: quant_plan.py (HBM bound of the weights a decode "
              "step reads in the stored layout, with the KV reads at the case's mean context; the mix: prefill at "
              "the tensor-core peak plus decode at the HBM bound).", "",
              "Memory plan per preset, from its latest run (estimates; `kv_blocks_measured` from the service's "
              "/metrics):", ""]
    for preset, run in report["presets"].items():
        lines.append(f"- {preset}: {json.dumps(run.get('plan', {}))}"
                     + (f"; KV blocks measured {run['kv_blocks_measured']}" if run.get("kv_blocks_measured") else "")
                     + (f"; path {json.dumps(run['quant_paths'])}" if run.get("quant_paths") else "")
                     + (f"; KV tokens the cases hold at their end {json.dumps(run['kv_tokens_needed'])}"
                        if run.get("kv_tokens_needed") else "")
                     + (f"; FAILED: `{run['error']}`" if run.get("error") else ""))
    lines += ["", "| preset | case | conc | figure | unit | bound (weights) | share | bound (+KV) | share | "
              "vs first preset | target | run |", "|" + "---|" * 12]
    for r in table(report):
        target = "" if "target" not in r else f">= {r['target']}: {'met' if r['target_met'] else 'NOT met'}"
        lines.append(f"| {r['preset']} | {r['case']} | {r['concurrency']} | {r['value']} | {r['unit']} | "
                     f"{r['bound']} | {r['share_of_bound']} | {r['bound_with_kv']} | {r['share_of_bound_with_kv']} | "
                     f"{r['vs_first'] if r['vs_first'] is not None else ''} | {target} | "
                     f"{r['run'] if r['run'] is not None else ''} |")
    lines += ["", "Per case, as gpu_speed reports it (latencies, steps):", ""]
    for preset, run in report["presets"].items():
        for case, row in run.get("cases", {}).items():
            which = f" (run {row['run']})" if "run" in row else ""
            lines.append(f"- {preset} {case}{which}: TTFT p50/p99 {row['ttft_ms_p50']}/{row['ttft_ms_p99']} ms, "
                         f"ITL p50/p99 {row['itl_ms_p50']}/{row['itl_ms_p99']} ms, ok {row['num_ok']}/{row['num_requests']}, "
                         f"steps {json.dumps(row.get('steps', {}))}")
    return "\n".join(lines) + "\n"


def kv_tokens_needed(cases: list[str], prompt_scale: float, output_scale: float) -> dict[str, int]:
    """The KV tokens each 1K-in/1K-out case holds at its end (every sequence at its full length):
    beyond the pool's capacity the gateway preempts, and the figure says so."""
    length = round(1024 * prompt_scale) + round(1024 * output_scale)
    return {c: length * (1 if c == "b1" else int(c[1:])) for c in cases if c == "b1" or c[1:].isdigit()}


def kv_blocks(metrics: dict[str, str]) -> dict[str, int]:
    """Each expert service's KV blocks, from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for role, address in metrics.items():
        if not role.startswith("expert"):
            continue
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
            for family in text_string_to_metric_families(response.read().decode()):
                if family.name == "moemesh_expert_kv_blocks":
                    out[role] = int(sum(s.value for s in family.samples))
    return out


def run_preset(args, preset: str) -> dict:
    """One preset's mesh and cases; the plan and the measured KV blocks beside them."""
    sizes = {"max_batch_tokens": args.max_batch_tokens, "device_bytes": args.device_bytes}
    plan = memory_plan(preset, **sizes)
    try:
        fraction = kv_fraction(preset, **sizes)
    except ValueError as error:  # the weights do not fit one GPU: nothing to start
        return {"plan": plan.summary(), "error": str(error)}
    expert_args = list(args.expert_arg)
    if fraction < DEFAULT_KV_FRACTION:  # the default would not leave the activations and graphs their room
        expert_args += ["--kv-memory-fraction", str(fraction)]
        plan = memory_plan(preset, kv_fraction=fraction, **sizes)
    speed_args = gpu_speed.parse_args(
        ["--kind", args.kind, "--preset", preset, "--cases", args.cases, "--prompt-scale", str(args.prompt_scale),
         "--output-scale", str(args.output_scale), "--mix-requests", str(args.mix_requests), "--mix-concurrency",
         str(args.mix_concurrency), "--max-batch-tokens", str(args.max_batch_tokens), "--device", args.device,
         "--ready-timeout-s", str(args.ready_timeout_s), *[f"--expert-arg={a}" for a in expert_args],
         *[f"--gateway-arg={a}" for a in args.gateway_arg]])
    seen: dict[str, int] = {}

    async def drive(target, run_args, cases, max_context, metrics):
        seen.update(await asyncio.to_thread(kv_blocks, metrics))
        return await gpu_speed._drive(target, run_args, cases, max_context, metrics)

    out = {"plan": plan.summary(), "expert_arg": expert_args,
           "kv_tokens_needed": kv_tokens_needed(args.cases.split(","), args.prompt_scale, args.output_scale)}
    with tempfile.TemporaryDirectory(prefix="quant-speed-") as tmp:
        model_dir = write_model_dir(pathlib.Path(tmp) / preset, preset)
        try:
            result = gpu_speed.run_mesh(speed_args, [c for c in args.cases.split(",") if c], model_dir, drive)
            out.update(cases=result["cases"], startup_s=result["startup_s"], log_tails=result["log_tails"],
                       quant_paths=result.get("quant_paths", {}))
        except Exception as error:  # the next presets still run; the report says what failed
            out["error"] = repr(error)[-2000:]
    if seen:
        out["kv_blocks_measured"] = seen
        out["kv_tokens_measured"] = {role: n * KV_BLOCK_SIZE for role, n in seen.items()}
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.serving.quant_speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", default="nvidia-h200", help="machine name, for the result files")
    p.add_argument("--name", default="quant_speed",
                   help="result file name (before _<kind>); runs of one name and kind merge into one file by "
                        "(preset, case): another name only for another subject (its own baseline)")
    p.add_argument("--presets", default="qwen3-30b-a3b,qwen3-30b-a3b-fp8,qwen3-30b-a3b-awq",
                   help="random-weights presets, in order (the first is every ratio's baseline)")
    p.add_argument("--cases", default="b1,c256,mix", help="comma list of b1, cN, mix")
    p.add_argument("--prompt-scale", type=float, default=1.0)
    p.add_argument("--output-scale", type=float, default=1.0)
    p.add_argument("--mix-requests", type=int, default=64)
    p.add_argument("--mix-concurrency", type=int, default=32)
    p.add_argument("--max-batch-tokens", type=int, default=8192)
    p.add_argument("--expert-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--gateway-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--device-bytes", type=int, default=H200_BYTES, help="the GPU's memory, for the memory plan")
    p.add_argument("--ready-timeout-s", type=float, default=300.0)
    p.add_argument("--out", type=pathlib.Path, default=RESULTS_DIR)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    given = argv if argv is not None else sys.argv[1:]
    report = {"command": " ".join(["python -m bench.serving.quant_speed", *given]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "config": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()},
              "setup": gpu_speed._setup(), "presets": {}}
    name = f"{args.name}_{args.kind}"
    earlier = read_result(args.out / f"{name}.json")
    result = merged(earlier, report)
    for preset in [p for p in args.presets.split(",") if p]:
        print(f"=== {preset}", flush=True)
        report["presets"][preset] = run_preset(args, preset)
        result = merged(earlier, report)
        result["table"] = table(result)
        write_result(args.out, name, result, markdown(result))
    print(markdown(result), flush=True)
    return 1 if any("error" in run for run in report["presets"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
