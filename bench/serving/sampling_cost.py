"""The cost of one step's draws: sample_on_device for D rows over a V-token vocabulary (issue 8).

    python -m bench.serving.sampling_cost [--rows 256] [--vocab 151936] [--top-p 0.95] [--device cpu|cuda]

Prints the aten operations one call runs (torch.profiler: a count that does not depend on the
device, each one a kernel launch on a GPU) and the best of 3 wall times (a synchronize after each
on CUDA). The c256 step of bench/serving/gpu_speed.py with --sampling 0.8,0.95 draws 256 rows a step.
"""

import argparse
import time

import torch

from services.model.sampling import sample_on_device
from services.step import SamplingSpec


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)).to(args.device) * 3
    specs = [SamplingSpec(temperature=0.8, top_p=args.top_p, seed=i) for i in range(args.rows)]

    def draw():
        tokens = sample_on_device(logits, specs, list(range(args.rows)))
        if args.device != "cpu":
            torch.cuda.synchronize()
        return tokens

    draw()
    with torch.profiler.profile() as profile:
        draw()
    num_ops = sum(event.count for event in profile.key_averages())
    times = []
    for _ in range(3):
        start = time.perf_counter()
        draw()
        times.append(time.perf_counter() - start)
    print(f"rows {args.rows}, vocab {args.vocab}, top_p {args.top_p}, {args.device}: "
          f"{num_ops} aten ops, best of 3 {1e3 * min(times):.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
