"""A tiny kernel for tests/bench/kernels/test_sass_stats.py, compiled for sm_90 in its own process (the test
session has TRITON_INTERPRET set, which the compiler's front end reads): `python -m
tests.bench.kernels.sass_tiny_kernel` catches its launch on meta tensors, compiles it, and prints the grid,
the registers and the hot loop's LoopStats as JSON."""

import dataclasses
import json

import torch
import triton
import triton.language as tl

from bench.kernels import sass_parse, sass_stats


@triton.jit
def sum_rows(x_ptr, y_ptr, num_rows, BLOCK: tl.constexpr):
    """y[c] = sum over rows of x[:, c], one block of columns a program: a loop of 16-byte loads."""
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for r in range(num_rows):
        acc += tl.load(x_ptr + r * 1024 + c)
    tl.store(y_ptr + c, acc)


def main() -> None:
    x, y = (torch.empty(n, dtype=torch.float32, device="meta") for n in (64 * 1024, 1024))
    with sass_stats.caught_launches() as launches:
        sum_rows[(8,)](x, y, 64, BLOCK=128, num_warps=1)
    sass, usage = sass_stats.cubin_texts(sass_stats.compile_launch(launches[0]).asm["cubin"])
    print(json.dumps({"launches": [[list(lc.grid), lc.kwargs["BLOCK"]] for lc in launches],
                      "registers": sass_stats.resources(usage)["REG"],
                      "loop": dataclasses.asdict(sass_parse.loop_stats(sass))}))


if __name__ == "__main__":
    main()
