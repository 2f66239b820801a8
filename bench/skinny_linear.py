"""triton_fused.skinny_linear against F.linear (cuBLAS) for the dense projections at decode sizes.

    python3 -m bench.skinny_linear --tokens 128,256 --out bench/results     # on a GPU

The q|k|v and o projections read the same weights (38 MB a layer for
Qwen3-30B-A3B) whatever the batch, so at 128 tokens a rank (N=2 at c256) they
cost as much as at 256; cuBLAS reads them at about 2-2.5 TB/s there. For each
weight shape and token count: F.linear and skinny_linear at each candidate tile,
20 calls captured in one CUDA graph (us per call, mean of --reps replays), the
weights' GB/s, and the largest difference from F.linear. Writes
skinny_linear_<gpu>.md / .json.
"""

import argparse
import json
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.moe_large_batch import time_ms  # noqa: E402
from services.model import triton_fused  # noqa: E402

# Qwen3-30B-A3B's dense weights [N, D]: q|k|v, o; and the lm_head (once a step).
SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096), "lm_head": (151936, 2048)}
TILES = [(n, k, st, w) for n in (16, 32, 64) for k in (64, 128) for st in (3, 4, 5) for w in (4, 8)]
CALLS = 20  # per graph


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="128,256")
    p.add_argument("--shapes", default="qkv,o")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    return p.parse_args(argv)


def per_call_us(fn, reps: int) -> float:
    return 1e3 * time_ms(lambda: [fn() for _ in range(CALLS)], reps, True) / CALLS


def bench(shape_name: str, num_tokens: int, reps: int) -> dict:
    n, d = SHAPES[shape_name]
    g = torch.Generator(device="cuda").manual_seed(n + num_tokens)
    x = torch.randn(num_tokens, d, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, d, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    expected = torch.nn.functional.linear(x, w)
    row = {"shape": shape_name, "N": n, "D": d, "tokens": num_tokens, "weight_MB": n * d * 2 / 1e6,
           "f_linear_us": per_call_us(lambda: torch.nn.functional.linear(x, w), reps), "tiles": {}}
    for tile in TILES:
        tiles = triton_fused.SkinnyTiles(*tile)
        try:
            diff = (triton_fused.skinny_linear(x, w, tiles).float() - expected.float()).abs().max().item()
            row["tiles"][str(tile)] = {"us": per_call_us(lambda: triton_fused.skinny_linear(x, w, tiles), reps),
                                       "max_abs_diff": diff}
        except Exception as error:  # noqa: BLE001 (a tile that does not fit: recorded, skipped)
            row["tiles"][str(tile)] = {"error": repr(error)[:200]}
    timed = {t: v["us"] for t, v in row["tiles"].items() if "us" in v}
    row["best"] = min(timed, key=timed.get)
    row["best_us"] = timed[row["best"]]
    print(json.dumps({k: v for k, v in row.items() if k != "tiles"}), flush=True)
    return row


def markdown(result: dict) -> str:
    lines = ["# skinny_linear against F.linear at decode sizes (" + result["env"]["gpu"] + ")", "",
             f"Command: `{result['command']}`", "", f"Environment: {json.dumps(result['env'])}", "",
             f"us per call ({CALLS} calls in one CUDA graph, mean over the replays); GB/s of the weight; diff: the "
             "best tile's largest |skinny - F.linear| (bf16 outputs), against the largest |F.linear|.", "",
             "| weight | N x D | tokens | F.linear us | GB/s | best tile (n, k, stages, warps) | skinny us | GB/s | "
             "speed-up | diff |", "|---|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        best = r["tiles"][r["best"]]
        lines.append(f"| {r['shape']} | {r['N']} x {r['D']} | {r['tokens']} | {r['f_linear_us']:.2f} | "
                     f"{r['weight_MB'] / r['f_linear_us'] * 1e3:.0f} | {r['best']} | {r['best_us']:.2f} | "
                     f"{r['weight_MB'] / r['best_us'] * 1e3:.0f} | {r['f_linear_us'] / r['best_us']:.2f}x | "
                     f"{best['max_abs_diff']:.3g} |")
    return "\n".join(lines + [""])


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    rows = [bench(shape, int(t), args.reps) for shape in args.shapes.split(",") for t in args.tokens.split(",")]
    gpu = torch.cuda.get_device_name()
    result = {"command": " ".join(["python3 -m bench.skinny_linear"] + sys.argv[1:]), "rows": rows,
              "wall_s": time.perf_counter() - started,
              "env": {"torch": torch.__version__, "gpu": gpu, "cuda": torch.version.cuda}}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "skinny_linear_" + ("h200" if "H200" in gpu else gpu.replace(" ", "_").lower())
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (out / f"{stem}.md").write_text(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
