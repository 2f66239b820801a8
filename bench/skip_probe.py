"""Upper bounds of fusing the decode step's small kernels: the step with them skipped.

    python -m bench.skip_probe --out DIR [--batch-sizes 1,8] [--rounds 3]

What would fusing a small kernel into its neighbour save at most? This replays
the 48-layer decode step (bench/decode_variants.py's model, workload and
timing: random Qwen3-30B-A3B weights, contexts of 1,024-2,048 tokens, CUDA
graph replays) with some small kernels not launched at all:

- no_qkv_rot: triton_fused.qkv_norm_rotary replaced by views of the q|k|v
  projection (no per-head norm, no rotation);
- no_norms: triton_fused.add_rms_norm_ (both RMSNorms of each layer, with
  their residual adds) replaced by a fixed tensor of noise (the residual
  stream stays as the embedding: sane values, so the routing stays in range);
- no_norms_reduce: that and the decode attention's split merge
  (_decode_reduce_kernel) not launched (its output is then whatever memory
  held, which only the skipped norms would have read);
- no_all3: all three.

The logits are meaningless in every variant but base: timing only. A fused
kernel still does the skipped work, so a fusion saves less than these
differences. The variants run in turn, --rounds times; medians of the rounds.
Writes skip_probe.json and .md to --out.
"""

import argparse
import json
import pathlib
import shlex
import statistics
import sys

import torch

from bench import decode_variants
from bench.decode_graph_check import build


class _NoLaunch:
    """Stands in for a Triton kernel: kernel[grid](...) does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _qkv_views(qkv_TX, q_norm_K, k_norm_K, cos_TK, sin_TK, num_heads, num_kv_heads, eps):
    """qkv_norm_rotary's outputs as reshaped slices of its input (no kernel at one token)."""
    num_tokens, head_dim = qkv_TX.shape[0], q_norm_K.shape[0]
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    return (qkv_TX[:, :q_end].reshape(num_tokens, num_heads, head_dim),
            qkv_TX[:, q_end:k_end].reshape(num_tokens, num_kv_heads, head_dim),
            qkv_TX[:, k_end:].reshape(num_tokens, num_kv_heads, head_dim))


def variants(hidden: int, device: torch.device) -> dict[str, dict]:
    """name -> {(module, attribute): replacement}."""
    from services.model import triton_attention, triton_fused  # triton: CUDA only

    noise_TD = torch.randn(decode_variants.BUCKETS[-1], hidden, dtype=torch.bfloat16, device=device)
    no_norm = {(triton_fused, "add_rms_norm_"): lambda x_TD, h_TD, weight_D, eps: noise_TD[:x_TD.shape[0]]}
    no_reduce = {(triton_attention, "_decode_reduce_kernel"): _NoLaunch()}
    no_qkv_rot = {(triton_fused, "qkv_norm_rotary"): _qkv_views}
    return {"base": {}, "no_qkv_rot": no_qkv_rot, "no_norms": no_norm, "no_norms_reduce": no_norm | no_reduce,
            "no_all3": no_norm | no_reduce | no_qkv_rot}


def timed(model, config, kv, workload, device, patch: dict) -> float:
    """The step's median graph replay ms under the patch (put back after)."""
    saved = {target: getattr(*target) for target in patch}
    try:
        for (module, attr), value in patch.items():
            setattr(module, attr, value)
        timings, _ = decode_variants.run_variant(model, config, kv, workload, device)
    finally:
        for (module, attr), value in saved.items():
            setattr(module, attr, value)
    decode_variants._release(device)
    return timings["replay_ms"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args(argv)
    model_args = decode_variants.parse_args(["--out", args.out, "--steps", str(args.steps)])
    config, model = build(model_args)
    device = torch.device("cuda")
    patches = variants(config.hidden_size, device)
    result = {"command": "python -m bench.skip_probe " + shlex.join(sys.argv[1:] if argv is None else argv),
              "gpu": torch.cuda.get_device_name(), "batches": {}}
    for batch in map(int, args.batch_sizes.split(",")):
        workload = decode_variants.Workload.draw(batch, decode_variants.parse_context(model_args.context),
                                                 decode_variants.WARMUP_STEPS + args.steps, model_args.seed)
        kv = decode_variants.noise_pool(config, workload.num_blocks, device)
        rounds = {name: [] for name in patches}
        for _ in range(args.rounds):
            for name, patch in patches.items():
                rounds[name].append(timed(model, config, kv, workload, device, patch))
        result["batches"][batch] = {name: {"replay_ms": statistics.median(ms), "by_round": ms}
                                    for name, ms in rounds.items()}
        print(json.dumps({batch: result["batches"][batch]}), flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "skip_probe.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# The decode step with small kernels skipped ({result['gpu']})", "",
             f"Command: `{result['command']}`", "", "Graph replay ms (median of the rounds; timing only: the "
             "variants' logits are meaningless).", "",
             "| batch | variant | replay ms | by round | saved vs base ms |", "|---:|---|---:|---|---:|"]
    for batch, rows in result["batches"].items():
        base = rows["base"]["replay_ms"]
        lines += [f"| {batch} | {name} | {row['replay_ms']:.3f} | "
                  f"{' / '.join(f'{ms:.3f}' for ms in row['by_round'])} | {base - row['replay_ms']:.3f} |"
                  for name, row in rows.items()]
    (out / "skip_probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
