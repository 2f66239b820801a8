"""AWQ 4-bit against bf16 at Qwen3-30B-A3B's shapes, with a small sweep of the AWQ tiles (issue 29).

    python -m bench.kernels.awq_sweep                  # every case, about 2 minutes on an H200
    python -m bench.kernels.awq_sweep --cases moe1     # one of qkv, o, moe1, moe64

Cases: the dense q|k|v and o linears at 1 and 64 rows (bf16: gemv.linear / F.linear), the
one-token MoE (bf16: moe_small.fused_moe; AWQ: quant_awq_moe.one_token_experts after
routing.gate_route) and the grouped MoE at 64 tokens (bf16: moe_grouped.grouped_moe; AWQ:
quant_awq_moe.grouped_moe). Each line: the variant, its time per call (one CUDA graph over
--copies weight copies, quant_kernels.time_us), its time over bf16's, and its largest error
relative to the largest output, against bf16 (the quantization's error included) and against
fp32 on the dequantized weights (the kernel's own error: ~1e-2 of bf16 rounding at most).
The first AWQ line of each case is the default; the fastest is marked. Lines ending "groups" run
quant_awq_gemv.awq_gemv_groups (the one-row and one-token GEMV with the zeros and scales out of the
inner product, the default), whose splits one group deep take awq_gemv_one_group.
"""

import argparse
import sys
from unittest import mock

import torch

from bench.kernels.quant_kernels import (DENSE, HIDDEN, TOP_K, _hits, _randn, dense_copies, moe_bf16, moe_copies,
                                         moe_reference, time_us)
from services.model.kernels import gemv, moe_grouped, quant_awq, quant_awq_moe, routing
from services.model.kernels import quant_ref as ref
from services.model.kernels.moe_gemm import GemmBlocks, MoEConfig

# (block_n, block_k, split_k, warps) of the one-row GEMV; the GEMM rows: (block_m, block_n, block_k, split_k, warps).
GEMV_TILES = [(64, 64, 1, 4), (32, 64, 1, 4), (64, 64, 3, 4), (64, 64, 12, 4), (64, 128, 6, 8), (32, 64, 4, 4),
              (64, 64, 32, 4)]
GEMM_TILES = [(64, 64, 64, 1, 4), (64, 128, 64, 1, 4), (64, 64, 128, 1, 4)]
# (gate_up_f, gate_up_d, gate_up_splits, gate_up_warps, down_o, down_f, down_splits, down_warps) of the
# one-token kernels.
ONE_TOKEN = [(64, 64, 1, 4, 64, 64, 1, 4), (64, 64, 6, 4, 64, 64, 4, 4), (32, 64, 2, 4, 32, 64, 2, 4),
             (64, 128, 3, 8, 64, 128, 2, 8), (128, 64, 4, 8, 128, 64, 3, 8), (32, 64, 1, 4, 32, 64, 1, 4)]
GROUPED = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 4), (128, 128, 4, 3)]
# The grouped GEMV (quant_awq_gemv.awq_gemv_groups; "groups" in the label): (block_n, rows a slice, split_k, warps)
# at one row besides its default tiles, and the one-token tiles besides quant_awq_moe.GROUPED_TILES.
GROUPS_GEMV_TILES = [(256, 16, 8, 4), (256, 16, 16, 4), (128, 16, 8, 2), (128, 16, 16, 4), (128, 16, 32, 2),
                     (512, 8, 8, 8)]
GROUPS_ONE_TOKEN = [(256, 16, 8, 2, 512, 8, 6, 4), (128, 16, 16, 2, 512, 8, 6, 4), (256, 16, 16, 2, 512, 8, 6, 4),
                    (128, 16, 8, 2, 256, 8, 6, 2), (128, 32, 8, 4, 128, 32, 6, 4)]


def _errors(y, bf16, dequant) -> str:
    def rel(a, b):
        return (a.float() - b.float()).abs().max().item() / b.float().abs().max().item()
    return f"err vs bf16 {rel(y, bf16):.2e}, vs dequantized fp32 {rel(y, dequant):.2e}"


def _report(case: str, rows: list[tuple[str, float, str]], bf16_us: float) -> None:
    best = min(rows, key=lambda r: r[1])
    print(f"{case:<10} {'bf16':<44} {bf16_us:8.1f} us", flush=True)
    for name, us, errors in rows:
        mark = "  <- fastest" if (name, us) == best[:2] else ""
        print(f"{case:<10} {name:<44} {us:8.1f} us  x{us / bf16_us:4.2f} of bf16  {errors}{mark}", flush=True)


def dense(name: str, num_rows: int, copies: list[dict], reps: int) -> None:
    n, k = DENSE[name]
    x = _randn(num_rows, k, scale=1.0, seed=100 + num_rows).bfloat16()
    c0 = copies[0]
    bf16_us = time_us(lambda x, c: gemv.linear(x, c["bf16"]), x, copies, reps)
    y_bf16 = gemv.linear(x, c0["bf16"])
    dequant = x.float() @ c0["ref_awq"].T
    default = quant_awq.default_tiles(num_rows, n, k)
    if num_rows == 1:
        tiles = [quant_awq.AwqTiles(1, bn, bk, split, warps, 1) for bn, bk, split, warps in GEMV_TILES]
        with mock.patch.object(quant_awq, "ONE_ROW_GEMV", "groups"):
            tiles.append(quant_awq.default_tiles(num_rows, n, k))
        tiles += [quant_awq.AwqTiles(1, bn, rows, split, warps, 1, "groups")
                  for bn, rows, split, warps in GROUPS_GEMV_TILES]
    else:
        tiles = [quant_awq.AwqTiles(bm, bn, bk, split, warps, 3) for bm, bn, bk, split, warps in GEMM_TILES]
    rows = []
    for t in [default] + [t for t in tiles if t != default]:
        us = time_us(lambda x, c: quant_awq.linear(x, *c["awq"], tiles=t), x, copies, reps)
        label = (("default " if t == default else "") + f"m{t.block_m} n{t.block_n} k{t.block_k} s{t.split_k} "
                 f"w{t.warps}" + (" groups" if t.gemv == "groups" else ""))
        rows.append((label, us, _errors(quant_awq.linear(x, *c0["awq"], tiles=t), y_bf16, dequant)))
    _report(f"{name} M={num_rows}", rows, bf16_us)


def _dequantized(c: dict) -> dict:
    """c with its experts replaced by the AWQ weights dequantized (fp32), for moe_reference."""
    w_gate_up, w_down = (ref.dequant_awq(w.qweight, w.qzeros, w.scales).transpose(1, 2) for w in c["awq"])
    return {**c, "bf16": (w_gate_up, w_down)}


def moe_one_token(copies: list[dict], reps: int) -> None:
    x = _randn(1, HIDDEN, scale=1.0, seed=201).bfloat16()
    bf16_us = time_us(moe_bf16, x, copies, reps)
    y_bf16 = moe_bf16(x, copies[0])
    dequant = moe_reference(x, _dequantized(copies[0]))
    base = quant_awq_moe.ONE_TOKEN_TILES
    variants = [base] + [quant_awq_moe.OneTokenTiles(*t) for t in ONE_TOKEN] + [quant_awq_moe.GROUPED_TILES] + [
        quant_awq_moe.OneTokenTiles(*t, gemv="groups") for t in GROUPS_ONE_TOKEN]
    rows = []
    for i, tiles in enumerate(variants):
        def run(x, c, tiles=tiles):
            ids, weights = routing.gate_route(x, c["gate"], TOP_K, True, _hits())[:2]
            return quant_awq_moe.one_token_experts(x, ids, weights, *c["awq"], tiles)
        if i and tiles == base:
            continue
        label = (("default " if i == 0 else "") + f"gu f{tiles.gate_up_f} d{tiles.gate_up_d} s{tiles.gate_up_splits} "
                 f"w{tiles.gate_up_warps} | down o{tiles.down_o} f{tiles.down_f} s{tiles.down_splits} "
                 f"w{tiles.down_warps}" + (" groups" if tiles.gemv == "groups" else ""))
        rows.append((label, time_us(run, x, copies, reps), _errors(run(x, copies[0]), y_bf16, dequant)))
    _report("moe M=1", rows, bf16_us)


def moe_grouped_64(copies: list[dict], reps: int) -> None:
    x = _randn(64, HIDDEN, scale=1.0, seed=264).bfloat16()
    bf16_us = time_us(lambda x, c: moe_grouped.grouped_moe(x, c["gate"], *c["bf16"], TOP_K, True, _hits()), x,
                      copies, reps)
    y_bf16 = moe_grouped.grouped_moe(x, copies[0]["gate"], *copies[0]["bf16"], TOP_K, True, _hits())
    dequant = moe_reference(x, _dequantized(copies[0]))
    default = quant_awq_moe.default_config(64)
    configs = [default] + [MoEConfig(default.block_m, GemmBlocks(*g), GemmBlocks(*g), default.tiles_first)
                           for g in GROUPED]
    rows = []
    for i, config in enumerate(configs):
        if i and config == default:
            continue
        def run(x, c, config=config):
            return quant_awq_moe.grouped_moe(x, c["gate"], *c["awq"], TOP_K, True, _hits(), config)
        g = config.gate_up
        label = ("default " if i == 0 else "") + f"bm{config.block_m} n{g.block_n} k{g.block_k} w{g.num_warps} " \
                f"st{g.num_stages} (down n{config.down.block_n})"
        rows.append((label, time_us(run, x, copies, reps), _errors(run(x, copies[0]), y_bf16, dequant)))
    _report("moe M=64", rows, bf16_us)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="qkv,o,moe1,moe64")
    p.add_argument("--dense-copies", type=int, default=12, help="weight copies (AWQ qkv is 5 MB: 12 exceed the L2)")
    p.add_argument("--moe-copies", type=int, default=4)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    cases = args.cases.split(",")
    print(torch.cuda.get_device_name(), flush=True)
    for name in ("qkv", "o"):
        if name in cases:
            copies = dense_copies(*DENSE[name], args.dense_copies)
            for num_rows in (1, 64):
                dense(name, num_rows, copies, args.reps)
            del copies
    if "moe1" in cases or "moe64" in cases:
        copies = moe_copies(args.moe_copies)
        if "moe1" in cases:
            moe_one_token(copies, args.reps)
        if "moe64" in cases:
            moe_grouped_64(copies, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
