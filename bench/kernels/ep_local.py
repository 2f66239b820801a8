"""One rank's share of the expert-parallel MoE layer (kernels.moe_ep, exchange.symmetric's push) on ONE GPU.

    python3 -m bench.kernels.ep_local --rows-per-rank 128,256 --sweep     # on a GPU

bench/kernels/ep_gpu.py times the whole layer on two GPUs. What a rank computes between
its two barriers needs no peer, so here the peers' buffers are local stand-ins
(the pointer tables hold local addresses) and a rank of N runs its kernels as
on N GPUs, less the NVLink writes and the barriers. Qwen3-30B-A3B's MoE shape
(128 experts, top-8, D 2048, F 768), bf16 random weights, rank 0 of N (128 / N
local experts), every rank B tokens (rows per rank), J = N * B gathered rows:

1. the chain, replayed as a CUDA graph: F.linear gate + route_pack into the N
   row buffers, align + gate_up + down + partials into the N partial buffers
   (moe_ep.local_partials at moe_ep.local_config(J)), reduce_add_norm,
   under each --variants setting of module knobs (bench/kernels/decode_variants.py's
   syntax, e.g. "warps=kernels.moe_ep.PARTIALS_WARPS:8"); ms, the local
   experts' weights in GB/s, and the kernels of one eager call;
   With --signals each variant also with exchange.symmetric's signals (kernels.flags),
   the pads' table looped back (rank s's pad at this rank's pad + 4 s bytes,
   so the producers' flags for the peers land where this rank's consumers
   wait for the peers'): what the flags cost without NVLink, and the same bits;
2. --sweep: local_partials' two GEMMs alone for each block_m and candidate tile
   of bench/kernels/moe_large_batch.py (eager launches, mean of --reps), both launch
   orders, against default_config(J)'s.

Writes ep_local_<gpu>.md / .json under --out.
"""

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.kernels.decode_variants import overridden, parse_variants  # noqa: E402
from bench.kernels.kernel_profile import top_kernels  # noqa: E402
from bench.kernels.moe_large_batch import (  # noqa: E402
    DOWN_TILES, GATE_UP_TILES, HIDDEN, NUM_EXPERTS, TOP_K, WIDTH, tile_ms, time_ms)
from services.model.exchange import symmetric  # noqa: E402
from services.model.kernels import moe_align, moe_ep, moe_gemm, norm  # noqa: E402
from services.model.kernels.flags import exchange_flags  # noqa: E402
from services.model.layers import AddNorm  # noqa: E402

DTYPE = torch.bfloat16


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows-per-rank", default="128,256", help="B: each rank's decode tokens")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sweep", action="store_true", help="time local_partials' GEMM tiles too")
    p.add_argument("--wide", action="store_true", help="with --sweep: every tile of WIDE_GATE_UP / WIDE_DOWN "
                   "at block_m 32 instead")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--variants", default="", help="knob settings to compare, as bench/kernels/decode_variants.py's "
                   "(name=module.attr:value,...;...; base first)")
    p.add_argument("--rounds", type=int, default=2, help="times each variant runs, in turn with the others")
    p.add_argument("--signals", action="store_true", help="time each variant with the exchange's flags too "
                   "(looped back to this rank)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    args.variants = parse_variants(args.variants)
    return args


class Rank:
    """Rank 0's weights and its stand-ins for every rank's row and partial buffers."""

    def __init__(self, num_ranks: int, max_rows_per_rank: int, seed: int = 0):
        g = torch.Generator(device="cuda").manual_seed(seed)

        def randn(*shape):
            return (torch.randn(*shape, generator=g, device="cuda") * 0.02).to(DTYPE)

        self.num_ranks, self.num_local = num_ranks, NUM_EXPERTS // num_ranks
        self.w_gate_ED = randn(NUM_EXPERTS, HIDDEN)
        self.w_gate_up_LGD = randn(self.num_local, 2 * WIDTH, HIDDEN)
        self.w_down_LDF = randn(self.num_local, HIDDEN, WIDTH)
        self.norm_D = (torch.rand(HIDDEN, generator=g, device="cuda") + 0.5).to(DTYPE)
        width = moe_ep.row_width(HIDDEN, TOP_K, DTYPE)
        rows = num_ranks * max_rows_per_rank
        self.rows = [torch.zeros(rows, width, dtype=DTYPE, device="cuda") for _ in range(num_ranks)]
        self.partials = [torch.zeros(rows, HIDDEN, device="cuda") for _ in range(num_ranks)]
        self.row_ptrs_N, self.partial_ptrs_N = (torch.tensor([b.data_ptr() for b in buffers], device="cuda")
                                                for buffers in (self.rows, self.partials))
        self.own_partials_N = self.partial_ptrs_N[:1].repeat(num_ranks)
        self.hits_E = torch.zeros(NUM_EXPERTS, dtype=torch.int64, device="cuda")
        # Signals looped back: "rank s's pad" is this pad + 4 s bytes, so the flag rank 0 sets in
        # rank s's pad (word channel * N + 0 there) is word channel * N + s of its own pad: the
        # flag rank 0's consumers wait for from rank s.
        self.pad = torch.zeros(3 * num_ranks, dtype=torch.int32, device="cuda")
        pads_N = torch.tensor([self.pad.data_ptr() + 4 * s for s in range(num_ranks)], device="cuda")
        self.flags = exchange_flags(pads_N, 0, "cuda", timeout_ns=10 ** 10)

    def tokens(self, rows_per_rank: int, rank: int) -> torch.Tensor:
        g = torch.Generator(device="cuda").manual_seed(1000 * rows_per_rank + rank)
        return torch.randn(rows_per_rank, HIDDEN, generator=g, device="cuda").to(DTYPE)

    def pack(self, x_TD: torch.Tensor, rank: int, rows_per_rank: int, signals: bool = False) -> None:
        """Rank `rank`'s rows routed and written into slot `rank` of every row buffer."""
        logits_TE = torch.nn.functional.linear(x_TD, self.w_gate_ED)
        b = rows_per_rank
        moe_ep.route_pack(logits_TE, x_TD, TOP_K, True, self.hits_E, b, self.rows[rank][rank * b:(rank + 1) * b],
                          (self.row_ptrs_N, rank * b), self.flags["rows"] if signals else None)

    def gathered(self, rows_per_rank: int) -> torch.Tensor:
        return self.rows[0][:self.num_ranks * rows_per_rank]

    def step(self, x_TD: torch.Tensor, add_norm: AddNorm, config: moe_gemm.MoEConfig,
             signals: bool = False) -> torch.Tensor:
        """Rank 0's kernels of one layer: its rows to every rank, its experts on the gathered
        rows, the partials to their owners, the sum over its own slots with the add and norm;
        with signals, the flags set and waited for (looped back)."""
        b, flags = x_TD.shape[0], self.flags if signals else {}
        self.pack(x_TD, 0, b, signals)
        moe_ep.local_partials(self.gathered(b), HIDDEN, TOP_K, 1, self.w_gate_up_LGD, self.w_down_LDF, config,
                              self.partials[0][:self.num_ranks * b], (self.partial_ptrs_N, 0),
                              flags.get("partials"), wait=flags.get("rows_wait"))
        return symmetric.reduce_add_norm(self.own_partials_N, add_norm, 0, b, flags.get("partials_wait"))


def chain(rank: Rank, rows_per_rank: int, args) -> dict:
    """The rank's whole layer (as Rank.step, at moe_ep.local_config(J)) under each variant,
    in turn for --rounds rounds: each variant's median over the rounds of its graph ms; the
    kernels of one eager call under base."""
    b, num_rows = rows_per_rank, rank.num_ranks * rows_per_rank
    for peer in range(1, rank.num_ranks):  # the peers' rows, once
        rank.pack(rank.tokens(b, peer), peer, b)
    x_TD = rank.tokens(b, 0)
    add_norm = AddNorm(rank.tokens(b, 99), rank.norm_D, 1e-6, norm.add_rms_norm_)
    a = moe_align.align(moe_ep._meta(rank.gathered(b), HIDDEN)[:, :TOP_K], rank.num_local, 1, 1)
    experts_hit = int((a.counts_E > 0).sum())
    weight_bytes = experts_hit * 3 * WIDTH * HIDDEN * DTYPE.itemsize
    result = {"rows_per_rank": b, "gathered_rows": num_rows, "local_pairs": int(a.counts_E.sum()),
              "local_experts_hit": experts_hit, "variants": {}}
    variants = {f"{name}{suffix}": (overrides, signals) for name, overrides in args.variants.items()
                for suffix, signals in ((("", False), ("+signals", True)) if args.signals else (("", False),))}
    rounds = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (overrides, signals) in variants.items():
            with overridden(overrides):
                config = moe_ep.local_config(num_rows)
                rounds[name].append(time_ms(lambda: rank.step(x_TD, add_norm, config, signals), args.reps, True))
    for name, times in rounds.items():
        ms = statistics.median(times)
        result["variants"][name] = {"overrides": variants[name][0], "graph_ms": ms, "by_round": times,
                                    "weights_GB_per_s": weight_bytes / ms / 1e6}
    config = moe_ep.local_config(num_rows)
    result["config"] = repr(config)
    result["kernels"] = top_kernels(lambda: rank.step(x_TD, add_norm, config), torch.device("cuda"))
    result["checks"] = check_push(rank, x_TD, config)
    if args.signals:  # the same layer's bits with and without the flags
        outputs = []
        for signals in (False, True):
            x_copy = add_norm.x_TD.clone()
            outputs.append((rank.step(x_TD, AddNorm(x_copy, rank.norm_D, 1e-6, None), config, signals), x_copy))
        result["checks"]["signals_equal"] = all(torch.equal(a, b) for a, b in zip(*outputs))
        result["kernels_signals"] = top_kernels(lambda: rank.step(x_TD, add_norm, config, True), torch.device("cuda"))
    return result


def check_push(rank: Rank, x_TD: torch.Tensor, config: moe_gemm.MoEConfig) -> dict:
    """The push kernels on the GPU against their local forms, bit for bit: the rows route_pack
    pushed into every stand-in against a local send buffer; each owner's slot of the pushed
    partials against the local partials; reduce_add_norm against reduce_rows + add_rms_norm_.
    (The NVLink writes and their order against the barriers need two GPUs: bench/kernels/ep_gpu.py.)"""
    b = x_TD.shape[0]
    rank.pack(x_TD, 0, b)
    logits_TE = torch.nn.functional.linear(x_TD, rank.w_gate_ED)
    send_BW = moe_ep.route_pack(logits_TE, x_TD, TOP_K, True, torch.zeros_like(rank.hits_E), b)
    words = [buffer[:b].view(torch.int16) for buffer in rank.rows]
    rows_equal = all(torch.equal(w, send_BW.view(torch.int16)) for w in words)
    recv_JW = rank.gathered(b)
    local_JD = moe_ep.local_partials(recv_JW, HIDDEN, TOP_K, 1, rank.w_gate_up_LGD, rank.w_down_LDF, config)
    moe_ep.local_partials(recv_JW, HIDDEN, TOP_K, 1, rank.w_gate_up_LGD, rank.w_down_LDF, config,
                          rank.partials[0][:rank.num_ranks * b], (rank.partial_ptrs_N, 0))
    partials_equal = all(torch.equal(rank.partials[owner][:b], local_JD[owner * b:(owner + 1) * b])
                         for owner in range(rank.num_ranks))
    residual_TD = rank.tokens(b, 98)
    fused_x_TD, unfused_x_TD = residual_TD.clone(), residual_TD.clone()
    h_TD = symmetric.reduce_add_norm(rank.own_partials_N, AddNorm(fused_x_TD, rank.norm_D, 1e-6, None), 0, b)
    summed_TD = torch.empty_like(x_TD)
    symmetric.reduce_rows(rank.own_partials_N, summed_TD, 0, b)
    unfused_h_TD = norm.add_rms_norm_(unfused_x_TD, summed_TD, rank.norm_D, 1e-6)
    return {"rows_equal": rows_equal, "partials_equal": partials_equal,
            "add_norm_equal": torch.equal(fused_x_TD, unfused_x_TD) and torch.equal(h_TD, unfused_h_TD)}


# --wide: every combination of these at block_m 32, each block's tiles launched first.
WIDE_GATE_UP = [(n, k, w, st) for n in (32, 64, 128) for k in (64, 128, 256) for w in (4, 8) for st in (2, 3, 4, 5)]
WIDE_DOWN = [(n, k, w, st) for n in (64, 128, 256) for k in (32, 64, 128) for w in (4, 8) for st in (3, 4, 5, 6)]


def sweep(rank: Rank, rows_per_rank: int, reps: int, wide: bool = False) -> dict:
    """local_partials' gate_up and down alone per block_m, tile and launch order (eager ms); wide:
    WIDE_GATE_UP and WIDE_DOWN at block_m 32, tiles first."""
    recv_JW = rank.gathered(rows_per_rank)
    num_rows = recv_JW.shape[0]
    ids_JK = moe_ep._meta(recv_JW, HIDDEN)[:, :TOP_K]
    x_JD = recv_JW[:, :HIDDEN]
    default = moe_gemm.default_config(num_rows)
    results = {}
    for block_m in (32,) if wide else (16, 32, 64):
        a = moe_align.align(ids_JK, rank.num_local, block_m, 1)
        first = moe_gemm.GemmBlocks(*GATE_UP_TILES[block_m][0])
        act_PF = moe_gemm.gate_up(x_JD, a, rank.w_gate_up_LGD, TOP_K, first)
        for tiles_first in (True,) if wide else (True, False):
            gate_up = {tile: tile_ms(lambda: moe_gemm.gate_up(x_JD, a, rank.w_gate_up_LGD, TOP_K,
                                                              moe_gemm.GemmBlocks(*tile), tiles_first), reps)
                       for tile in (WIDE_GATE_UP if wide else GATE_UP_TILES[block_m])}
            down = {tile: tile_ms(lambda: moe_gemm.down(act_PF, a, rank.w_down_LDF, ids_JK.numel(),
                                                        moe_gemm.GemmBlocks(*tile), tiles_first), reps)
                    for tile in (WIDE_DOWN if wide else DOWN_TILES[block_m])}
            best_gu, best_dn = min(gate_up, key=gate_up.get), min(down, key=down.get)
            key = f"m{block_m}_{'tiles_first' if tiles_first else 'blocks_first'}"
            results[key] = {"gate_up": {str(k): v for k, v in gate_up.items()},
                            "down": {str(k): v for k, v in down.items()}, "best_gate_up": best_gu,
                            "best_down": best_dn, "gemms_ms": gate_up[best_gu] + down[best_dn]}
            print(rows_per_rank, key, best_gu, best_dn, f"{results[key]['gemms_ms']:.4f}", flush=True)
    a = moe_align.align(ids_JK, rank.num_local, default.block_m, 1)
    act_PF = moe_gemm.gate_up(x_JD, a, rank.w_gate_up_LGD, TOP_K, default.gate_up, default.tiles_first)
    results["default"] = {"config": repr(default), "gemms_ms": time_ms(
        lambda: moe_gemm.gate_up(x_JD, a, rank.w_gate_up_LGD, TOP_K, default.gate_up, default.tiles_first), reps,
        False) + time_ms(lambda: moe_gemm.down(act_PF, a, rank.w_down_LDF, ids_JK.numel(), default.down,
                                               default.tiles_first), reps, False)}
    return results


def markdown(result: dict) -> str:
    lines = [f"# One rank's share of the N={result['ranks']} expert-parallel MoE layer, on one GPU "
             f"({result['env']['gpu']})", "", f"Command: `{result['command']}`", "",
             f"Environment: {json.dumps(result['env'])}", "",
             "The peers' buffers are local stand-ins: the kernels as on a rank of N GPUs, without the NVLink "
             "writes and the two barriers. The layer (at moe_ep.local_config) replayed as a CUDA graph under "
             "each variant's settings (mean ms of --reps replays; the median of the rounds, the variants in "
             "turn); GB/s: the local experts hit, each read once.", "",
             "| rows per rank | gathered rows | local pairs | local experts hit | variant | layer ms | by round "
             "| GB/s |",
             "|---:|---:|---:|---:|---|---:|---|---:|"]
    for row in result["rows"]:
        c = row["chain"]
        for name, v in c["variants"].items():
            overrides = ", ".join(f"{k}={val}" for k, val in v["overrides"].items()) or "base"
            lines.append(f"| {c['rows_per_rank']} | {c['gathered_rows']} | {c['local_pairs']} | "
                         f"{c['local_experts_hit']} | {name} (`{overrides}`) | {v['graph_ms']:.4f} | "
                         f"{' / '.join(f'{t:.4f}' for t in v['by_round'])} | {v['weights_GB_per_s']:.0f} |")
    for row in result["rows"]:
        c = row["chain"]
        lines += ["", f"## Kernels of one eager call (base, `{c['config']}`), {c['rows_per_rank']} rows per rank", "",
                  "| kernel | calls | us |", "|---|---:|---:|"]
        lines += [f"| `{k['name'][:90]}` | {k['calls']} | {k['total_us']:.1f} |" for k in c["kernels"]]
    checks = {key: all(row["chain"]["checks"][key] for row in result["rows"])
              for key in ("rows_equal", "partials_equal", "add_norm_equal")}
    lines += ["", "Push kernels against their local forms, bit for bit, at every size: "
              + ", ".join(f"{key}: {'yes' if ok else 'NO'}" for key, ok in checks.items()) + "."]
    if all("signals_equal" in row["chain"]["checks"] for row in result["rows"]):
        same = all(row["chain"]["checks"]["signals_equal"] for row in result["rows"])
        lines += ["", f"The layer with signals (flags looped back) against without, bit for bit: "
                  f"{'yes' if same else 'NO'}.", ""]
        for row in result["rows"]:
            c = row["chain"]
            lines += [f"Kernels of one eager call with signals, {c['rows_per_rank']} rows per rank:", "",
                      "| kernel | calls | us |", "|---|---:|---:|"]
            lines += [f"| `{k['name'][:90]}` | {k['calls']} | {k['total_us']:.1f} |" for k in c["kernels_signals"]]
            lines.append("")
    if any("sweep" in row for row in result["rows"]):
        lines += ["", "## local_partials' GEMMs alone (eager, mean ms): the best tiles per block_m and order", "",
                  "| rows per rank | block_m, order | best gate_up (n, k, warps, stages) | best down | ms |",
                  "|---:|---|---|---|---:|"]
        for row in result["rows"]:
            for key, s in row.get("sweep", {}).items():
                if key == "default":
                    lines.append(f"| {row['chain']['rows_per_rank']} | default `{s['config']}` | | | "
                                 f"{s['gemms_ms']:.4f} |")
                else:
                    lines.append(f"| {row['chain']['rows_per_rank']} | {key} | {s['best_gate_up']} | "
                                 f"{s['best_down']} | {s['gemms_ms']:.4f} |")
    return "\n".join(lines + [""])


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    sizes = [int(b) for b in args.rows_per_rank.split(",")]
    rank = Rank(args.ranks, max(sizes))
    rows = []
    for b in sizes:
        row = {"chain": chain(rank, b, args)}
        print(b, json.dumps(row["chain"]["variants"]), flush=True)
        if args.sweep:
            row["sweep"] = sweep(rank, b, args.reps, args.wide)
        rows.append(row)
    gpu = torch.cuda.get_device_name()
    result = {"command": " ".join(["python3 -m bench.kernels.ep_local"] + sys.argv[1:]), "ranks": args.ranks,
              "rows": rows, "wall_s": time.perf_counter() - started,
              "env": {"torch": torch.__version__, "gpu": gpu, "cuda": torch.version.cuda}}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "ep_local_" + ("h200" if "H200" in gpu else gpu.replace(" ", "_").lower())
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
    text = markdown(result)
    (out / f"{stem}.md").write_text(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
