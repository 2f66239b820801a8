"""One CUDA-graph decode step of the Qwen3-30B-A3B shape cut to a few layers, in bf16, FP8 and AWQ.

    python -m bench.kernels.quant_decode_step --layers 8 --rows 1,64

Random weights drawn on the GPU for each preset (services/model/random_weights.py), the model
built as the expert service builds it, one decode graph per row count (context 256), 50 replays
timed after 3 warm ones. Prints each preset's quantized path (quant.dispatch's choice and its
reason) and MoE backend, then ms per step: what a decode token costs in the layers alone, without
the mesh, the LM head or sampling (quantized GPU work, docs/performance.md). --profile K adds the
K kernels of one eager step with the most device time (the graph replays the same kernels), and
their sum: where a step's time goes, kernel by kernel.
"""

import argparse
import dataclasses
import time

import torch

from bench.kernels.kernel_profile import top_kernels
from expert_svc.graph_runner import DecodeGraphRunner
from services.kv_pool import KVPool
from services.model.batch import SeqInput, build_forward_batch
from services.model.qwen3_moe import Qwen3MoeModel
from services.model.random_weights import RandomWeights, preset

PRESETS = ("qwen3-30b-a3b", "qwen3-30b-a3b-fp8", "qwen3-30b-a3b-awq")
CONTEXT = 256
BLOCK = 16


def step_ms(model, config, rows: int, replays: int = 50, profile: int = 0) -> float:
    """Mean ms of one replayed decode step of `rows` sequences at CONTEXT tokens; profile > 0
    prints that many of one eager step's kernels by device time."""
    blocks = CONTEXT // BLOCK + 1
    kv = KVPool.for_model(config, rows * blocks, BLOCK, torch.bfloat16, "cuda")
    graphs = DecodeGraphRunner(model, kv, BLOCK, buckets=(rows,), max_blocks=blocks)
    seqs = [SeqInput(i, [7 + i], CONTEXT, list(range(i * blocks, (i + 1) * blocks)), True) for i in range(rows)]
    capacity = model.dispatch_capacity(rows)
    for _ in range(3):
        graphs.run(seqs, capacity)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        out = graphs.run(seqs, capacity)
    out.greedy_S.tolist()  # waits for the last replay
    elapsed_ms = (time.perf_counter() - start) / replays * 1e3
    if profile:
        batch = build_forward_batch(seqs, BLOCK, "cuda")
        kernels = top_kernels(lambda: model.forward_at_capacity(batch, kv, capacity), torch.device("cuda"), limit=1000)
        total = sum(k["total_us"] for k in kernels)
        launches = sum(k["calls"] for k in kernels)
        print(f"  one eager step of {rows} rows: {launches} kernels, {total:.1f} us of device time")
        for k in kernels[:profile]:
            print(f"  {k['total_us']:9.1f} us {k['total_us'] / total:6.1%} {k['calls']:5d} x {k['us_per_call']:8.2f}  "
                  f"{k['name'][:110]}")
    return elapsed_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", default="1,64", help="comma list of decode batch sizes")
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--profile", type=int, default=0, metavar="K",
                        help="also print the K kernels of one eager step with the most device time")
    args = parser.parse_args()
    for name in args.presets.split(","):
        config = dataclasses.replace(preset(name), num_hidden_layers=args.layers)
        weights = RandomWeights.for_preset(name, config, range(config.num_experts), 0, dtype=torch.bfloat16,
                                           device="cuda")
        model = Qwen3MoeModel(config, weights, expert_ids=range(config.num_experts), dtype=torch.bfloat16,
                              device="cuda", attention="triton")
        del weights
        paths = {method: (p.path, p.reason) for method, p in model.quant_paths.items()}
        print(name, paths, type(model.layers[0].feed_forward.backend).__name__)
        for rows in (int(r) for r in args.rows.split(",")):
            ms = step_ms(model, config, rows, profile=args.profile)
            print(f"{name}: {rows} rows: {ms:.3f} ms per step ({args.layers} layers)")
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
