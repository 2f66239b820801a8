"""The block-FP8 grouped MoE against bf16 at Qwen3-30B-A3B's shapes, with a sweep of its tiles (issue 29).

    python -m bench.kernels.fp8_moe_sweep                 # 64, 256 and 4,096 tokens, about a minute on an H200
    python -m bench.kernels.fp8_moe_sweep --tokens 256

quant_fp8_moe.grouped_moe (FP8 tensor cores: activations quantized per token and 128-channel
group) takes moe_gemm.default_config's tiles, which were swept for bf16; each line here is one
MoEConfig: rows per block, then gate_up's and down's (columns, warps, stages) (the reduction
steps one 128 block: the FP8 scales' block), its time per call (one CUDA graph over --copies
weight copies, quant_kernels.time_us), its time over bf16's, and its largest error relative to
the largest output against bf16 (the quantization's error included). The first line of each
size is the default; the fastest is marked; a tile that does not fit says so.
"""

import argparse
import sys

import torch

from bench.kernels.quant_kernels import HIDDEN, TOP_K, _hits, _randn, moe_copies, time_us
from services.model.kernels import moe_gemm, moe_grouped, quant_fp8_moe
from services.model.kernels.moe_gemm import GemmBlocks, MoEConfig

# (block_m, gate_up (block_n, warps, stages), down (block_n, warps, stages))
VARIANTS = [(16, (128, 4, 3), (128, 4, 4)), (32, (128, 4, 3), (64, 4, 4)), (32, (64, 4, 3), (64, 4, 3)),
            (64, (128, 4, 3), (128, 4, 3)), (64, (128, 8, 3), (128, 8, 3)), (32, (128, 8, 3), (128, 8, 3)),
            (128, (128, 8, 3), (128, 8, 3)), (128, (128, 8, 4), (256, 8, 4)), (64, (64, 4, 4), (64, 4, 4)),
            (16, (64, 4, 4), (64, 4, 4))]


def _config(variant, tiles_first: bool) -> MoEConfig:
    block_m, (gn, gw, gs), (dn, dw, ds) = variant
    return MoEConfig(block_m, GemmBlocks(gn, 128, gw, gs), GemmBlocks(dn, 128, dw, ds), tiles_first)


def _label(config: MoEConfig) -> str:
    g, d = config.gate_up, config.down
    return f"bm{config.block_m} gu n{g.block_n} w{g.num_warps} st{g.num_stages} | down n{d.block_n} " \
           f"w{d.num_warps} st{d.num_stages}"


def sweep(num_tokens: int, copies: list[dict], reps: int) -> None:
    x = _randn(num_tokens, HIDDEN, scale=1.0, seed=300 + num_tokens).bfloat16()

    def bf16(x, c):
        return moe_grouped.grouped_moe(x, c["gate"], *c["bf16"], TOP_K, True, _hits())

    bf16_us, y_bf16 = time_us(bf16, x, copies, reps), bf16(x, copies[0])
    default = moe_gemm.default_config(num_tokens)
    configs = [default] + [c for c in (_config(v, default.tiles_first) for v in VARIANTS) if c != default]
    rows = []
    for i, config in enumerate(configs):
        def run(x, c, config=config):
            return quant_fp8_moe.grouped_moe(x, c["gate"], *c["fp8"], TOP_K, True, _hits(), config)
        label = ("default " if i == 0 else "") + _label(config)
        try:
            y = run(x, copies[0])
            us = time_us(run, x, copies, reps)
        except Exception as error:  # noqa: BLE001 - a tile that does not fit or compile is a result
            print(f"M={num_tokens:<5} {label:<58} failed: {str(error).splitlines()[0][:100]}", flush=True)
            continue
        err = ((y.float() - y_bf16.float()).abs().max() / y_bf16.float().abs().max()).item()
        rows.append((label, us, err))
    best = min(rows, key=lambda r: r[1])
    print(f"M={num_tokens:<5} {'bf16':<58} {bf16_us:9.1f} us", flush=True)
    for label, us, err in rows:
        mark = "  <- fastest" if (label, us) == best[:2] else ""
        print(f"M={num_tokens:<5} {label:<58} {us:9.1f} us  x{us / bf16_us:4.2f} of bf16  err {err:.2e}{mark}",
              flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="64,256,4096")
    p.add_argument("--copies", type=int, default=4)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)
    print(torch.cuda.get_device_name(), flush=True)
    copies = moe_copies(args.copies)
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        sweep(num_tokens, copies, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
