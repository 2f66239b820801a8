"""Would warp specialization let the block-FP8 GEMM's tensor cores run while its steps are scaled? (issue 29)

    python -m bench.kernels.fp8_ws_probe                    # q|k|v and o at 2,048-8,192 rows, one GPU
    python -m bench.kernels.fp8_ws_probe --rows 4096 --shapes qkv

The FP8 tensor-core GEMMs (quant_fp8.fp8_block_dot, quant_fp8_moe's grouped GEMMs) scale each
128-column step's product before adding it to the fp32 accumulator, and Triton waits for the tensor
cores before that scaling (compiled for sm_90: QGMMA, then `WARPGROUP.DEPBAR.LE gsb0, 0x0`, then the
FFMAs; docs/performance.md). Triton's Hopper warp specialization (`tl.range(..., warp_specialize=True)`)
splits a loop into a loading warp group and consumer warp groups, so one group's scaling can overlap
another's tensor-core work; it compiles only where the operands come through tensor descriptors (TMA)
and the loop has no early exit, which the production kernels do not have yet (their rows are
gathered by pointer). This is the same GEMM written that way, standalone: `ws_linear` (A [M, K] and
W [N, K] float8 by tensor descriptors, A's row scales per 128-column group, W's per 128 x 128 block, a
tile within one weight block, bf16 out), timed with and without the warp specialization against
quant_fp8.linear (the production tensor-core path, activations quantized in both) and torch's bf16
matmul, one CUDA graph over weight copies (quant_kernels.time_us), with each output's largest
difference from quant_fp8.linear's. What the production kernels would gain if rewritten so.
"""

import argparse
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from services.model.kernels import quant_fp8
from services.model.kernels.quant_fp8 import BLOCK, FP8_BLOCK

SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096)}  # [N, K] of Qwen3-30B-A3B's q|k|v and o_proj
# (block_m, block_n, warps, stages); block_n divides 128 (one weight-scale block a tile).
TILES = [(128, 128, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3)]


@triton.jit
def _ws_linear_kernel(a_desc, w_desc, a_scale_ptr, w_scale_ptr, y_ptr, num_rows, out_features, in_features,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    m0 = tl.program_id(0) * BLOCK_M
    n0 = tl.program_id(1) * BLOCK_N
    m = m0 + tl.arange(0, BLOCK_M)
    n = n0 + tl.arange(0, BLOCK_N)
    m_mask = m < num_rows
    k_blocks = tl.cdiv(in_features, BLOCK)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(0, in_features, BLOCK, warp_specialize=WARP_SPECIALIZE):
        a = a_desc.load([m0, k0])  # rows and columns past the ends read as zeros
        w = w_desc.load([n0, k0])
        scale = (tl.load(a_scale_ptr + m * k_blocks + k0 // BLOCK, mask=m_mask, other=0.0)
                 * tl.load(w_scale_ptr + (n0 // BLOCK) * k_blocks + k0 // BLOCK))
        acc += tl.dot(a, w.T) * scale[:, None]
    tl.store(y_ptr + m.to(tl.int64)[:, None] * out_features + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & (n < out_features)[None, :])


def ws_linear(xq_MK: torch.Tensor, xs_MKb: torch.Tensor, w_NK: torch.Tensor, s_NbKb: torch.Tensor,
              tile: tuple[int, int, int, int], warp_specialize: bool, out_dtype=torch.bfloat16) -> torch.Tensor:
    """y = (xq * xs) @ (w * s)^T for float8 xq [M, K] (row scales xs per 128 columns) and w [N, K]
    (block scales s), K a multiple of 16 bytes' worth (TMA strides); tile (block_m, block_n, warps, stages)."""
    block_m, block_n, warps, stages = tile
    assert FP8_BLOCK % block_n == 0, "a tile must lie in one weight-scale block"
    num_rows, in_features = xq_MK.shape
    out_features = w_NK.shape[0]
    y = torch.empty(num_rows, out_features, dtype=out_dtype, device=xq_MK.device)
    a_desc = TensorDescriptor.from_tensor(xq_MK, [block_m, FP8_BLOCK])
    w_desc = TensorDescriptor.from_tensor(w_NK, [block_n, FP8_BLOCK])
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(out_features, block_n))
    _ws_linear_kernel[grid](a_desc, w_desc, xs_MKb, s_NbKb, y, num_rows, out_features, in_features,
                            BLOCK_M=block_m, BLOCK_N=block_n, WARP_SPECIALIZE=warp_specialize, num_warps=warps,
                            num_stages=stages)
    return y


def probe(rows: list[int], shapes: list[str], copies: int, reps: int) -> None:
    from bench.kernels.quant_kernels import _randn, dense_copies, time_us

    for name in shapes:
        n, k = SHAPES[name]
        weights = dense_copies(n, k, copies)
        for num_rows in rows:
            x = _randn(num_rows, k, scale=1.0, seed=7).bfloat16()
            flops = 2 * num_rows * n * k
            reference = quant_fp8.linear(x, *weights[0]["fp8"], kernel="fp8")
            line = [f"{name} M={num_rows}"]
            for label, run in [("bf16", lambda x, c: x @ c["bf16"].T),
                               ("quant_fp8.linear", lambda x, c: quant_fp8.linear(x, *c["fp8"], kernel="fp8"))] + [
                    (f"{'ws' if ws else 'tma'} {t[0]}x{t[1]} w{t[2]} st{t[3]}",
                     lambda x, c, t=t, ws=ws: ws_linear(*quant_fp8.quantize_act(x), *c["fp8"], t, ws))
                    for t in TILES for ws in (False, True)]:
                try:
                    us = time_us(run, x, weights, reps)
                    diff = (run(x, weights[0]).float() - reference.float()).abs().max().item()
                except Exception as error:  # noqa: BLE001 - a tile that does not compile is a result
                    line.append(f"{label}: failed ({str(error).splitlines()[0][:80]})")
                    continue
                line.append(f"{label} {us:.1f} us {flops / us / 1e6:.0f} TFLOP/s diff {diff:.3g}")
            print(" | ".join(line), flush=True)
        del weights


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="2048,4096,8192")
    p.add_argument("--shapes", default="qkv,o")
    p.add_argument("--copies", type=int, default=8)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    print(torch.cuda.get_device_name(), flush=True)
    probe([int(r) for r in args.rows.split(",")], args.shapes.split(","), args.copies, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
