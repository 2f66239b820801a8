"""One MoE layer of one rank at decode and prefill sizes: the general path against kernels.moe_grouped (issue 8).

    python3 bench/kernels/moe_large_batch.py --out bench/results          # on a GPU

One Qwen3-30B-A3B-shaped MoE layer (128 experts, top-8, D 2048, F 768, bf16,
random weights) on one GPU, per token count T:

- general: MoELayer.__call__ with moe_grouped.ENABLED off: gate, dispatch with one rank
  (fixed capacity up to 256 tokens, host splits above), grouped_mm, combine;
- grouped_mm: moe_grouped.grouped_moe(gemms="torch"): routing and align kernels,
  the expert GEMMs as torch._grouped_mm on gathered rows, the combine kernel;
- triton: moe_grouped.grouped_moe with its default tiles (the path MoELayer takes);
- with --sweep, the Triton GEMMs alone for each candidate tile, and the best, which is timed
  again in the other launch order (each block's column tiles in turn).

With --ep-ranks N (> 1) it times instead the expert step of rank 0 of N expert-parallel
ranks (L = 128 / N local experts), the experts on the rows dispatch would give it when every
rank has T tokens: torch._grouped_mm (moe_experts.experts) against moe_gemm.sorted_experts
(moe_triton.dispatched_experts, the default on CUDA), in the fixed-capacity buffer up to 256
tokens (graphed) and exactly sized above, with the largest difference between the two on the real rows.

Reports ms per layer (eager, and CUDA-graph replay up to 256 tokens), GB/s of
expert weights read (every expert the step routes to, once) and TFLOP/s of the
expert GEMMs, and each path's largest difference from the general path's output
(the torch reference), with its hit counts. Writes moe_large_batch_<gpu>.md/.json.
"""

import argparse
import json
import pathlib
import sys
import time

import torch
import triton

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from services.model.exchange.comm import ExpertComm  # noqa: E402
from services.model.kernels import moe_align, moe_gemm, moe_grouped  # noqa: E402
from services.model.kernels.moe_triton import dispatched_experts  # noqa: E402
from services.model.moe import MoELayer  # noqa: E402
from services.model.moe_dispatch import step_capacity  # noqa: E402
from services.model.moe_experts import experts  # noqa: E402

NUM_EXPERTS, TOP_K, HIDDEN, WIDTH = 128, 8, 2048, 768
DEVICE, DTYPE = "cuda", torch.bfloat16
MAX_GRAPH_TOKENS = 256  # the decode buckets a CUDA graph is captured for
# Candidate tiles per rows-per-block (block_m): (block_n, block_k, warps, stages).
# The first of each list is the one the sweep's gate_up output for down comes from. Decode
# sizes (block_m 16 and 32) also try deeper pipelines and wider K steps: at 256 tokens the
# GEMMs read the weights at 3.75 TB/s against the 4.25 of a copy.
GATE_UP_TILES = {16: [(128, 128, 4, 3), (64, 128, 4, 4), (64, 128, 4, 5), (128, 64, 4, 5), (64, 256, 4, 3),
                      (32, 256, 4, 3), (128, 128, 8, 3)],
                 32: [(128, 128, 4, 3), (64, 256, 4, 2), (64, 128, 4, 4), (64, 128, 4, 5), (128, 64, 4, 5),
                      (32, 256, 4, 3), (128, 128, 8, 3)],
                 64: [(128, 64, 8, 3), (128, 64, 4, 4), (64, 128, 4, 4)],
                 128: [(128, 64, 8, 4), (128, 128, 8, 2), (128, 64, 8, 3), (256, 64, 8, 3)]}
DOWN_TILES = {16: [(128, 128, 4, 4), (64, 256, 4, 3), (128, 256, 8, 3), (64, 128, 4, 5), (32, 256, 4, 3),
                   (128, 64, 4, 5), (256, 128, 8, 3)],
              32: [(64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 8, 4), (64, 128, 4, 5), (32, 256, 4, 3),
                   (128, 64, 4, 5), (256, 128, 8, 3)],
              64: [(128, 64, 4, 4), (128, 128, 4, 3), (64, 128, 4, 4)],
              128: [(256, 64, 8, 4), (256, 128, 8, 2), (128, 128, 8, 3), (256, 64, 8, 3)]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="32,64,128,256,512,1024,4096")
    p.add_argument("--sweep", action="store_true", help="time the candidate GEMM tiles too")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--ep-ranks", type=int, default=1, help="time rank 0's expert step of N ranks instead")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    return p.parse_args(argv)


def make_layer(seed: int = 0) -> MoELayer:
    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(*shape, scale):
        return (torch.randn(*shape, generator=g, device=DEVICE) * scale).to(DTYPE)

    return MoELayer(randn(NUM_EXPERTS, HIDDEN, scale=HIDDEN ** -0.5),
                    randn(NUM_EXPERTS, 2 * WIDTH, HIDDEN, scale=HIDDEN ** -0.5),
                    randn(NUM_EXPERTS, HIDDEN, WIDTH, scale=WIDTH ** -0.5), top_k=TOP_K, norm_topk_prob=True,
                    comm=ExpertComm.local(), hit_counts_E=torch.zeros(NUM_EXPERTS, dtype=torch.int64, device=DEVICE))


def time_ms(fn, reps: int, graphed: bool) -> float:
    """Mean ms of fn over reps runs after warm-up: eager launches, or one CUDA graph replayed."""
    for _ in range(2):
        fn()
    if DEVICE == "cpu":  # a smoke run of the script (under TRITON_INTERPRET=1)
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)
    torch.cuda.synchronize()
    run = fn
    if graphed:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def general(layer: MoELayer, x_TD: torch.Tensor):
    capacity = step_capacity(x_TD.shape[0], TOP_K, NUM_EXPERTS, MAX_GRAPH_TOKENS)
    moe_grouped.ENABLED = False
    try:
        return layer(x_TD, capacity)
    finally:
        moe_grouped.ENABLED = True


def grouped(layer: MoELayer, x_TD: torch.Tensor, hits_E: torch.Tensor, **kwargs):
    return moe_grouped.grouped_moe(x_TD, layer.w_gate_ED, layer.w_gate_up_LGD, layer.w_down_LDF, TOP_K, True,
                                   hits_E, **kwargs)


def sweep(layer: MoELayer, x_TD: torch.Tensor, reps: int) -> dict:
    """Each candidate tile of the two Triton GEMMs alone on this step's alignment; the best per block_m."""
    num_tokens = x_TD.shape[0]
    ids_TK = torch.topk(torch.nn.functional.linear(x_TD, layer.w_gate_ED).float(), TOP_K).indices.sort(1).values
    best = {}
    for block_m in ((16, 32, 64) if num_tokens <= 512 else (64, 128)):
        a = moe_align.align(ids_TK, NUM_EXPERTS, block_m)
        act_PF = moe_gemm.gate_up(x_TD, a, layer.w_gate_up_LGD, TOP_K, moe_gemm.GemmBlocks(*GATE_UP_TILES[block_m][0]))

        def time_gate_up(tile, tiles_first):
            return tile_ms(lambda: moe_gemm.gate_up(x_TD, a, layer.w_gate_up_LGD, TOP_K, moe_gemm.GemmBlocks(*tile),
                                                    tiles_first), reps)

        def time_down(tile, tiles_first):
            return tile_ms(lambda: moe_gemm.down(act_PF, a, layer.w_down_LDF, ids_TK.numel(),
                                                 moe_gemm.GemmBlocks(*tile), tiles_first), reps)

        # Every tile launched each column tile over every block (blocks first); the best ones again
        # with each block's column tiles in turn (MoEConfig.tiles_first, the default).
        gate_up = {tile: time_gate_up(tile, False) for tile in GATE_UP_TILES[block_m]}
        down = {tile: time_down(tile, False) for tile in DOWN_TILES[block_m]}
        best_gu, best_dn = min(gate_up, key=gate_up.get), min(down, key=down.get)
        tiles_first = {"gate_up": time_gate_up(best_gu, True), "down": time_down(best_dn, True)}
        best[block_m] = {"gate_up": {str(k): v for k, v in gate_up.items()}, "down": {str(k): v for k, v in down.items()},
                         "best_gate_up": best_gu, "best_down": best_dn, "gemms_ms": gate_up[best_gu] + down[best_dn],
                         "tiles_first": tiles_first}
    return best


def tile_ms(fn, reps: int) -> float:
    """time_ms, or infinity for a tile that needs more shared memory than the GPU has."""
    try:
        return time_ms(fn, reps, False)
    except triton.runtime.errors.OutOfResources as error:
        print("skipped:", error, flush=True)
        return float("inf")


def bench_tokens(layer: MoELayer, num_tokens: int, args) -> dict:
    g = torch.Generator(device=DEVICE).manual_seed(num_tokens)
    x_TD = torch.randn(num_tokens, HIDDEN, generator=g, device=DEVICE).to(DTYPE)
    hits_before = layer.hit_counts_E.clone()
    ref_TD = general(layer, x_TD)
    ref_hits = layer.hit_counts_E - hits_before
    num_hit = int((ref_hits > 0).sum())
    weight_bytes = num_hit * 3 * WIDTH * HIDDEN * layer.w_down_LDF.element_size()
    flops = 2 * num_tokens * TOP_K * 3 * WIDTH * HIDDEN
    graphed = num_tokens <= MAX_GRAPH_TOKENS and DEVICE == "cuda"
    scratch_hits = torch.zeros_like(layer.hit_counts_E)
    paths = {"general": lambda: general(layer, x_TD),
             "grouped_mm": lambda: grouped(layer, x_TD, scratch_hits, gemms="torch"),
             "triton": lambda: grouped(layer, x_TD, scratch_hits)}
    row = {"tokens": num_tokens, "experts_hit": num_hit, "weight_MB": weight_bytes / 1e6, "gflop": flops / 1e9,
           "scale": ref_TD.abs().max().item(), "paths": {}}
    for name, fn in paths.items():
        entry = {}
        if name != "general":
            hits_E = torch.zeros_like(layer.hit_counts_E)
            out_TD = grouped(layer, x_TD, hits_E, **({"gemms": "torch"} if name == "grouped_mm" else {}))
            entry.update(max_abs_diff=(out_TD.float() - ref_TD.float()).abs().max().item(),
                         hits_equal=bool(torch.equal(hits_E, ref_hits)))
        entry["eager_ms"] = time_ms(fn, args.reps, False)
        # The general path syncs with the host above 256 tokens (host splits): eager only.
        if graphed:
            entry["graph_ms"] = time_ms(fn, args.reps, True)
        ms = entry.get("graph_ms", entry["eager_ms"])
        entry.update(GB_per_s=weight_bytes / ms / 1e6, TFLOP_per_s=flops / ms / 1e9)
        row["paths"][name] = entry
        print(num_tokens, name, json.dumps(entry), flush=True)
    if args.sweep:
        row["sweep"] = sweep(layer, x_TD, args.reps)
        print(num_tokens, "sweep", json.dumps({m: [s["best_gate_up"], s["best_down"], s["gemms_ms"]]
                                                for m, s in row["sweep"].items()}), flush=True)
    return row


def ep_rows(layer: MoELayer, num_tokens: int, num_ranks: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """x_PD, offsets_L and the real pair count of rank 0 when each of num_ranks ranks routes
    num_tokens tokens: its experts' (token, expert) pairs sorted by expert, then token, in
    dispatch's fixed-capacity buffer (zero rows after the pairs) up to MAX_GRAPH_TOKENS."""
    g = torch.Generator(device=DEVICE).manual_seed(num_tokens)
    x_TD = torch.randn(num_ranks * num_tokens, HIDDEN, generator=g, device=DEVICE).to(DTYPE)
    num_local = NUM_EXPERTS // num_ranks
    ids_R = torch.topk(torch.nn.functional.linear(x_TD, layer.w_gate_ED).float(), TOP_K).indices.flatten()
    key_R = torch.where(ids_R < num_local, ids_R, num_local)
    order_R = key_R.sort(stable=True).indices
    counts_L = torch.bincount(key_R, minlength=num_local + 1)[:num_local]
    num_pairs = int(counts_L.sum())
    capacity = step_capacity(num_tokens, TOP_K, num_local, MAX_GRAPH_TOKENS)
    num_rows = num_pairs if capacity is None else num_ranks * capacity
    x_PD = x_TD.new_zeros(num_rows, HIDDEN)
    x_PD[:num_pairs] = x_TD[order_R[:num_pairs] // TOP_K]
    return x_PD, counts_L.cumsum(0).to(torch.int32), num_pairs


def bench_ep_tokens(layer: MoELayer, num_tokens: int, args) -> dict:
    num_local = NUM_EXPERTS // args.ep_ranks
    w_gate_up_LGD, w_down_LDF = layer.w_gate_up_LGD[:num_local], layer.w_down_LDF[:num_local]
    x_PD, offsets_L, num_pairs = ep_rows(layer, num_tokens, args.ep_ranks)
    paths = {"grouped_mm": lambda: experts(x_PD, offsets_L, w_gate_up_LGD, w_down_LDF),
             "triton": lambda: dispatched_experts(x_PD, offsets_L, w_gate_up_LGD, w_down_LDF)}
    if args.sweep:  # default_config's tiles for each block_m (those of 128, 256, 512, 1024 tokens)
        for config in map(moe_gemm.default_config, (128, 256, 512, 1024)):
            paths[f"triton_m{config.block_m}"] = (
                lambda config=config: moe_gemm.sorted_experts(x_PD, offsets_L, w_gate_up_LGD, w_down_LDF, config))
    ref_PD, out_PD = (paths[name]()[:num_pairs].float() for name in ("grouped_mm", "triton"))
    row = {"tokens": num_tokens, "ranks": args.ep_ranks, "rows": x_PD.shape[0], "pairs": num_pairs,
           "max_abs_diff": (out_PD - ref_PD).abs().max().item() if num_pairs else 0.0,
           "scale": ref_PD.abs().max().item() if num_pairs else 0.0, "paths": {}}
    graphed = num_tokens <= MAX_GRAPH_TOKENS and DEVICE == "cuda"
    for name, fn in paths.items():
        row["paths"][name] = {"eager_ms": time_ms(fn, args.reps, False)}
        if graphed:
            row["paths"][name]["graph_ms"] = time_ms(fn, args.reps, True)
        print(num_tokens, name, json.dumps(row["paths"][name]), flush=True)
    return row


def ep_markdown(result: dict) -> str:
    lines = [f"# Expert step of rank 0 of {result['rows'][0]['ranks']} expert-parallel ranks ({result['env']['gpu']})",
             "", f"Command: `{result['command']}`", "", f"Environment: {json.dumps(result['env'])}", "",
             "The experts on the rows dispatch gives rank 0 (fixed-capacity buffer up to 256 tokens per rank, "
             "CUDA-graph replay; exact rows and eager above). ms per layer; diff: largest |triton - grouped_mm| "
             "on the real pairs (bf16), against the largest |grouped_mm|.", "",
             "| T per rank | buffer rows | pairs | grouped_mm ms | triton ms | speed-up | diff | largest |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        ms = {name: p.get("graph_ms", p["eager_ms"]) for name, p in row["paths"].items()}
        lines.append(f"| {row['tokens']} | {row['rows']} | {row['pairs']} | {ms['grouped_mm']:.3f} | "
                     f"{ms['triton']:.3f} | {ms['grouped_mm'] / ms['triton']:.2f}x | {row['max_abs_diff']:.3g} | "
                     f"{row['scale']:.3g} |")
        if len(ms) > 2:  # --sweep
            lines.append("|  | block_m sweep (ms): " + ", ".join(f"{name[8:]}: {v:.3f}" for name, v in ms.items()
                                                           if name.startswith("triton_m")) + " | | | | | | |")
    return "\n".join(lines + [""])


def markdown(result: dict) -> str:
    lines = [f"# One MoE layer, one rank: general path vs kernels.moe_grouped ({result['env']['gpu']})", "",
             f"Command: `{result['command']}`", "", f"Environment: {json.dumps(result['env'])}", "",
             "Qwen3-30B-A3B shape (128 experts, top-8, D 2048, F 768), bf16, random weights. ms per layer: "
             "CUDA-graph replay up to 256 tokens, eager above (the general path syncs with the host there). "
             "GB/s: expert weights of the experts hit, read once; TFLOP/s: the expert GEMMs' useful work. "
             "diff: largest |out - general| (bf16), against the largest |general|.", "",
             "| T | general ms | grouped_mm ms | triton ms | triton GB/s | triton TFLOP/s | speed-up | "
             "grouped_mm diff | triton diff | largest | hits equal |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in result["rows"]:
        p = row["paths"]

        def ms(name):
            return p[name].get("graph_ms", p[name]["eager_ms"])

        lines.append(f"| {row['tokens']} | {ms('general'):.3f} | {ms('grouped_mm'):.3f} | {ms('triton'):.3f} | "
                     f"{p['triton']['GB_per_s']:.0f} | {p['triton']['TFLOP_per_s']:.0f} | "
                     f"{ms('general') / ms('triton'):.2f}x | {p['grouped_mm']['max_abs_diff']:.3g} | "
                     f"{p['triton']['max_abs_diff']:.3g} | {row['scale']:.3g} | "
                     f"{p['triton']['hits_equal'] and p['grouped_mm']['hits_equal']} |")
    if any("sweep" in row for row in result["rows"]):
        lines += ["", "## Triton GEMM tiles (gate_up + down kernels alone, eager ms)", "",
                  "| T | block_m | best gate_up (n, k, warps, stages) | best down | gate_up + down ms |",
                  "|---:|---:|---|---|---:|"]
        for row in result["rows"]:
            for block_m, s in row.get("sweep", {}).items():
                lines.append(f"| {row['tokens']} | {block_m} | {s['best_gate_up']} | {s['best_down']} | "
                             f"{s['gemms_ms']:.3f} |")
        lines += ["", "### The best tiles in both launch orders (tiles first: each block's column tiles in turn), "
                  "eager ms", "", "| T | block_m | gate_up blocks first | tiles first | down blocks first | tiles first |",
                  "|---:|---:|---:|---:|---:|---:|"]
        for row in result["rows"]:
            for block_m, s in row.get("sweep", {}).items():
                if "tiles_first" in s:
                    lines.append(f"| {row['tokens']} | {block_m} | {s['gate_up'][str(tuple(s['best_gate_up']))]:.3f} | "
                                 f"{s['tiles_first']['gate_up']:.3f} | {s['down'][str(tuple(s['best_down']))]:.3f} | "
                                 f"{s['tiles_first']['down']:.3f} |")
        lines += ["", "### Every tile (n, k, warps, stages), eager ms", "",
                  "| T | block_m | GEMM | tile | ms |", "|---:|---:|---|---|---:|"]
        for row in result["rows"]:
            for block_m, s in row.get("sweep", {}).items():
                for gemm in ("gate_up", "down"):
                    lines += [f"| {row['tokens']} | {block_m} | {gemm} | {tile} | {ms:.3f} |"
                              for tile, ms in s[gemm].items()]
    return "\n".join(lines + [""])


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    layer = make_layer()
    if NUM_EXPERTS % args.ep_ranks:
        raise ValueError(f"--ep-ranks {args.ep_ranks} does not divide {NUM_EXPERTS} experts")
    bench = bench_tokens if args.ep_ranks == 1 else bench_ep_tokens
    rows = [bench(layer, int(t), args) for t in args.tokens.split(",")]
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    result = {"command": " ".join(["python3"] + sys.argv), "rows": rows, "wall_s": time.perf_counter() - start,
              "env": {"torch": torch.__version__, "gpu": gpu, "cuda": torch.version.cuda}}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = ("moe_large_batch_" if args.ep_ranks == 1 else f"moe_ep{args.ep_ranks}_experts_") + (
        "h200" if "H200" in gpu else gpu.replace(" ", "_").lower())
    text = (markdown if args.ep_ranks == 1 else ep_markdown)(result)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
    (out / f"{stem}.md").write_text(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
