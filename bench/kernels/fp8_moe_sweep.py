"""The block-FP8 grouped MoE against bf16 at Qwen3-30B-A3B's shapes, with a sweep of its tiles (issue 29).

    python -m bench.kernels.fp8_moe_sweep                 # 64, 256 and 4,096 tokens, about a minute on an H200
    python -m bench.kernels.fp8_moe_sweep --tokens 256
    python -m bench.kernels.fp8_moe_sweep --tokens 1      # batch 1: the one-row GEMVs, plain and pipelined

quant_fp8_moe.grouped_moe (FP8 tensor cores: activations quantized per token and 128-channel
group) takes quant_fp8_moe.default_config's tiles (this sweep's fastest); each line here is one
MoEConfig: rows per block, then gate_up's and down's (columns, warps, stages) (the reduction
steps one 128 block: the FP8 scales' block), its time per call (one CUDA graph over --copies
weight copies, quant_kernels.time_us), its time over bf16's, and its largest error relative to
the largest output against bf16 (the quantization's error included). The first line of each
size is the default, the second the default in the other launch order (MoEConfig.tiles_first);
the fastest is marked; a tile that does not fit says so.

--tokens 1 instead times batch 1's weight-only GEMVs (quant_fp8.fp8_gemv_rows): q|k|v and o at one
row and the one-token MoE (gate_route, then quant_fp8_moe.one_token_experts), each with today's
plain loop (the default) and pipelined (quant_fp8.GEMV_PIPELINED: cp.async as deep as the tiles'
stages), and other tiles of the plain loop: fewer, longer steps (one step a row: every load of a
program in flight at once, as bf16's one-token gate_up reads its rows), fewer or more rows a program;
bf16 (gemv.linear, moe_small) beside.
"""

import argparse
import dataclasses
import sys
from unittest import mock

import torch

from bench.kernels.quant_kernels import (DENSE, HIDDEN, TOP_K, _hits, _randn, dense_copies, moe_bf16, moe_copies,
                                         time_us)
from services.model.kernels import gemv, moe_grouped, quant_fp8, quant_fp8_moe, routing
from services.model.kernels.moe_gemm import GemmBlocks, MoEConfig

# (block_m, gate_up (block_n, warps, stages), down (block_n, warps, stages))
VARIANTS = [(16, (128, 4, 3), (128, 4, 4)), (32, (128, 4, 3), (64, 4, 4)), (32, (64, 4, 3), (64, 4, 3)),
            (64, (128, 4, 3), (128, 4, 3)), (64, (128, 8, 3), (128, 8, 3)), (32, (128, 8, 3), (128, 8, 3)),
            (128, (128, 8, 3), (128, 8, 3)), (128, (128, 8, 4), (256, 8, 4)), (64, (64, 4, 4), (64, 4, 4)),
            (16, (64, 4, 4), (64, 4, 4)),
            # Prefill sizes: two warpgroups over 128 rows at 64 columns (each group's gate and up
            # accumulators and their per-step products within the registers), deeper and shallower pipelines.
            (128, (64, 8, 3), (64, 8, 3)), (128, (64, 8, 4), (64, 8, 4)), (128, (64, 8, 4), (128, 8, 3)),
            (64, (64, 4, 3), (64, 4, 3)), (64, (64, 4, 5), (64, 4, 5)), (64, (64, 4, 4), (128, 4, 3)),
            (64, (128, 8, 4), (128, 8, 4))]


def _config(variant, tiles_first: bool) -> MoEConfig:
    block_m, (gn, gw, gs), (dn, dw, ds) = variant
    return MoEConfig(block_m, GemmBlocks(gn, 128, gw, gs), GemmBlocks(dn, 128, dw, ds), tiles_first)


def _label(config: MoEConfig) -> str:
    g, d = config.gate_up, config.down
    return f"bm{config.block_m} gu n{g.block_n} w{g.num_warps} st{g.num_stages} | down n{d.block_n} " \
           f"w{d.num_warps} st{d.num_stages} | {'tiles' if config.tiles_first else 'blocks'} first"


def sweep(num_tokens: int, copies: list[dict], reps: int) -> None:
    x = _randn(num_tokens, HIDDEN, scale=1.0, seed=300 + num_tokens).bfloat16()

    def bf16(x, c):
        return moe_grouped.grouped_moe(x, c["gate"], *c["bf16"], TOP_K, True, _hits())

    bf16_us, y_bf16 = time_us(bf16, x, copies, reps), bf16(x, copies[0])
    default = quant_fp8_moe.default_config(num_tokens)
    configs = [default, dataclasses.replace(default, tiles_first=not default.tiles_first)]
    configs += [c for c in (_config(v, default.tiles_first) for v in VARIANTS) if c != default]
    rows = []
    for i, config in enumerate(configs):
        def run(x, c, config=config):
            return quant_fp8_moe.grouped_moe(x, c["gate"], *c["fp8"], TOP_K, True, _hits(), config)
        label = ("default " if i == 0 else "") + _label(config)
        try:
            y = run(x, copies[0])
            us = time_us(run, x, copies, reps)
        except Exception as error:  # noqa: BLE001 - a tile that does not fit or compile is a result
            print(f"M={num_tokens:<5} {label:<72} failed: {str(error).splitlines()[0][:100]}", flush=True)
            continue
        err = ((y.float() - y_bf16.float()).abs().max() / y_bf16.float().abs().max()).item()
        rows.append((label, us, err))
    best = min(rows, key=lambda r: r[1])
    print(f"M={num_tokens:<5} {'bf16':<72} {bf16_us:9.1f} us", flush=True)
    for label, us, err in rows:
        mark = "  <- fastest" if (label, us) == best[:2] else ""
        print(f"M={num_tokens:<5} {label:<72} {us:9.1f} us  x{us / bf16_us:4.2f} of bf16  err {err:.2e}{mark}",
              flush=True)


def _one_row_lines(case: str, bf16, variants: dict, x, copies: list, reps: int) -> None:
    """Times bf16 and each (label: (pipelined, fn(x, copy))) of variants; prints each against bf16 with its error."""
    bf16_us, y_bf16 = time_us(bf16, x, copies, reps), bf16(x, copies[0])
    print(f"{case:<8} {'bf16':<44} {bf16_us:8.1f} us", flush=True)
    for label, (pipelined, fn) in variants.items():
        with mock.patch.object(quant_fp8, "GEMV_PIPELINED", pipelined):
            us, y = time_us(fn, x, copies, reps), fn(x, copies[0])
        err = ((y.float() - y_bf16.float()).abs().max() / y_bf16.float().abs().max()).item()
        print(f"{case:<8} {label:<44} {us:8.1f} us  x{us / bf16_us:4.2f} of bf16  err vs bf16 {err:.2e}", flush=True)


# Other plain-loop tiles at one row. Dense: (label, block_n, steps a row, warps); the step is K / steps.
ONE_ROW_DENSE = [("8 rows, 4 steps", 8, 4, 4), ("8 rows, 4 steps, 8 warps", 8, 4, 8), ("4 rows, 4 steps", 4, 4, 4),
                 ("8 rows, 8 steps", 8, 8, 4), ("16 rows, 2 steps", 16, 2, 4), ("4 rows, 2 steps", 4, 2, 4),
                 ("4 rows, 2 steps, 8 warps", 4, 2, 8), ("2 rows, 2 steps", 2, 2, 4), ("8 rows, 2 steps", 8, 2, 4)]
# The one-token MoE: (label, MoeTiles fields replaced in ONE_TOKEN_TILES).
ONE_TOKEN_VARIANTS = [("gate_up 2 warps", dict(gate_up_warps=2)), ("gate_up 8 warps", dict(gate_up_warps=8)),
                      ("down 2 warps", dict(down_warps=2)), ("down 8 warps", dict(down_warps=8)),
                      ("down 128 a step", dict(down_f=128)), ("down 8 rows", dict(down_o=8)),
                      ("gate_up 2 rows", dict(gate_up_f=2)), ("gate_up 8 rows, 8 warps", dict(gate_up_f=8, gate_up_warps=8)),
                      ("gate_up 1,024 a step", dict(gate_up_d=1024))]


def one_row(copies: int, reps: int) -> None:
    """Batch 1's FP8 GEMVs, plain (default) and pipelined (quant_fp8.GEMV_PIPELINED), and other tiles."""
    for name, (n, k) in DENSE.items():
        dense = dense_copies(n, k, 12)
        x = _randn(1, k, scale=1.0, seed=101).bfloat16()

        def fp8(tiles=None):
            return lambda x, c: quant_fp8.linear(x, *c["fp8"], kernel="weight-only", tiles=tiles)
        variants = {"default (plain loop)": (False, fp8()), "pipelined": (True, fp8())}
        for label, block_n, steps, warps in ONE_ROW_DENSE:
            variants[label] = (False, fp8(quant_fp8.LinearTiles(1, block_n, k // steps, 1, warps, 1)))
        _one_row_lines(f"{name} M=1", lambda x, c: gemv.linear(x, c["bf16"]), variants, x, dense, reps)
        del dense
    moe = moe_copies(copies)

    def experts(tiles):
        def run(x, c):
            ids, weights = routing.gate_route(x, c["gate"], TOP_K, True, _hits())[:2]
            return quant_fp8_moe.one_token_experts(x, ids, weights, *c["fp8"], tiles)
        return run
    variants = {"default (plain loop)": (False, experts(quant_fp8_moe.ONE_TOKEN_TILES)),
                "pipelined": (True, experts(quant_fp8_moe.ONE_TOKEN_TILES)),
                "pipelined, gate_up_f 8": (True, experts(dataclasses.replace(quant_fp8_moe.ONE_TOKEN_TILES,
                                                                               gate_up_f=8)))}
    for label, fields in ONE_TOKEN_VARIANTS:
        variants[label] = (False, experts(dataclasses.replace(quant_fp8_moe.ONE_TOKEN_TILES, **fields)))
    _one_row_lines("moe M=1", moe_bf16, variants, _randn(1, HIDDEN, scale=1.0, seed=201).bfloat16(), moe, reps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="64,256,4096")
    p.add_argument("--copies", type=int, default=4)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)
    print(torch.cuda.get_device_name(), flush=True)
    tokens = [int(t) for t in args.tokens.split(",")]
    if 1 in tokens:
        one_row(args.copies, args.reps)
    if any(t > 1 for t in tokens):
        copies = moe_copies(args.copies)
        for num_tokens in (t for t in tokens if t > 1):
            sweep(num_tokens, copies, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
