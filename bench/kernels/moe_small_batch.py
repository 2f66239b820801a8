"""The fused MoE against the grouped MoE, one Qwen3-30B-A3B layer at small batches, on CUDA (issue 8).

    python bench/kernels/moe_small_batch.py --out bench/results            # the fixed tiles (moe_small.moe_tiles)
    python bench/kernels/moe_small_batch.py --sweep --out bench/results    # first time candidate tiles, keep the best

Random bf16 weights of one MoE layer of Qwen3-30B-A3B (D 2048, F 768, 128
experts, top-8), --layers copies with their own weights (so that the 50 MB L2
cannot serve one replay's weights to the next), random hidden states. Per token
count T, one CUDA graph runs the MoE of every copy on the same x_TD; we time
its replays (median of --reps) and report ms per layer and the expert weights
read per second: the unique experts the layer's tokens touch x 3 x D x F x 2
bytes, over the whole MoE time (gate matmul and routing included).

- fused: kernels.moe_small.fused_moe (the tiles of moe_tiles, or with --sweep the
  best candidate at each swept T, used from that T up: what moe_tiles hard-codes).
- grouped: the dispatch path (what MoELayer ran for bigger steps before
  services/model/kernels/moe_grouped.py, and runs on several ranks): moe_dispatch.gate, dispatch
  at fixed capacity (step_capacity), the experts (moe_triton.dispatched_experts: moe_gemm's
  sorted_experts on CUDA), combine, ExpertComm.local().
- Checks on the first copy: the largest |fused - grouped| (both bf16), and of
  each against an fp32 run of the torch code on the same (bf16) weights.

Writes moe_small_batch_h200.md / .json to --out.
"""

import argparse
import dataclasses
import json
import multiprocessing
import pathlib
import statistics
import sys

import torch
import triton

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from services.model import moe_dispatch  # noqa: E402
from services.model.exchange.comm import ExpertComm  # noqa: E402
from services.model.kernels import moe_small  # noqa: E402
from services.model.kernels.moe_triton import dispatched_experts  # noqa: E402

HIDDEN, WIDTH, NUM_EXPERTS, TOP_K = 2048, 768, 128, 8
DEVICE = "cuda"
SWEEP_TOKENS = (1, 4, 16, 64)
# The candidates of the sweep that picked moe_tiles (bench/results/moe_small_batch_h200.md;
# an earlier sweep of gate_up f 8/16/32 x d 128/256 x 4/8 warps found 32 columns and 4 warps
# best at every T).
GATE_UP_CANDIDATES = [dict(gate_up_f=32, gate_up_d=d, gate_up_stages=4, gate_up_warps=4) for d in (128, 256)]
GATE_UP_CANDIDATES += [dict(gate_up_f=64, gate_up_d=128, gate_up_stages=3, gate_up_warps=4)]
DOWN_CANDIDATES = [dict(down_o=o, down_f=f, down_warps=4) for o in (16, 32, 64) for f in (128, 256)]
DOWN_CANDIDATES += [dict(down_o=o, down_f=256, down_warps=8) for o in (32, 64)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,2,4,8,16,32,64")
    p.add_argument("--layers", type=int, default=8, help="layer copies per replay (distinct weights)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="time candidate tiles first (see SWEEP_TOKENS)")
    p.add_argument("--compile-workers", type=int, default=12, help="processes compiling the sweep's kernels")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def make_layers(num_layers: int, seed=0) -> list[tuple[torch.Tensor, ...]]:
    """(w_gate_ED, w_gate_up_EGD, w_down_EDF) per copy, N(0, 0.02) as RandomWeights draws them."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def draw(*shape):
        return torch.empty(*shape, dtype=torch.bfloat16, device=DEVICE).normal_(0.0, 0.02, generator=g)

    return [(draw(NUM_EXPERTS, HIDDEN), draw(NUM_EXPERTS, 2 * WIDTH, HIDDEN), draw(NUM_EXPERTS, HIDDEN, WIDTH))
            for _ in range(num_layers)]


def grouped_moe(x_TD, w_gate_ED, w_gate_up_EGD, w_down_EDF, hits_E):
    """MoELayer's path for steps over MOE_MAX_TOKENS, at the fixed (capturable) capacity."""
    comm = ExpertComm.local()
    ids_TK, weights_TK, counts_E = moe_dispatch.gate(x_TD, w_gate_ED, TOP_K, True)
    hits_E += counts_E
    capacity = moe_dispatch.step_capacity(x_TD.shape[0], TOP_K, NUM_EXPERTS, 256)
    x_PD, meta = moe_dispatch.dispatch(x_TD, ids_TK, weights_TK, counts_E, comm, capacity)
    return moe_dispatch.combine(dispatched_experts(x_PD, meta.offsets_L, w_gate_up_EGD, w_down_EDF), meta, comm)


def fused_moe(tiles):
    """fused_moe with these tiles (None: moe_tiles'), called like grouped_moe."""
    def run(x_TD, w_gate_ED, w_gate_up_EGD, w_down_EDF, hits_E):
        return moe_small.fused_moe_tiled(x_TD, w_gate_ED, w_gate_up_EGD, w_down_EDF, TOP_K, True, hits_E,
                                         tiles or moe_small.moe_tiles(x_TD.shape[0]))
    return run


def time_ms_per_layer(moe_fn, x_TD, layers, reps: int) -> float:
    """Median replay time of one CUDA graph running moe_fn over every layer copy, per layer."""
    hits_E = torch.zeros(NUM_EXPERTS, dtype=torch.int64, device=x_TD.device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for weights in layers:  # compile, warm up
            moe_fn(x_TD, *weights, hits_E)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for weights in layers:
            moe_fn(x_TD, *weights, hits_E)
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) / len(layers)


def kernel_us(moe_fn, x_TD, layers) -> dict:
    """Device time per layer of each kernel of one eager pass (torch.profiler), by kernel name."""
    from torch.profiler import ProfilerActivity, profile

    hits_E = torch.zeros(NUM_EXPERTS, dtype=torch.int64, device=x_TD.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for weights in layers:
            moe_fn(x_TD, *weights, hits_E)
        torch.cuda.synchronize()
    times = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name[:40]
            times[name] = times.get(name, 0.0) + event.device_time / len(layers)
    return {name: round(us, 2) for name, us in sorted(times.items(), key=lambda item: -item[1])}


def expert_bytes(x_TD, layers) -> float:
    """Expert weight bytes one layer reads on average: unique experts touched x 3 x D x F x 2."""
    unique = [moe_dispatch.gate(x_TD, w[0], TOP_K, True)[0].unique().numel() for w in layers]
    return statistics.mean(unique) * 3 * HIDDEN * WIDTH * 2, statistics.mean(unique)


def check(x_TD, weights) -> dict:
    """Largest differences on one layer: fused vs grouped (bf16), each vs the torch code in fp32."""
    hits_E = torch.zeros(NUM_EXPERTS, dtype=torch.int64, device=x_TD.device)
    fused_TD = fused_moe(None)(x_TD, *weights, hits_E).float()
    grouped_TD = grouped_moe(x_TD, *weights, hits_E).float()
    ref_TD = grouped_moe(x_TD.float(), *(w.float() for w in weights), hits_E)
    return {"fused_vs_grouped": (fused_TD - grouped_TD).abs().max().item(),
            "fused_vs_fp32": (fused_TD - ref_TD).abs().max().item(),
            "grouped_vs_fp32": (grouped_TD - ref_TD).abs().max().item(),
            "max_abs_out": ref_TD.abs().max().item()}


def candidate_tiles(num_tokens: int, gate_up: dict | None = None, down: dict | None = None):
    """The sweep's candidates for one T: every gate_up variant with moe_tiles' down, then
    (once gate_up is picked) every down variant with it."""
    base = dataclasses.asdict(moe_small.moe_tiles(num_tokens))
    if down is None:
        return [moe_small.MoeTiles(**{**base, **g}) for g in GATE_UP_CANDIDATES]
    return [moe_small.MoeTiles(**{**base, **gate_up, **d}) for d in DOWN_CANDIDATES]


def _compile(jobs) -> None:
    """Worker: runs each (T, tiles) once on zero weights, filling Triton's on-disk cache."""
    w_gate_ED, w_gate_up_EGD, w_down_EDF = (
        torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE)
        for shape in ((NUM_EXPERTS, HIDDEN), (NUM_EXPERTS, 2 * WIDTH, HIDDEN), (NUM_EXPERTS, HIDDEN, WIDTH)))
    hits_E = torch.zeros(NUM_EXPERTS, dtype=torch.int64, device=DEVICE)
    for num_tokens, tiles in jobs:
        x_TD = torch.randn(num_tokens, HIDDEN, dtype=torch.bfloat16, device=DEVICE)
        try:
            moe_small.fused_moe_tiled(x_TD, w_gate_ED, w_gate_up_EGD, w_down_EDF, TOP_K, True, hits_E, tiles)
        except triton.runtime.errors.OutOfResources:
            pass  # skipped again, and reported, when timed


def precompile(jobs, workers: int) -> None:
    """Compiles the sweep's kernels in parallel processes (the timing process then loads them)."""
    chunks = [jobs[i::workers] for i in range(workers)]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        pool.map(_compile, [c for c in chunks if c])


def sweep(x_by_T: dict, layers, reps: int) -> dict:
    """Per swept T: the fastest gate_up tiles, then the fastest down tiles with them."""
    picks, timings = {}, []
    for num_tokens in SWEEP_TOKENS:
        x_TD = x_by_T[num_tokens]
        best = {}
        for stage in ("gate_up", "down"):
            cands = candidate_tiles(num_tokens, *(() if stage == "gate_up" else (best["gate_up"], {})))
            results = []
            for tiles in cands:
                try:
                    ms = time_ms_per_layer(fused_moe(tiles), x_TD, layers, reps)
                except triton.runtime.errors.OutOfResources as error:
                    timings.append({"tokens": num_tokens, "stage": stage, "tiles": dataclasses.asdict(tiles),
                                    "error": str(error)[:80]})
                    continue
                results.append((ms, tiles))
                timings.append({"tokens": num_tokens, "stage": stage, "tiles": dataclasses.asdict(tiles), "ms": ms})
                print(f"sweep T={num_tokens} {stage} {tiles}: {ms * 1e3:.1f} us", flush=True)
            ms, tiles = min(results, key=lambda r: r[0])
            keys = GATE_UP_CANDIDATES[0] if stage == "gate_up" else DOWN_CANDIDATES[0]
            best[stage] = {k: getattr(tiles, k) for k in keys}
        picks[num_tokens] = {**best["gate_up"], **best["down"], "ms": ms}
        print(f"sweep T={num_tokens} best: {picks[num_tokens]}", flush=True)
    return {"picks": picks, "timings": timings}


def picked_tiles(picks: dict, num_tokens: int):
    """The sweep's tiles for T: those of the largest swept T <= T."""
    swept = max(t for t in SWEEP_TOKENS if t <= num_tokens)
    base = dataclasses.asdict(moe_small.moe_tiles(num_tokens))
    return moe_small.MoeTiles(**{**base, **{k: v for k, v in picks[swept].items() if k != "ms"}})


def main(argv=None) -> int:
    args = parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    layers = make_layers(args.layers)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    x_by_T = {t: torch.randn(t, HIDDEN, dtype=torch.bfloat16, device=DEVICE, generator=g)
              for t in sorted(set(tokens) | set(SWEEP_TOKENS))}
    result = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
              "layers": args.layers, "reps": args.reps,
              "command": "python bench/kernels/moe_small_batch.py "
                         + " ".join(argv if argv is not None else sys.argv[1:])}
    if args.sweep:
        jobs = [(t, tiles) for t in SWEEP_TOKENS for tiles in candidate_tiles(t) + candidate_tiles(t, {}, {})]
        precompile(jobs, args.compile_workers)
        result["sweep"] = sweep(x_by_T, layers, args.reps)
    rows = []
    for num_tokens in tokens:
        x_TD = x_by_T[num_tokens]
        tiles = picked_tiles(result["sweep"]["picks"], num_tokens) if args.sweep else None
        num_bytes, unique = expert_bytes(x_TD, layers)
        fused_ms = time_ms_per_layer(fused_moe(tiles), x_TD, layers, args.reps)
        grouped_ms = time_ms_per_layer(grouped_moe, x_TD, layers, args.reps)
        row = {"tokens": num_tokens, "unique_experts": unique, "fused_ms": fused_ms, "grouped_ms": grouped_ms,
               "fused_GBps": num_bytes / fused_ms / 1e6, "grouped_GBps": num_bytes / grouped_ms / 1e6,
               "tiles": dataclasses.asdict(tiles or moe_small.moe_tiles(num_tokens)), **check(x_TD, layers[0]),
               "fused_kernel_us": kernel_us(fused_moe(tiles), x_TD, layers)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result["rows"] = rows
    table = markdown(result)
    print(table)
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "moe_small_batch_h200.json").write_text(json.dumps(result, indent=1))
        (out / "moe_small_batch_h200.md").write_text(table)
    return 0


def markdown(result: dict) -> str:
    lines = [f"# Fused vs grouped MoE, one Qwen3-30B-A3B layer, {result['gpu']}", "",
             f"`{result['command']}` ({result['layers']} layer copies per CUDA graph, median of {result['reps']}"
             " replays; GB/s = unique experts x 3 x D x F x 2 bytes / MoE time)", "",
             "| T | experts | fused us/layer | fused GB/s | grouped us/layer | grouped GB/s | fused-grouped |"
             " fused-fp32 | grouped-fp32 | tiles: gate_up f/d/stages/warps, down o/f/warps |",
             "|" + "---:|" * 9 + "---|"]
    for r in result["rows"]:
        t = r["tiles"]
        lines.append(f"| {r['tokens']} | {r['unique_experts']:.1f} | {r['fused_ms'] * 1e3:.1f} | {r['fused_GBps']:.0f} "
                     f"| {r['grouped_ms'] * 1e3:.1f} | {r['grouped_GBps']:.0f} | {r['fused_vs_grouped']:.2g} "
                     f"| {r['fused_vs_fp32']:.2g} | {r['grouped_vs_fp32']:.2g} | gu {t['gate_up_f']}/{t['gate_up_d']}"
                     f"/{t['gate_up_stages']}/{t['gate_up_warps']}, dn {t['down_o']}/{t['down_f']}/{t['down_warps']} |")
    lines += ["", "Fused MoE device time per layer by kernel (us, torch.profiler, one eager pass):", ""]
    lines += [f"- T={r['tokens']}: " + ", ".join(f"{name} {us}" for name, us in r["fused_kernel_us"].items())
              for r in result["rows"]]
    if "sweep" in result:
        lines += ["", "Sweep picks (ms per layer):", ""]
        lines += [f"- T={t}: {p}" for t, p in result["sweep"]["picks"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
