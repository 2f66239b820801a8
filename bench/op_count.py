"""Ops per decode step: aten ops per layer on the CPU, CUDA kernels per step on a GPU (issue 8).

    python -m bench.op_count                       # CPU: the tiny preset, eager torch path
    python -m bench.op_count --device cuda --layers 48 --batch-sizes 1,64,256 --out DIR
    python -m bench.op_count --device cuda --precision 1,4,48 --out DIR

CPU: one decode step of the `tiny` preset under torch.profiler, counting the
top-level aten ops (ops not called by another op) per layer.
CUDA: Qwen3-30B-A3B's shape cut to --layers layers, random bf16 weights, the
triton attention; per batch size one eager decode step (forward_at_capacity)
with services/model/triton_fused.py off (the torch code) and on, counting the
device activities (kernels, memcpys, memsets) and summing their durations,
and comparing the two paths' logits on the same inputs (largest difference
against the largest logit, argmax agreement).
--precision DEPTHS (CUDA): is the fused path's distance from the torch path
bf16 rounding or a bug? The model cut to each depth, 16 sequences decoded as
one batch of 16 and as 16 batches of 1, through the fused path and the torch
path in bf16 and through the torch path in fp32 with the same weights (the
bf16 ones upcast) and the same KV cache: each bf16 path's largest logit
difference from fp32 and argmax agreement with it. Writes precision_cuda.json.
"""

import argparse
import collections
import copy
import dataclasses
import gc
import json
import pathlib
import sys

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.kv_pool import KVPool  # noqa: E402
from services.model.batch import SeqInput, build_forward_batch  # noqa: E402
from services.model.qwen3_moe import Qwen3MoeModel  # noqa: E402

BLOCK_SIZE = 16


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default=None, help="default: tiny on the CPU, qwen3-30b-a3b on CUDA")
    p.add_argument("--layers", type=int, default=None, help="default: the preset's")
    p.add_argument("--batch-sizes", default="1")
    p.add_argument("--context", type=int, default=256, help="cached tokens of every sequence")
    p.add_argument("--moe-max-tokens", type=int, default=64, help="triton_fused.MOE_MAX_TOKENS while measuring")
    p.add_argument("--precision", default=None, help="CUDA: depths for the fp32 comparison instead (e.g. 1,4,48)")
    p.add_argument("--out", default=None, help="write op_count.json here")
    return p.parse_args(argv)


def build(args):
    from services.model.random_weights import RandomWeights, preset

    name = args.preset or ("tiny" if args.device == "cpu" else "qwen3-30b-a3b")
    config = preset(name)
    if args.layers:
        config = dataclasses.replace(config, num_hidden_layers=args.layers)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    weights = RandomWeights(config, range(config.num_experts), 0, dtype=dtype, device=args.device)
    model = Qwen3MoeModel(config, weights, expert_ids=range(config.num_experts), dtype=dtype, device=args.device,
                          attention="torch" if args.device == "cpu" else "triton")
    return name, config, model, dtype


def decode_batch(config, num_seqs: int, args):
    per_seq = -(-(args.context + 1) // BLOCK_SIZE)
    kv = KVPool.for_model(config, num_seqs * per_seq, BLOCK_SIZE, torch.float32 if args.device == "cpu"
                          else torch.bfloat16, args.device)
    g = torch.Generator(device=args.device).manual_seed(0)
    kv.k_cache.normal_(generator=g)
    kv.v_cache.normal_(generator=g)
    seqs = [SeqInput(i, [(7 * i + 3) % config.vocab_size], args.context, list(range(i * per_seq, (i + 1) * per_seq)),
                     True) for i in range(num_seqs)]
    return build_forward_batch(seqs, BLOCK_SIZE, args.device), kv


def cpu_counts(config, model, args) -> dict:
    batch, kv = decode_batch(config, 1, args)
    capacity = model.dispatch_capacity(1)
    model.forward_at_capacity(batch, kv, capacity)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model.forward_at_capacity(batch, kv, capacity)
    ops = collections.Counter(e.name for e in prof.events() if e.cpu_parent is None)
    layers = config.num_hidden_layers
    return {"ops_per_step": sum(ops.values()), "layers": layers, "ops_per_layer": sum(ops.values()) / layers,
            "top": {name: round(n / layers, 2) for name, n in ops.most_common(20)}}


def cuda_step(model, config, num_seqs: int, args, fused: bool, fused_moe: bool = True) -> tuple[dict, torch.Tensor]:
    from services.model import triton_fused

    triton_fused.ENABLED = fused
    triton_fused.MOE_MAX_TOKENS = args.moe_max_tokens if fused_moe else 0
    batch, kv = decode_batch(config, num_seqs, args)
    capacity = model.dispatch_capacity(num_seqs)
    for _ in range(2):  # compile and warm up; the same inputs rewrite the same KV slots
        logits_SV = model.forward_at_capacity(batch, kv, capacity)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        model.forward_at_capacity(batch, kv, capacity)
        torch.cuda.synchronize()
    device_events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    names, times = collections.Counter(), collections.Counter()
    for e in device_events:
        names[e.name[:60]] += 1
        times[e.name[:60]] += e.device_time / 1e3
    return {"batch": num_seqs, "fused": fused, "fused_moe": fused and fused_moe and num_seqs <= args.moe_max_tokens,
            "device_ops_per_step": len(device_events),
            "device_ops_per_layer": len(device_events) / config.num_hidden_layers,
            "device_ms_per_step": sum(e.device_time for e in device_events) / 1e3,
            "top_ms": {name: [names[name], round(ms, 3)] for name, ms in times.most_common(12)}}, logits_SV


PRECISION_SEQS = 16


def precision_logits(model, config, args, paths: dict) -> dict:
    """{(path, depth, batch): [16, V] fp32 logits on the host} for the model cut to each depth;
    `paths` maps each path's name to the triton_fused.ENABLED it runs with."""
    from services.model import triton_fused

    per_seq = -(-(args.context + 1) // BLOCK_SIZE)
    kv = KVPool.for_model(config, PRECISION_SEQS * per_seq, BLOCK_SIZE, model.dtype, args.device)
    g = torch.Generator(device=args.device).manual_seed(0)
    for cache in (kv.k_cache, kv.v_cache):  # fp32 noise rounded to bf16: the same values in either dtype
        cache.copy_(torch.randn(cache.shape, generator=g, device=args.device).to(torch.bfloat16))
    seqs = [SeqInput(i, [(7 * i + 3) % config.vocab_size], args.context,
                     list(range(i * per_seq, (i + 1) * per_seq)), True) for i in range(PRECISION_SEQS)]
    out = {}
    for depth in (int(d) for d in args.precision.split(",")):
        cut = copy.copy(model)
        cut.layers = model.layers[:depth]
        for path, enabled in paths.items():
            triton_fused.ENABLED = enabled
            batched = cut.forward_at_capacity(build_forward_batch(seqs, BLOCK_SIZE, args.device), kv,
                                              cut.dispatch_capacity(PRECISION_SEQS))
            singles = torch.cat([cut.forward_at_capacity(build_forward_batch([seq], BLOCK_SIZE, args.device), kv,
                                                         cut.dispatch_capacity(1)) for seq in seqs])
            out[path, depth, PRECISION_SEQS], out[path, depth, 1] = batched.cpu(), singles.cpu()
    triton_fused.ENABLED = True
    return out


def precision_check(args) -> dict:
    """fused-bf16 and torch-bf16 against fp32 (see the module doc); one model in memory at a time."""
    from services.model import triton_fused
    from services.model.random_weights import RandomWeights, preset

    config = dataclasses.replace(preset(args.preset or "qwen3-30b-a3b"), num_hidden_layers=max(
        int(d) for d in args.precision.split(",")))
    assert triton_fused.MOE_MAX_TOKENS >= PRECISION_SEQS, "both batches must take the fused MoE"
    logits = {}
    for dtype, paths in ((torch.bfloat16, {"fused_bf16": True, "torch_bf16": False}),
                         (torch.float32, {"torch_fp32": False})):
        weights = RandomWeights(config, range(config.num_experts), 0, dtype=torch.bfloat16, device=args.device)
        model = Qwen3MoeModel(config, weights, expert_ids=range(config.num_experts), dtype=dtype,
                              device=args.device, attention="triton" if args.device == "cuda" else "torch")
        logits.update(precision_logits(model, config, args, paths))
        del model
        gc.collect()
        torch.cuda.empty_cache()
    rows = []
    for (path, depth, batch), logits_SV in logits.items():
        if path == "torch_fp32":
            continue
        ref_SV = logits["torch_fp32", depth, batch]
        other_SV = logits["torch_bf16" if path == "fused_bf16" else "fused_bf16", depth, batch]
        rows.append({"path": path, "layers": depth, "batch": batch,
                     "max_abs_diff_vs_fp32": (logits_SV - ref_SV).abs().max().item(),
                     "argmax_agree_vs_fp32": (logits_SV.argmax(-1) == ref_SV.argmax(-1)).float().mean().item(),
                     "max_abs_diff_vs_other_bf16": (logits_SV - other_SV).abs().max().item(),
                     "argmax_agree_vs_other_bf16": (logits_SV.argmax(-1) == other_SV.argmax(-1)).float().mean().item(),
                     "max_abs_logit_fp32": ref_SV.abs().max().item()})
        print(json.dumps(rows[-1]), flush=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    return {"device": device, "context": args.context, "seqs": PRECISION_SEQS, "rows": rows}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.precision:
        result = precision_check(args)
        if args.out:
            pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
            (pathlib.Path(args.out) / "precision_cuda.json").write_text(json.dumps(result, indent=1))
        return 0
    name, config, model, dtype = build(args)
    result = {"preset": name, "device": args.device, "layers": config.num_hidden_layers}
    if args.device == "cpu":
        result["cpu_eager"] = cpu_counts(config, model, args)
    else:
        result["gpu"] = torch.cuda.get_device_name()
        result["steps"], result["fused_vs_torch"] = [], []
        for num_seqs in (int(b) for b in args.batch_sizes.split(",")):
            before, logits_torch = cuda_step(model, config, num_seqs, args, fused=False)
            after, logits_fused = cuda_step(model, config, num_seqs, args, fused=True)
            result["steps"] += [before, after]
            if num_seqs <= args.moe_max_tokens:  # the same without the fused MoE: where it pays off
                result["steps"].append(cuda_step(model, config, num_seqs, args, fused=True, fused_moe=False)[0])
            result["fused_vs_torch"].append({
                "batch": num_seqs, "max_abs_diff": (logits_fused - logits_torch).abs().max().item(),
                "max_abs_logit": logits_torch.abs().max().item(),
                "argmax_agree": (logits_fused.argmax(-1) == logits_torch.argmax(-1)).float().mean().item()})
            print(json.dumps(result["fused_vs_torch"][-1]), flush=True)
    print(json.dumps(result, indent=1) if args.device == "cpu" else json.dumps(
        [{k: v for k, v in step.items() if k != "top_ms"} for step in result.get("steps", [])]))
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"op_count_{args.device}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
