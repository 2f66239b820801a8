"""What L2 could give the batch-1 GEMVs: one token's gemv with its weight in HBM or in L2 (issue 8).

    python -m bench.l2_probe --out DIR

For the o (4096 -> 2048) and q|k|v (2048 -> 5120) weights of Qwen3-30B-A3B, bf16, plain
launches replayed in a CUDA graph (decode_b1.graph_us), us per call:
- cold: 48 weight copies in turn (L2 holds none of them: 0.8-1 GB read per replay);
- hot: one copy 48 times (after the first call it sits in L2, 50 MB on an H200);
- prefetched: 48 copies, each call behind triton_fused.prefetch_l2 of its weight on the side
  stream (each L2_PREFETCH_HOW) and a 20 us spin (torch.cuda._sleep) on the main one, standing in for the attention;
  against the same spin without the prefetch ("spin only"): what the prefetch saves once it
  has had time to land.
Writes l2_probe.json and l2_probe.md.
"""

import argparse
import json
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.decode_b1 import COPIES, graph_us  # noqa: E402
from services.model import triton_fused  # noqa: E402

SHAPES = {"o": (2048, 4096), "qkv": (5120, 2048)}
SPIN_CYCLES = 40_000  # about 20 us at the H200's 1.98 GHz


def probe(shape: tuple[int, int]) -> dict:
    weights = [torch.randn(shape, device="cuda").bfloat16() for _ in range(COPIES)]
    x = torch.randn(1, shape[1], device="cuda").bfloat16()
    tiles = triton_fused.GEMV_TILES_BY_SHAPE.get(shape, triton_fused.GEMV_TILES)

    def prefetched(i):
        triton_fused.prefetch_l2(weights[i])
        torch.cuda._sleep(SPIN_CYCLES)
        triton_fused.gemv(x, weights[i], tiles)
        triton_fused.join_prefetches(x.device)

    def spin_only(i):
        torch.cuda._sleep(SPIN_CYCLES)
        triton_fused.gemv(x, weights[i], tiles)

    row = {"cold": graph_us(lambda i: triton_fused.gemv(x, weights[i], tiles)),
           "hot": graph_us(lambda i: triton_fused.gemv(x, weights[0], tiles)),
           "spin only": graph_us(spin_only), "prefetched": graph_us(prefetched)}
    row["prefetch saves"] = row["spin only"] - row["prefetched"]
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    triton_fused.PDL = False  # plain launches: uses_pdl is False, gemv and the spin in stream order
    rows = {}
    for name, shape in SHAPES.items():
        for how in ("line", "bulk", "load"):
            triton_fused.L2_PREFETCH_HOW = how
            rows[f"{name} {how}"] = probe(shape)
            print(name, how, json.dumps(rows[f"{name} {how}"]), flush=True)
    columns = ["cold", "hot", "spin only", "prefetched", "prefetch saves"]
    lines = [f"# One token's gemv, weight in HBM or in L2 ({torch.cuda.get_device_name()})", "",
             "Command: `python -m bench.l2_probe --out DIR`; us per call, plain launches in a CUDA graph", "",
             "| weight | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    lines += [f"| {name} | " + " | ".join(f"{row[c]:.2f}" for c in columns) + " |" for name, row in rows.items()]
    (args.out / "l2_probe.md").write_text("\n".join(lines) + "\n")
    (args.out / "l2_probe.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
