"""The batch-1 decode step on one GPU with the single-token kernels of services/model/kernels/ (issue 8).

    python -m bench.kernels.decode_b1 --out DIR [--parts kernels,moe,model]

1. kernels: at one token, each on 48 weight copies (so L2 holds none of them) replayed
   in a CUDA graph, bf16, plain launches: F.linear against gemv over a sweep of GemvTiles
   for the q|k|v (2048 -> 5120), o (4096 -> 2048) and gate (2048 -> 128) products, and
   the gate + routing (top-8 of 128) as F.linear + route, gemv + route and gate_route
   over its splits; each with its largest difference from F.linear relative to the
   largest output (route: ids equal). Picks the tiles with the least q|k|v + o + gate
   time (GEMV_TILES), each shape's fastest where another (GEMV_TILES_BY_SHAPE) and
   gate_route's fastest split; then times the picks again as programmatic dependent
   launches (PDL).
2. moe: fused_moe at one token on 8 layer copies, plain launches: the tl.dot kernels,
   FMA_MOE_TILES (the code before the one-token kernels) and the one-token kernels, each of
   these swept on its own (gate_up, then down with the gate_up pick); the pick with PDL
   (kept where faster, same bits); every output against a torch
   reference with the same roundings (largest difference over the largest output, share of
   equal elements); the kernels' device time (torch.profiler) before and after; and
   diagnostics of where the one-token kernels' time goes (moe_diagnostics).
3. model: the serving model (Qwen3-30B-A3B shape, random weights, --layers layers), one
   sequence with --context cached tokens: one decode step as a CUDA graph, timed over
   replays with SINGLE_TOKEN_KERNELS off ("cublas"), with BEFORE (the code before this
   version) and with the picks ("after", and without PDL where it is on);
   eager == graph logits for each, one eager step of each profiled, and the logits of
   each and of the torch code (ENABLED False) against each other.
   Writes decode_b1.json (after each part).
"""

import argparse
import contextlib
import dataclasses
import json
import pathlib
import sys

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from services.kv_pool import KVPool  # noqa: E402
from services.model.kernels import gemv, launch, moe_small, routing  # noqa: E402
from services.model.batch import SeqInput, build_forward_batch  # noqa: E402
from services.model.qwen3_moe import Qwen3MoeModel  # noqa: E402
from services.model.random_weights import RandomWeights, preset  # noqa: E402

COPIES = 48
# GemvTiles (block_n, block_k, stages, warps), the default first (the one-stage variants of
# the first run, in the git history of bench/results/decode_b1_h200.md, all lost to it).
SWEEP = [(8, 512, 3, 4), (4, 512, 3, 4), (8, 512, 4, 4), (8, 256, 4, 4), (4, 1024, 2, 4), (8, 512, 5, 4),
         (16, 512, 3, 8)]
SHAPES = {"qkv": (5120, 2048), "o_proj": (2048, 4096), "gate": (128, 2048)}
# gate_route (splits, experts per program, warps), the default first.
GATE_ROUTE_SWEEP = [(16, 8, 4), (32, 8, 4), (16, 4, 4), (8, 8, 4)]
MOE_COPIES = 8
# The one-token expert kernels: gate_up (f, d, stages, warps), then down (o, f, stages, warps)
# with the gate_up pick; each the default first.
GATE_UP_SWEEP = [(2, 2048, 1, 4), (8, 512, 3, 4), (8, 256, 4, 4), (2, 2048, 1, 2), (1, 2048, 1, 2), (4, 2048, 1, 8),
                 (4, 1024, 2, 4), (2, 1024, 2, 4)]
DOWN_SWEEP = [(4, 128, 3, 4), (8, 128, 3, 4), (4, 128, 4, 4), (4, 64, 4, 4), (8, 64, 4, 4), (2, 128, 3, 2),
              (4, 128, 3, 2), (16, 64, 3, 4)]
GATE_UP_FIELDS = ("gate_up_f", "gate_up_d", "gate_up_stages", "gate_up_warps")
DOWN_FIELDS = ("down_o", "down_f", "down_stages", "down_warps")


def graph_us(fn, calls: int = COPIES, replays: int = 20) -> float:
    """Microseconds per call of fn(i) for i < calls, captured once and replayed."""
    for i in range(calls):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * calls)


def rel_diff(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def kernels() -> dict:
    with switches(PDL=False):
        out = gemv_and_gate_sweep()
    with switches(PDL=True):  # the picks again, as dependent launches
        out["with_pdl"] = pdl_rows()
    print("with pdl", json.dumps(out["with_pdl"]), flush=True)
    return out


def pdl_rows() -> dict:
    """The picked gemv tiles per shape and gate_route, us per call, with PDL on."""
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(COPIES, n, k, generator=g, device="cuda").to(torch.bfloat16) / k ** 0.5
        xk = torch.randn(1, k, generator=g, device="cuda").to(torch.bfloat16)
        tiles = gemv.GEMV_TILES_BY_SHAPE.get((n, k), gemv.GEMV_TILES)
        rows[name] = round(graph_us(lambda i: gemv.gemv(xk, w[i], tiles)), 2)
        if name == "gate":
            hits = torch.zeros(n, dtype=torch.int64, device="cuda")
            rows["gate_route"] = round(graph_us(lambda i: routing.gate_route(xk, w[i], 8, True, hits)), 2)
    return rows


def gemv_and_gate_sweep() -> dict:
    out, g = {}, torch.Generator(device="cuda").manual_seed(0)
    weights = {name: torch.randn(COPIES, n, k, generator=g, device="cuda").to(torch.bfloat16) / k ** 0.5
               for name, (n, k) in SHAPES.items()}
    x = {k: torch.randn(1, k, generator=g, device="cuda").to(torch.bfloat16) for k in (2048, 4096)}
    for name, (n, k) in SHAPES.items():
        w, xk = weights[name], x[k]
        rows = {"F.linear": {"us": graph_us(lambda i: F.linear(xk, w[i]))}}
        ref = F.linear(xk, w[0])
        for tiles in SWEEP:
            t = gemv.GemvTiles(*tiles)
            rows[str(tiles)] = {"us": graph_us(lambda i: gemv.gemv(xk, w[i], t)),
                                "rel_diff": rel_diff(gemv.gemv(xk, w[0], t), ref)}
        for row in rows.values():
            row["TB_s"] = round(n * k * 2 / row["us"] / 1e6, 2)
            row["us"] = round(row["us"], 2)
        out[name] = rows
        print(name, json.dumps(rows), flush=True)
    total = {c: sum(out[name][c]["us"] for name in SHAPES) for c in map(str, SWEEP)}
    best = min(SWEEP, key=lambda c: total[str(c)])
    out["gemv_pick"] = {"tiles": best, "us_qkv_o_gate": round(total[str(best)], 2),
                        "us_f_linear": round(sum(out[name]["F.linear"]["us"] for name in SHAPES), 2)}
    best_per_shape = {name: min(SWEEP, key=lambda c: out[name][str(c)]["us"]) for name in SHAPES}
    out["gemv_best_per_shape"] = best_per_shape
    gemv.GEMV_TILES = gemv.GemvTiles(*best)
    gemv.GEMV_TILES_BY_SHAPE = {SHAPES[name]: gemv.GemvTiles(*c) for name, c in best_per_shape.items()
                                        if c != best}
    w, xk = weights["gate"], x[2048]
    hits = torch.zeros(128, dtype=torch.int64, device="cuda")
    ref = routing.route(F.linear(xk, w[0]), 8, True, hits, xk.dtype)
    rows = {"F.linear+route": {"us": graph_us(
                lambda i: routing.route(F.linear(xk, w[i]), 8, True, hits, xk.dtype))},
            "gemv+route": {"us": graph_us(lambda i: routing.route(
                gemv.gemv(xk, w[i], gemv.GEMV_TILES), 8, True, hits, xk.dtype))}}
    got = routing.route(gemv.gemv(xk, w[0], gemv.GEMV_TILES), 8, True, hits, xk.dtype)
    rows["gemv+route"].update(ids_equal=bool(torch.equal(got[0], ref[0])), weights_rel_diff=rel_diff(got[1], ref[1]))
    for splits, experts, warps in GATE_ROUTE_SWEEP:
        routing.GATE_ROUTE_SPLITS, routing.GATE_ROUTE_EXPERTS = splits, experts
        routing.GATE_ROUTE_WARPS = warps
        got = routing.gate_route(xk, w[0], 8, True, hits)
        rows[f"gate_route {splits} {experts} {warps}"] = {
            "us": graph_us(lambda i: routing.gate_route(xk, w[i], 8, True, hits)),
            "ids_equal": bool(torch.equal(got[0], ref[0])), "weights_rel_diff": rel_diff(got[1], ref[1]),
            "splits": splits, "experts": experts, "warps": warps}
    for row in rows.values():
        row["us"] = round(row["us"], 2)
    pick = min((r for r in rows.values() if "splits" in r), key=lambda r: r["us"])
    routing.GATE_ROUTE_SPLITS, routing.GATE_ROUTE_EXPERTS = pick["splits"], pick["experts"]
    routing.GATE_ROUTE_WARPS = pick["warps"]
    out["gate_route"] = rows
    out["gate_pick"] = {"splits": pick["splits"], "experts": pick["experts"], "warps": pick["warps"],
                        "faster_than_gemv_route": pick["us"] < rows["gemv+route"]["us"]}
    print("gate", json.dumps(rows), "\npicks", out["gemv_pick"], out["gate_pick"], flush=True)
    return out


def moe_reference(x, w_gate_up, w_down, ids, weights):
    """One token's experts in torch, rounded as moe_experts.experts and moe_dispatch.combine round."""
    total = torch.zeros_like(x, dtype=torch.float32)
    for k, e in enumerate(ids[0].tolist()):
        gate, up = F.linear(x, w_gate_up[e]).chunk(2, dim=-1)
        total += F.linear(F.silu(gate) * up, w_down[e]) * weights[0, k]
    return total.to(x.dtype)


def versus(got, ref) -> dict:
    return {"rel_diff": rel_diff(got, ref), "equal_frac": round((got == ref).float().mean().item(), 4)}


def kernel_profile(fn, calls: int) -> dict:
    """Device us per launch of each kernel fn(i) runs, i < calls, eager (torch.profiler)."""
    for i in range(calls):
        fn(i)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            for i in range(calls):
                fn(i)
        torch.cuda.synchronize()
    return {e.key: round(e.self_device_time_total / e.count, 2) for e in prof.key_averages() if e.count}


@contextlib.contextmanager
def switches(**values):
    """The kernel modules' switches (SWITCH_MODULES) set to values inside the block."""
    saved = {name: getattr(SWITCH_MODULES[name], name) for name in values}
    set_switches(values)
    try:
        yield
    finally:
        set_switches(saved)


def set_switches(values: dict) -> None:
    """Each switch `name` set on its module (SWITCH_MODULES)."""
    for name, value in values.items():
        setattr(SWITCH_MODULES[name], name, value)


def moe_one_token() -> dict:
    """fused_moe at one token over MOE_COPIES layer copies: the tl.dot kernels, the FMA tiles
    (before) and the one-token kernels, each kernel of which is swept on its own, all as plain
    launches; then the pick with programmatic dependent launches (PDL, kept if faster), and
    where the one-token kernels' time goes (diagnostics)."""
    e, d, f = 128, 2048, 768
    w_gate = torch.randn(MOE_COPIES, e, d, device="cuda", dtype=torch.bfloat16)
    w_gate_up = torch.randn(MOE_COPIES, e, 2 * f, d, device="cuda", dtype=torch.bfloat16) * 0.02
    w_down = torch.randn(MOE_COPIES, e, d, f, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, d, device="cuda", dtype=torch.bfloat16)
    hits = torch.zeros(e, dtype=torch.int64, device="cuda")
    routes = [routing.gate_route(x, w_gate[i], 8, True, hits)[:2] for i in range(MOE_COPIES)]
    ref = moe_reference(x, w_gate_up[0], w_down[0], *routes[0])

    def run(tiles, i):
        return moe_small.fused_moe_tiled(x, w_gate[i], w_gate_up[i], w_down[i], 8, True, hits, tiles)

    def layer_row(tiles):
        return {"us": round(graph_us(lambda i: run(tiles, i), calls=MOE_COPIES), 2), **versus(run(tiles, 0), ref)}

    plain = dict(PDL=False)
    dot = dataclasses.replace(moe_small.FMA_MOE_TILES, gate_up_f=32, gate_up_d=256, gate_up_stages=4,
                           gate_up_fma=False)  # moe_tiles' tl.dot tiles below 16 tokens
    with switches(**plain):
        layers = {"tl.dot": layer_row(dot), "fma (before)": layer_row(moe_small.FMA_MOE_TILES),
                  "one_token default": layer_row(moe_small.ONE_TOKEN_MOE_TILES)}
        print("moe layers", json.dumps(layers), flush=True)
        sweep, best = {"gate_up": {}, "down": {}}, moe_small.ONE_TOKEN_MOE_TILES
        acts = [moe_small.one_token_gate_up(x, routes[i][0], w_gate_up[i], best) for i in range(MOE_COPIES)]
        launches = {"gate_up": lambda t, i: moe_small.one_token_gate_up(x, routes[i][0], w_gate_up[i], t),
                     "down": lambda t, i: moe_small.one_token_down(acts[i], *routes[i], w_down[i], t)}
        for kernel, candidates, fields in (("gate_up", GATE_UP_SWEEP, GATE_UP_FIELDS),
                                           ("down", DOWN_SWEEP, DOWN_FIELDS)):
            for cand in candidates:
                t = dataclasses.replace(best, **dict(zip(fields, cand)))
                try:
                    row = {"us": round(graph_us(lambda i: launches[kernel](t, i), calls=MOE_COPIES), 2),
                           **versus(moe_small.one_token_experts(x, *routes[0], w_gate_up[0], w_down[0], t), ref)}
                except Exception as err:  # a candidate that fails to compile or run is recorded, not fatal
                    row = {"error": repr(err)[:300]}
                sweep[kernel][str(cand)] = row
            pick = min((c for c in candidates if "us" in sweep[kernel][str(c)]),
                       key=lambda c: sweep[kernel][str(c)]["us"])
            best = dataclasses.replace(best, **dict(zip(fields, pick)))
            print("moe", kernel, json.dumps(sweep[kernel]), "pick", pick, flush=True)
        layers["one_token pick"] = layer_row(best)
        plain_out = run(best, 0)
        diagnostics = moe_diagnostics(x, w_gate_up, w_down, routes, acts, best)
    with switches(PDL=True):
        layers["one_token pick pdl"] = dict(layer_row(best), equal_to_pick=bool(torch.equal(run(best, 0), plain_out)))
    moe_small.ONE_TOKEN_MOE_TILES = best
    launch.PDL = layers["one_token pick pdl"]["us"] < layers["one_token pick"]["us"]
    kernels_us = {}
    for name, tiles, pdl in (("fma (before)", moe_small.FMA_MOE_TILES, False), ("one_token pick", best, False),
                             ("one_token pick pdl", best, True)):
        with switches(PDL=pdl):
            kernels_us[name] = kernel_profile(lambda i: run(tiles, i), MOE_COPIES)
    print("moe layers", json.dumps(layers), "\nkernels", json.dumps(kernels_us), "\ndiagnostics",
          json.dumps(diagnostics), flush=True)
    return {"layers": layers, "sweep": sweep, "kernel_us": kernels_us, "diagnostics": diagnostics,
            "pick": repr(best), "pdl": launch.PDL}


def moe_diagnostics(x, w_gate_up, w_down, routes, acts, tiles) -> dict:
    """The one-token kernels (plain launches, us per call) on the 8 copies as swept, on copy 0
    only (each call other experts of the same 805 MB: fewer address translations to cache), and
    gate_up on experts 0-7 of each copy (one contiguous 50 MB)."""
    first8 = torch.arange(8, device="cuda")[None]
    calls = {"gate_up": lambda i: moe_small.one_token_gate_up(x, routes[i][0], w_gate_up[i], tiles),
             "gate_up copy 0": lambda i: moe_small.one_token_gate_up(x, routes[i][0], w_gate_up[0], tiles),
             "gate_up experts 0-7": lambda i: moe_small.one_token_gate_up(x, first8, w_gate_up[i], tiles),
             "down": lambda i: moe_small.one_token_down(acts[i], *routes[i], w_down[i], tiles),
             "down copy 0": lambda i: moe_small.one_token_down(acts[i], *routes[i], w_down[0], tiles)}
    return {name: round(graph_us(fn, calls=MOE_COPIES), 2) for name, fn in calls.items()}


# The module switches this script sets, by name: where each is read at call time.
SWITCH_MODULES = {"GEMV_TILES": gemv, "GEMV_TILES_BY_SHAPE": gemv, "GATE_ROUTE_SPLITS": routing,
                  "GATE_ROUTE_EXPERTS": routing, "GATE_ROUTE_WARPS": routing, "ONE_TOKEN_MOE_TILES": moe_small,
                  "PDL": launch, "ENABLED": launch, "SINGLE_TOKEN_KERNELS": launch}
SETTINGS = ("GEMV_TILES", "GEMV_TILES_BY_SHAPE", "GATE_ROUTE_SPLITS", "GATE_ROUTE_EXPERTS", "GATE_ROUTE_WARPS",
            "ONE_TOKEN_MOE_TILES", "PDL")
# The code before this script's second version: the first run's picks (in the git history of
# bench/results/decode_b1_h200.md), plain launches.
BEFORE = dict(GEMV_TILES=gemv.GemvTiles(8, 512, 3, 4), GEMV_TILES_BY_SHAPE={}, GATE_ROUTE_SPLITS=16,
              GATE_ROUTE_EXPERTS=8, GATE_ROUTE_WARPS=4, ONE_TOKEN_MOE_TILES=moe_small.FMA_MOE_TILES, PDL=False)


def settings() -> dict:
    return {name: getattr(SWITCH_MODULES[name], name) for name in SETTINGS}


def model_step(args) -> dict:
    """The step in these modes: "cublas" (SINGLE_TOKEN_KERNELS off), "before" (BEFORE), "after"
    (the current settings, i.e. the picks) and the picks without PDL where it is on (the same
    logits)."""
    config = dataclasses.replace(preset("qwen3-30b-a3b"), num_hidden_layers=args.layers)
    model = Qwen3MoeModel(config, RandomWeights(config, range(config.num_experts), 0, device="cuda"),
                          expert_ids=range(config.num_experts), dtype=torch.bfloat16, device="cuda",
                          attention="triton")
    block = 16
    per_seq = -(-(args.context + 1) // block)
    kv = KVPool.for_model(config, per_seq, block, torch.bfloat16, "cuda")
    kv.k_cache.normal_(), kv.v_cache.normal_()
    fb = build_forward_batch([SeqInput(0, [1234], args.context, list(range(per_seq)), True)], block, "cuda")
    capacity = model.dispatch_capacity(1)
    out, logits = {}, {}
    modes = {"cublas": dict(settings(), SINGLE_TOKEN_KERNELS=False),
             "before": dict(BEFORE, SINGLE_TOKEN_KERNELS=True), "after": dict(settings(), SINGLE_TOKEN_KERNELS=True)}
    if modes["after"]["PDL"]:
        modes["after_no_pdl"] = dict(modes["after"], PDL=False)
    for mode, values in modes.items():
        set_switches(values)
        eager = model.forward_at_capacity(fb, kv, capacity)
        static = torch.empty_like(eager)
        step_us = graph_us(lambda _: model.forward_at_capacity(fb, kv, capacity, logits_SV=static), calls=1,
                           replays=50)
        eager_again = model.forward_at_capacity(fb, kv, capacity)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            model.forward_at_capacity(fb, kv, capacity)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=40)
        kernel_us = sum(e.self_device_time_total for e in prof.key_averages())
        out[mode] = {"settings": {k: repr(v) for k, v in values.items()}, "graph_step_ms": round(step_us / 1000, 4),
                     "eager_kernel_sum_ms": round(kernel_us / 1000, 4),
                     "graph_equals_eager": bool(torch.equal(static, eager_again)),
                     "eager_repeat_equal": bool(torch.equal(eager, eager_again)), "profile": table}
        logits[mode] = eager
        print(mode, {k: v for k, v in out[mode].items() if k != "profile"}, "\n" + table, flush=True)
    launch.ENABLED = False  # the torch code: how far two bf16 paths drift apart over the layers
    logits["torch"] = model.forward_at_capacity(fb, kv, capacity)
    launch.ENABLED = launch.SINGLE_TOKEN_KERNELS = True
    pairs = [("after", "before"), ("before", "cublas"), ("after", "cublas"), ("before", "torch"), ("after", "torch")]
    for a, b in pairs + [("after", "after_no_pdl")] * ("after_no_pdl" in logits):
        out[f"{a}_vs_{b}"] = {"rel_diff": rel_diff(logits[a], logits[b]),
                              "equal": bool(torch.equal(logits[a], logits[b])),
                              "argmax_equal": bool(torch.equal(logits[a].argmax(-1), logits[b].argmax(-1)))}
    print({k: v for k, v in out.items() if "_vs_" in k}, flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--out", default=".")
    p.add_argument("--parts", default="kernels,moe,model", help="which of kernels,moe,model to run")
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    path = pathlib.Path(args.out) / "decode_b1.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    result = {"gpu": torch.cuda.get_device_name(), "args": vars(args)}
    for part, fn in (("kernels", kernels), ("moe", moe_one_token)):
        if part in parts:
            result[part] = fn()
            path.write_text(json.dumps(result, indent=1))
    # The picks as the kernel modules' source spells them (the model step below runs with them).
    result["picks"] = {name: repr(value) for name, value in settings().items()}
    path.write_text(json.dumps(result, indent=1))
    if "model" in parts:
        result["model"] = model_step(args)
        path.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
