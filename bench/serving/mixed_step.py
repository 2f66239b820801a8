"""Eager steps that mix prefill chunks with decodes, against prefill-only and decode-only (issue 8).

    python -m bench.serving.mixed_step --out DIR [--preset qwen3-30b-a3b] [--device cuda]

At c256 on one H200 (a gpu_speed run of 2026-11-30, commit 32a624f) the steps
that carry prefill chunks took about 104 ms each (by subtraction: the case's 36.6 s
less 1,024 decode steps at the ITL p50, over the other 69 steps) against 52 ms for
a prefill-only step of the same 4,096 tokens (bench/serving/gpu_speed.py's profile). This times, on the
serving model (random weights, bf16), model.forward of:
- prefill: 8 new prompts x 512 tokens;
- mixed: 8 chunks x 480 tokens, each after 512 cached, plus 256 decodes at 1K context
  (4,096 tokens, the gateway's --max-batch-tokens);
- decode: the 256 decodes alone, eagerly;
- with --long-prompt L: long, one whole prompt of L tokens (nothing cached), and
  long_mixed, it beside the decodes (the production mix's 4-8K prompts).
For each: the host time until forward returns (launches) and the wall time to the
device's end, over 5 steps after 3 warm-ups; the host syncs of one step
(torch.cuda.set_sync_debug_mode "warn": each sync warns with where it happened);
and the top kernels of one step (torch.profiler). Then the mixed step again with
each --variants setting of the triton attention (TritonPagedAttention's knobs:
mixed_decode sends the decodes through the decode kernel, prefill_rows, block_n,
num_warps, prefill_stages, sdpa_min_tokens: 0 keeps whole prompts in the prefill kernel,
sdpa_flash_first: torch's flash kernel before cuDNN's, sdpa_expand_kv: K/V copied out to every query head for
the whole prompts): its wall time and its logits' largest difference from the default's.
With --prefill-graphs TOKENS, the steps of up to TOKENS tokens again through piecewise CUDA
graphs (expert_svc/prefill_graphs.py): the capture's time and memory, each step's host launch
and wall time, its logits against the eager step's.
Writes mixed_step.json and .md.
"""

import argparse
import json
import pathlib
import sys
import time
import warnings

import torch

from services.kv_pool import KVPool
from services.model.batch import SeqInput, build_forward_batch
from services.model.qwen3_moe import Qwen3MoeModel
from services.model.random_weights import RandomWeights, preset

BLOCK = 16
CONTEXT = 1024
NUM_DECODES = 256
NUM_CHUNKS = 8
# name=knob:value,...: TritonPagedAttention settings the mixed step is timed with.
DEFAULT_VARIANTS = ("mixed_decode=mixed_decode:1;rows128=prefill_rows:128,num_warps:8;"
                    "rows128_mixed=prefill_rows:128,num_warps:8,mixed_decode:1;block_n128=block_n:128;"
                    "rows32=prefill_rows:32;stages2=prefill_stages:2;stages4=prefill_stages:4;sdpa_off=sdpa_min_tokens:0")


def parse_variants(text: str) -> dict[str, dict[str, int]]:
    """"name=knob:value,knob:value;..." as {name: {knob: int value}}."""
    variants = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        name, _, knobs = item.partition("=")
        variants[name] = {k: int(v) for k, v in (pair.split(":") for pair in knobs.split(",") if pair)}
    return variants


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step_batches(per_seq: int, num_decodes: int, num_chunks: int, long_prompt: int = 0) -> dict[str, list[SeqInput]]:
    def table(i: int) -> list[int]:
        return list(range(i * per_seq, (i + 1) * per_seq))

    decodes = [SeqInput(i, [1000 + i], CONTEXT, table(i), True) for i in range(num_decodes)]
    fresh = [SeqInput(num_decodes + i, [2000 + i] * 512, 0, table(num_decodes + i), True) for i in range(num_chunks)]
    chunks = [SeqInput(num_decodes + i, [2000 + i] * 480, 512, table(num_decodes + i), True)
              for i in range(num_chunks)]
    steps = {"prefill": fresh, "mixed": chunks + decodes, "decode": decodes}
    if long_prompt:  # its blocks after every other sequence's
        first = (num_decodes + num_chunks) * per_seq
        long = SeqInput(num_decodes + num_chunks, [3000] * long_prompt, 0,
                        list(range(first, first + -(-long_prompt // BLOCK))), True)
        steps |= {"long": [long], "long_mixed": [long] + decodes}
    return steps


def time_step(model, batch, kv, device: str, num_tokens: int) -> dict:
    return time_calls(lambda: model.forward(batch, kv, max_tokens_per_rank=num_tokens), device, num_tokens)


def time_calls(step, device: str, num_tokens: int) -> dict:
    """step() 3 times to warm up, then 5 timed: the fastest host time until it returns and to the device's end."""
    for _ in range(3):
        step()
    _sync(device)
    launch, wall = [], []
    for _ in range(5):
        start = time.perf_counter()
        step()
        launch.append(time.perf_counter() - start)
        _sync(device)
        wall.append(time.perf_counter() - start)
    return {"tokens": num_tokens, "launch_ms": round(1e3 * min(launch), 2), "wall_ms": round(1e3 * min(wall), 2)}


def time_graph_steps(model, kv, steps: dict[str, list[SeqInput]], max_tokens: int, device: str) -> dict:
    """Each step of up to max_tokens tokens through piecewise CUDA graphs (expert_svc/prefill_graphs.py,
    every bucket captured first: its time and memory), timed as the eager steps, with its logits
    against the eager forward's on the same inputs."""
    from expert_svc.prefill_graphs import make_prefill_graph_runner  # CUDA only

    reserved = torch.cuda.memory_reserved()
    start = time.perf_counter()
    runner = make_prefill_graph_runner(model, max_tokens)
    report = {"max_tokens": max_tokens, "capture_s": round(time.perf_counter() - start, 1),
              "pool_gib": round((torch.cuda.memory_reserved() - reserved) / 2**30, 2), "steps": {}}
    if runner is None:
        return report | {"error": "no runner (the log says why)"}
    report |= {"buckets": len(runner.buckets), "graphs": runner.num_captures}
    for name, seqs in steps.items():
        batch = build_forward_batch(seqs, BLOCK, device)
        if not runner.fits(batch.num_tokens):
            continue
        reference = model.forward(batch, kv, max_tokens_per_rank=batch.num_tokens).clone()
        row = time_calls(lambda: runner.run(batch, kv), device, batch.num_tokens)
        logits = runner.run(batch, kv)
        row |= {"bucket": runner.bucket(batch.num_tokens),
                "max_logit_diff": round(float((logits - reference).abs().max()), 4),
                "argmax_agree": round(float((logits.argmax(-1) == reference.argmax(-1)).float().mean()), 4)}
        report["steps"][name] = row
        print(f"graphs {name}: {row}", flush=True)
    return report


def host_syncs(model, batch, kv, device: str, num_tokens: int) -> list[str]:
    """Where one step synchronises with the host (CUDA only)."""
    if device != "cuda":
        return []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.forward(batch, kv, max_tokens_per_rank=num_tokens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _sync(device)
    return [f"{w.filename}:{w.lineno}: {str(w.message)[:200]}" for w in caught]


def top_kernels(model, batch, kv, device: str, num_tokens: int) -> str:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        model.forward(batch, kv, max_tokens_per_rank=num_tokens)
        _sync(device)
    sort = "cuda_time_total" if device == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=16, max_name_column_width=48)


def time_variants(model, kv, seqs: list[SeqInput], variants: dict[str, dict[str, int]], device: str) -> dict:
    """The mixed step's wall time with each triton attention setting, and its logits against
    the default setting's on the same inputs (the KV pool is the same: the step rewrites
    the same slots with the same values)."""
    from services.model.kernels.attention import TritonPagedAttention  # imports triton: CUDA only

    batch = build_forward_batch(seqs, BLOCK, device)
    default = model.attention
    results = {}
    try:
        model.attention = TritonPagedAttention()
        reference = model.forward(batch, kv, max_tokens_per_rank=batch.num_tokens).clone()
        for name, knobs in variants.items():
            try:
                model.attention = TritonPagedAttention(**knobs)
                row = time_step(model, batch, kv, device, batch.num_tokens)
                logits = model.forward(batch, kv, max_tokens_per_rank=batch.num_tokens)
                row["max_logit_diff"] = round(float((logits - reference).abs().max()), 4)
            except Exception as error:  # a setting that does not compile or fit: reported, not fatal
                row = {"wall_ms": None, "max_logit_diff": None, "error": repr(error)[:300]}
            row["knobs"] = knobs
            results[name] = row
            print(f"variant {name} {knobs}: {row}", flush=True)
    finally:
        model.attention = default
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--layers", type=int, default=0, help="fewer layers (0: the preset's)")
    parser.add_argument("--decodes", type=int, default=NUM_DECODES, help="decode rows of the mixed step")
    parser.add_argument("--chunks", type=int, default=NUM_CHUNKS, help="prefill chunks of the mixed step")
    parser.add_argument("--long-prompt", type=int, default=0,
                        help="also time one whole prompt of this many tokens, alone and beside the decodes")
    parser.add_argument("--variants-step", default="mixed", help="the step the variants are timed on")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="triton attention settings to time the mixed "
                        "step with: name=knob:value,...;... ('' for none; CUDA only)")
    parser.add_argument("--prefill-graphs", type=int, default=0, metavar="TOKENS",
                        help="also run the steps of up to TOKENS tokens through piecewise CUDA graphs (CUDA only)")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args(argv)
    config = preset(args.preset)
    if args.layers:
        import dataclasses

        config = dataclasses.replace(config, num_hidden_layers=args.layers, mlp_only_layers=tuple(
            layer for layer in config.mlp_only_layers if layer < args.layers))
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    start = time.perf_counter()
    model = Qwen3MoeModel(config, RandomWeights(config, range(config.num_experts), 0, device=args.device),
                          expert_ids=range(config.num_experts), dtype=dtype, device=args.device,
                          attention="auto")
    _sync(args.device)
    command = " ".join(sys.argv[1:] if argv is None else argv)
    report = {"command": f"python -m bench.serving.mixed_step {command}".rstrip(), "preset": args.preset,
              "layers": config.num_hidden_layers, "device": args.device,
              "model_build_s": round(time.perf_counter() - start, 1), "steps": {}}
    per_seq = -(-(CONTEXT + 1) // BLOCK)
    kv = KVPool.for_model(config, per_seq * (args.decodes + args.chunks) + -(-args.long_prompt // BLOCK), BLOCK,
                          dtype, args.device)
    steps = step_batches(per_seq, args.decodes, args.chunks, args.long_prompt)
    for name, seqs in steps.items():
        batch = build_forward_batch(seqs, BLOCK, args.device)
        num_tokens = batch.num_tokens
        row = time_step(model, batch, kv, args.device, num_tokens)
        row["host_syncs"] = host_syncs(model, batch, kv, args.device, num_tokens)
        row["profile"] = top_kernels(model, batch, kv, args.device, num_tokens)
        report["steps"][name] = row
        print(f"{name}: {num_tokens} tokens, launch {row['launch_ms']} ms, wall {row['wall_ms']} ms, "
              f"{len(row['host_syncs'])} host syncs", *row["host_syncs"][:8], row["profile"], sep="\n", flush=True)
    if args.device == "cuda" and args.variants:
        report["variants_step"] = args.variants_step
        report["variants"] = time_variants(model, kv, steps[args.variants_step], parse_variants(args.variants),
                                           args.device)
    if args.device == "cuda" and args.prefill_graphs:
        report["prefill_graphs"] = time_graph_steps(model, kv, steps, args.prefill_graphs, args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mixed_step.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# Eager prefill, mixed and decode steps of the serving model", "",
             f"Command: `{report['command']}` ({args.preset}, {report['layers']} layers, {args.device})", "",
             "| step | tokens | host launch ms | wall ms | host syncs |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {name} | {r['tokens']} | {r['launch_ms']} | {r['wall_ms']} | {len(r['host_syncs'])} |"
              for name, r in report["steps"].items()]
    if report.get("variants"):
        lines += ["", f"## The {report['variants_step']} step with other triton attention settings", "",
                  "| variant | settings | wall ms | largest logit difference from the default |", "|---|---|---:|---:|"]
        lines += [f"| {name} | {v['knobs']} | {v['wall_ms']} | {v['max_logit_diff']} |"
                  for name, v in report["variants"].items()]
    if graphs := report.get("prefill_graphs"):
        lines += ["", f"## The steps through piecewise CUDA graphs (up to {graphs['max_tokens']} tokens)", "",
                  f"Captured in {graphs['capture_s']} s: {graphs.get('buckets')} buckets, {graphs.get('graphs')} "
                  f"graphs, {graphs['pool_gib']} GiB more reserved. {graphs.get('error', '')}", "",
                  "| step | tokens | bucket | host launch ms | wall ms | eager wall ms | largest logit difference "
                  "from eager | argmax agreement |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {name} | {r['tokens']} | {r['bucket']} | {r['launch_ms']} | {r['wall_ms']} | "
                  f"{report['steps'][name]['wall_ms']} | {r['max_logit_diff']} | {r['argmax_agree']} |"
                  for name, r in graphs["steps"].items()]
    for name, r in report["steps"].items():
        lines += ["", f"## {name}", ""] + [f"- sync: {s}" for s in r["host_syncs"]] + ["", "```", r["profile"], "```"]
    (args.out / "mixed_step.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
