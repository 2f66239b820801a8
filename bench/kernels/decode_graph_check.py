"""Decode steps eager against CUDA-graph replays, on one GPU (issue 8).

    python -m bench.kernels.decode_graph_check --out bench/results

Builds the serving model (services/model/qwen3_moe.py) with random weights of
Qwen3-30B-A3B's shape cut to --layers layers (full width: 128 experts, top-8,
the 151936 vocabulary) and a KV pool filled with noise, then per batch size:

1. Correctness: the same decode inputs (contexts of 64..--max-context cached
   tokens) through `forward_at_capacity` eagerly and through the
   DecodeGraphRunner (its first step eager, then capture, then replays):
   largest logit difference against the largest logit (bf16 tolerance),
   argmax agreement, and the expert hits of each (the runner takes the
   padding rows' hits back out: they must match the eager hits).
2. Host syncs per step: StepRunner.run_step with and without graphs under
   torch.cuda.set_sync_debug_mode("warn"), counting the warnings of one step.
3. Speed: median wall time of StepRunner.run_step (plan in, tokens on the
   host out) over --steps decode steps, eager and graphed, greedy.

Uses the "triton" attention backend (the capturable one); without triton it
times the eager torch path only. Writes decode_graph_check.md / .json to --out.
"""

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import time
import warnings

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from expert_svc.graph_runner import DecodeGraphRunner  # noqa: E402
from expert_svc.runner import StepRunner  # noqa: E402
from services.kv_pool import KVPool  # noqa: E402
from services.model.batch import SeqInput, build_forward_batch  # noqa: E402
from services.model.qwen3_moe import Qwen3MoeModel  # noqa: E402
from services.model.random_weights import RandomWeights, preset  # noqa: E402
from services.step import NewSequence, SamplingSpec, ScheduledSequence, StepPlan  # noqa: E402

BLOCK_SIZE = 16
REL_TOLERANCE = 5e-2  # bf16, as bench/kernels/ep_gpu.py


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch-sizes", default="1,64,50,256")
    p.add_argument("--max-context", type=int, default=1024, help="longest cached context of a sequence")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size and mode")
    p.add_argument("--attention", default="triton")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (graphs replaced by "
                   "eager re-runs, torch attention: the logit check fails there)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    return p.parse_args(argv)


def build(args):
    config = dataclasses.replace(preset(args.preset), num_hidden_layers=args.layers)
    device = torch.device(args.device)
    weights = RandomWeights(config, range(config.num_experts), args.seed, dtype=torch.bfloat16, device=device)
    try:
        model = Qwen3MoeModel(config, weights, expert_ids=range(config.num_experts), dtype=torch.bfloat16,
                              device=device, attention=args.attention)
    except ValueError as error:  # no triton: eager torch attention only
        print(f"attention {args.attention!r} unavailable ({error}); torch attention, eager only", flush=True)
        model = Qwen3MoeModel(config, weights, expert_ids=range(config.num_experts), dtype=torch.bfloat16,
                              device=device, attention="torch")
        args.attention = "torch"
    return config, model


def make_pool(config, num_seqs: int, args) -> KVPool:
    blocks = num_seqs * (-(-(args.max_context + 2 * args.steps + 8) // BLOCK_SIZE))
    kv = KVPool.for_model(config, blocks, BLOCK_SIZE, torch.bfloat16, args.device)
    kv.k_cache.normal_(0, 1)
    kv.v_cache.normal_(0, 1)
    return kv


def contexts(num_seqs: int, args) -> list[int]:
    g = torch.Generator().manual_seed(args.seed + num_seqs)
    return torch.randint(min(64, args.max_context), args.max_context + 1, (num_seqs,), generator=g).tolist()


def make_graphs(model, kv, per_seq: int, args) -> DecodeGraphRunner:
    capture = (lambda fn: fn) if args.device == "cpu" else None
    return DecodeGraphRunner(model, kv, BLOCK_SIZE, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                             max_blocks=per_seq, capture=capture)


def check_correctness(model, config, num_seqs: int, args) -> dict:
    """Eager forward vs the graph runner on the same decode inputs, three rounds."""
    kv = make_pool(config, num_seqs, args)
    per_seq = kv.num_blocks // num_seqs
    graphs = make_graphs(model, kv, per_seq, args)
    capacity = model.dispatch_capacity(num_seqs)
    g = torch.Generator().manual_seed(args.seed)
    rounds = []
    for step, ctx in enumerate([contexts(num_seqs, args)] * 4):
        seqs = [SeqInput(i, [int(torch.randint(0, config.vocab_size, (1,), generator=g))], c + step,
                         list(range(i * per_seq, (i + 1) * per_seq)), True) for i, c in enumerate(ctx)]
        hits_before = model.hit_counts_LE.clone()
        eager_SV = model.forward_at_capacity(build_forward_batch(seqs, BLOCK_SIZE, args.device), kv, capacity)
        eager_hits = model.hit_counts_LE - hits_before
        hits_before = model.hit_counts_LE.clone()
        out = graphs.run(seqs, capacity)
        graph_hits = model.hit_counts_LE - hits_before
        diff = (out.logits_SV - eager_SV).abs().max().item()
        scale = eager_SV.abs().max().item()
        rounds.append({"mode": ["eager (warm-up)", "capture + replay", "replay", "replay"][step]
                       if graphs.bucket(num_seqs) == num_seqs or step else "eager + padding probe",
                       "max_abs_diff": diff, "max_abs_logit": scale,
                       "argmax_agree": (out.greedy_S == eager_SV.argmax(-1)).float().mean().item(),
                       # Exact whatever the rounding: every real token counted K times per MoE layer,
                       # no padding row counted.
                       "hits_total_ok": eager_hits.sum().item() == graph_hits.sum().item()
                       == num_seqs * config.num_experts_per_tok * len(config.moe_layers),
                       # May differ at routing near-ties when padding changes the GEMM shapes.
                       "hits_equal": bool(torch.equal(eager_hits, graph_hits)),
                       "ok": diff <= REL_TOLERANCE * scale})
    _synchronize(args)
    return {"batch": num_seqs, "bucket": graphs.bucket(num_seqs), "capacity": capacity, "rounds": rounds,
            "counts": [graphs.num_eager, graphs.num_captures, graphs.num_replays]}


def plans(num_seqs: int, args, per_seq: int, num_steps: int, drawn: bool):
    """A first step introducing the sequences (cached contexts, one token each), then decodes.
    drawn: every other sequence samples (temperature 0.8, top-p 0.9) instead of greedy."""
    greedy, sampled = SamplingSpec(temperature=0.0), SamplingSpec(temperature=0.8, top_p=0.9, seed=3)
    new = tuple(NewSequence(i, sampled if drawn and i % 2 else greedy, tuple(range(i * per_seq, (i + 1) * per_seq)), c)
                for i, c in enumerate(contexts(num_seqs, args)))
    first = StepPlan(1, "", 0, new_sequences=new, scheduled=tuple(ScheduledSequence(i, (7 + i,))
                                                                  for i in range(num_seqs)),
                     max_tokens_per_rank=num_seqs)
    decode = tuple(ScheduledSequence(i) for i in range(num_seqs))
    return [first] + [StepPlan(s, "", 0, scheduled=decode, max_tokens_per_rank=num_seqs)
                      for s in range(2, num_steps + 2)]


def time_steps(model, config, num_seqs: int, args, graphed: bool, drawn: bool = False) -> dict:
    kv = make_pool(config, num_seqs, args)
    per_seq = kv.num_blocks // num_seqs
    graphs = make_graphs(model, kv, per_seq, args) if graphed else None
    runner = StepRunner(model, kv, BLOCK_SIZE, vocab_size=config.vocab_size, device=args.device, graphs=graphs)
    all_plans = plans(num_seqs, args, per_seq, args.steps + 4, drawn)
    seconds, syncs = [], None
    for i, plan in enumerate(all_plans):
        if i == len(all_plans) - 1:  # the last step: count its host syncs
            _synchronize(args)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if args.device == "cuda":
                    torch.cuda.set_sync_debug_mode("warn")
                runner.run_step(plan)
                if args.device == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
            # torch's one-time notice on enabling the mode is not a sync.
            syncs = [str(w.message).splitlines()[0][:120] for w in caught if "prototype" not in str(w.message)]
            continue
        start = time.perf_counter()
        runner.run_step(plan)
        if i >= 4:  # after the warm-up and the capture
            seconds.append(time.perf_counter() - start)
    mode = ("graph" if graphed else "eager") + (", half sampled" if drawn else "")
    return {"batch": num_seqs, "mode": mode, "median_ms": 1e3 * statistics.median(seconds),
            "min_ms": 1e3 * min(seconds), "host_syncs_last_step": len(syncs), "sync_messages": sorted(set(syncs)),
            "graph_counts": None if graphs is None else [graphs.num_eager, graphs.num_captures, graphs.num_replays]}


def _synchronize(args) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    config, model = build(args)
    print(f"model built in {time.perf_counter() - start:.1f}s: {args.layers} layers, attention {args.attention}",
          flush=True)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    checks, timings = [], []
    can_graph = args.attention != "torch" or args.device == "cpu"
    for num_seqs in batch_sizes:
        if can_graph:
            checks.append(check_correctness(model, config, num_seqs, args))
            print(json.dumps(checks[-1]), flush=True)
        for graphed in ((False, True) if can_graph else (False,)):
            timings.append(time_steps(model, config, num_seqs, args, graphed))
            print(json.dumps(timings[-1]), flush=True)
        if can_graph and num_seqs == 64:
            for graphed in (False, True):
                timings.append(time_steps(model, config, num_seqs, args, graphed, drawn=True))
                print(json.dumps(timings[-1]), flush=True)
    ok = all(r["ok"] and r["hits_total_ok"] for c in checks for r in c["rounds"])
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    env = {"torch": torch.__version__, "gpu": gpu, "cuda": torch.version.cuda}
    result = {"command": " ".join(sys.argv), "env": env, "args": vars(args), "checks": checks,
              "timings": timings, "passed": ok, "wall_s": time.perf_counter() - start}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_graph_check.json").write_text(json.dumps(result, indent=1))
    (out / "decode_graph_check.md").write_text(markdown(result))
    print(markdown(result), flush=True)
    return 0 if ok else 1


def markdown(result: dict) -> str:
    args = result["args"]
    lines = [f"# Decode steps: eager vs CUDA graphs ({result['env']['gpu']})", "",
             f"Command: `{result['command']}`", "", f"Environment: {json.dumps(result['env'])}", "",
             f"Model: Qwen3-30B-A3B shape, {args['layers']} layers, bf16, random weights; attention "
             f"`{args['attention']}`; contexts 64..{args['max_context']} cached tokens; KV pool of noise.", "",
             "## Correctness (same inputs, eager forward vs graph runner)", "",
             "| batch | bucket | round | max abs logit diff | largest logit | argmax agree | hit total exact "
             "| hits equal | ok |",
             "|---:|---:|---|---:|---:|---:|---|---|---|"]
    for c in result["checks"]:
        for r in c["rounds"]:
            lines.append(f"| {c['batch']} | {c['bucket']} | {r['mode']} | {r['max_abs_diff']:.4g} | "
                         f"{r['max_abs_logit']:.4g} | {100 * r['argmax_agree']:.1f}% | {r['hits_total_ok']} | "
                         f"{r['hits_equal']} | {r['ok']} |")
    lines += ["", "## StepRunner.run_step, decode (wall time: plan in, tokens on the host out)", "",
              "| batch | mode | median ms | min ms | host syncs in one step |", "|---:|---|---:|---:|---:|"]
    for t in result["timings"]:
        lines.append(f"| {t['batch']} | {t['mode']} | {t['median_ms']:.2f} | {t['min_ms']:.2f} | "
                     f"{t['host_syncs_last_step']} |")
    lines += ["", "Sync warnings seen: " + json.dumps(sorted({m for t in result["timings"] for m in t["sync_messages"]})),
              "", f"**{'PASSED' if result['passed'] else 'FAILED'}**; wall time {result['wall_s']:.0f} s", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
