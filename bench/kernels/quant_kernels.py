"""The FP8 and AWQ kernels against bf16 at Qwen3-30B-A3B's shapes, on CUDA (issue 29).

    python -m bench.kernels.quant_kernels --out bench/results          # every case
    python -m bench.kernels.quant_kernels --tokens 1,8 --cases moe     # a subset

For each step size M (--tokens, default 1, 8, 64, 256, 4096) and each case:

- `qkv`, `o`: the dense attention projections ([5120, 2048] and [2048, 4096]);
  bf16 (gemv.linear: the GEMV at one token, cuBLAS above), FP8 weight-only
  (quant_fp8.linear "weight-only"), FP8 tensor cores ("fp8": the activations
  quantized per token and group, weight-only at up to 16 rows), AWQ 4-bit.
- `moe`: one MoE layer of 128 experts, top-8, D 2048, F 768 (routing,
  alignment, the expert GEMMs, the combine); bf16 (moe_small.fused_moe up to
  16 tokens, moe_grouped.grouped_moe above), FP8 weight-only and tensor cores
  (quant_fp8_moe: the one-token GEMVs at one token, grouped_moe above), AWQ
  (quant_awq_moe likewise).

Random weights, --copies of each with their own values (so that the 50 MB L2
cannot serve one replay's weights to the next); one CUDA graph runs the kernel
on every copy, timed over --reps replays (median), per copy. Reported: us per
call, the weight bytes read per second (dense: the whole weight; moe: the experts
the step's tokens touch, with their scales and zeros) and TFLOP/s (2 M N K; moe:
2 x routed rows x 3 D F). The largest error against fp32 on the dequantized
weights, relative to the largest output, is reported beside each (first copy).

Writes quant_kernels_<gpu>.md / .json to --out (bench/serving/serve.py's write_result).
"""

import argparse
import pathlib
import sys

import torch

from bench.kernels.moe_small_batch import time_ms_per_layer
from bench.serving.serve import RESULTS_DIR, write_result
from services.model.kernels import (gemv, moe_grouped, moe_small, quant_awq, quant_awq_moe, quant_fp8, quant_fp8_moe,
                                    routing)
from services.model.kernels import quant_ref as ref

HIDDEN, WIDTH, NUM_EXPERTS, TOP_K = 2048, 768, 128, 8
DENSE = {"qkv": (5120, 2048), "o": (2048, 4096)}  # [N, K] of q|k|v and o_proj
DEVICE = "cuda"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,8,64,256,4096")
    p.add_argument("--cases", default="qkv,o,moe")
    p.add_argument("--copies", type=int, default=4, help="weight copies per graph replay (distinct values)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=str(RESULTS_DIR))
    return p.parse_args(argv)


def _randn(*shape, scale=0.02, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEVICE) * scale


def time_us(fn, x, copies: list, reps: int) -> float:
    """Median replay time of one CUDA graph calling fn(x, copy) for every copy, per copy, in us."""
    return 1e3 * time_ms_per_layer(lambda x_TD, c, hits_E: fn(x_TD, c), x, [(c,) for c in copies], reps)


def dense_copies(n: int, k: int, copies: int) -> list[dict]:
    """Each copy: the bf16 weight and its FP8 and AWQ forms, and the fp32 reference of each."""
    out = []
    for seed in range(copies):
        w = _randn(n, k, seed=seed)
        w8, s = ref.quant_fp8(w)
        awq = ref.quant_awq(w.T.contiguous())
        out.append({"bf16": w.bfloat16(), "fp8": (w8, s), "awq": awq, "ref_bf16": w.bfloat16().float(),
                    "ref_fp8": ref.dequant_fp8(w8, s), "ref_awq": ref.dequant_awq(*awq).T})
    return out


DENSE_VARIANTS = {
    "bf16": (lambda x, c: gemv.linear(x, c["bf16"]), lambda c: c["bf16"].numel() * 2),
    "fp8 weight-only": (lambda x, c: quant_fp8.linear(x, *c["fp8"], kernel="weight-only"),
                        lambda c: c["fp8"][0].numel() + c["fp8"][1].numel() * 4),
    "fp8": (lambda x, c: quant_fp8.linear(x, *c["fp8"], kernel="fp8"),
            lambda c: c["fp8"][0].numel() + c["fp8"][1].numel() * 4),
    "awq": (lambda x, c: quant_awq.linear(x, *c["awq"]), lambda c: sum(t.numel() * t.element_size() for t in c["awq"])),
}


def bench_dense(name: str, tokens: list[int], args) -> list[dict]:
    n, k = DENSE[name]
    copies = dense_copies(n, k, args.copies)
    rows = []
    for m in tokens:
        x = _randn(m, k, scale=1.0, seed=100 + m).bfloat16()
        for variant, (fn, num_bytes) in DENSE_VARIANTS.items():
            if variant == "fp8" and m <= quant_fp8.WEIGHT_ONLY_MAX_ROWS:
                continue  # the same kernel as weight-only there
            us = time_us(fn, x, copies, args.reps)
            expected = x.float() @ copies[0]["ref_" + variant.split()[0]].T
            error = (fn(x, copies[0]).float() - expected).abs().max().item() / expected.abs().max().item()
            rows.append({"case": name, "tokens": m, "variant": variant, "us": us,
                         "GBps": num_bytes(copies[0]) / us / 1e3, "TFLOPs": 2 * m * n * k / us / 1e6,
                         "rel_error": error})
            print(rows[-1], flush=True)
    return rows


def moe_copies(copies: int) -> list[dict]:
    """Each copy: one MoE layer's gate (bf16) and experts in bf16, FP8 and AWQ, with fp32 references."""
    out = []
    for seed in range(copies):
        w_gate_up = _randn(NUM_EXPERTS, 2 * WIDTH, HIDDEN, seed=10 * seed + 1)
        w_down = _randn(NUM_EXPERTS, HIDDEN, WIDTH, seed=10 * seed + 2)
        (w8_gu, s_gu), (w8_d, s_d) = ref.quant_fp8(w_gate_up), ref.quant_fp8(w_down)  # F is a multiple of 128
        awq_gu = quant_awq_moe.AwqWeights(*ref.quant_awq(w_gate_up.transpose(1, 2)))
        awq_d = quant_awq_moe.AwqWeights(*ref.quant_awq(w_down.transpose(1, 2)))
        out.append({"gate": _randn(NUM_EXPERTS, HIDDEN, seed=10 * seed + 3).bfloat16(),
                    "bf16": (w_gate_up.bfloat16(), w_down.bfloat16()), "fp8": (w8_gu, s_gu, w8_d, s_d),
                    "awq": (awq_gu, awq_d)})
        del w_gate_up, w_down
    return out


def _hits():
    return torch.zeros(NUM_EXPERTS, dtype=torch.int64, device=DEVICE)


def moe_bf16(x, c):
    if x.shape[0] <= moe_small.MOE_MAX_TOKENS:
        return moe_small.fused_moe(x, c["gate"], *c["bf16"], TOP_K, True, _hits())
    return moe_grouped.grouped_moe(x, c["gate"], *c["bf16"], TOP_K, True, _hits())


def moe_fp8(kernel):
    def run(x, c):
        if x.shape[0] == 1:
            ids, weights = routing.gate_route(x, c["gate"], TOP_K, True, _hits())[:2]
            return quant_fp8_moe.one_token_experts(x, ids, weights, *c["fp8"])
        return quant_fp8_moe.grouped_moe(x, c["gate"], *c["fp8"], TOP_K, True, _hits(), kernel=kernel)
    return run


def moe_awq(x, c):
    if x.shape[0] == 1:
        ids, weights = routing.gate_route(x, c["gate"], TOP_K, True, _hits())[:2]
        return quant_awq_moe.one_token_experts(x, ids, weights, *c["awq"])
    return quant_awq_moe.grouped_moe(x, c["gate"], *c["awq"], TOP_K, True, _hits())


def moe_reference(x, c) -> torch.Tensor:
    """The MoE layer in fp32 torch on the unquantized weights: softmax over the gate's logits,
    top-k renormalised, each expert's SwiGLU. Plain torch, not moe_grouped in fp32: an fp32
    grouped GEMM's tiles need more shared memory than an H200 has at 4096 rows."""
    x_TD = x.float()
    probs_TE = torch.softmax(x_TD @ c["gate"].float().T, dim=-1)
    weights_TK, ids_TK = probs_TE.topk(TOP_K, dim=-1)
    weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
    w_gate_up_EGD, w_down_EDF = (w.float() for w in c["bf16"])
    out_TD = torch.zeros_like(x_TD)
    for e in ids_TK.unique().tolist():
        rows, slots = (ids_TK == e).nonzero(as_tuple=True)
        gate_PF, up_PF = (x_TD[rows] @ w_gate_up_EGD[e].T).chunk(2, dim=-1)
        y_PD = (torch.nn.functional.silu(gate_PF) * up_PF) @ w_down_EDF[e].T
        out_TD.index_add_(0, rows, y_PD * weights_TK[rows, slots, None])
    return out_TD


def expert_bytes(c, variant: str) -> int:
    """Bytes of one expert's three projections (with scales and zeros) in this variant."""
    if variant == "bf16":
        tensors = [w[0] for w in c["bf16"]]
    elif variant.startswith("fp8"):
        tensors = [t[0] for t in c["fp8"]]
    else:
        tensors = [t[0] for w in c["awq"] for t in (w.qweight, w.qzeros, w.scales)]
    return sum(t.numel() * t.element_size() for t in tensors)


def bench_moe(tokens: list[int], args) -> list[dict]:
    copies = moe_copies(args.copies)
    variants = {"bf16": moe_bf16, "fp8 weight-only": moe_fp8("weight-only"), "fp8": moe_fp8("fp8"), "awq": moe_awq}
    rows = []
    for m in tokens:
        x = _randn(m, HIDDEN, scale=1.0, seed=200 + m).bfloat16()
        ids = routing.route(torch.nn.functional.linear(x, copies[0]["gate"]), TOP_K, True, _hits(), x.dtype)[0]
        touched = ids.unique().numel()
        reference = moe_reference(x, copies[0])
        for variant, fn in variants.items():
            if variant == "fp8" and m <= quant_fp8.WEIGHT_ONLY_MAX_ROWS:
                continue
            us = time_us(fn, x, copies, args.reps)
            # Against fp32 on the unquantized weights: the quantization's own error included.
            error = (fn(x, copies[0]).float() - reference).abs().max().item() / reference.abs().max().item()
            rows.append({"case": "moe", "tokens": m, "variant": variant, "us": us, "experts": touched,
                         "GBps": touched * expert_bytes(copies[0], variant) / us / 1e3,
                         "TFLOPs": 2 * m * TOP_K * 3 * HIDDEN * WIDTH / us / 1e6, "rel_error": error})
            print(rows[-1], flush=True)
    return rows


def markdown(report: dict) -> str:
    lines = [f"# Quantized kernels at Qwen3-30B-A3B's shapes, {report['gpu']}", "",
             f"`{report['command']}` ({report['copies']} weight copies per CUDA graph, median of {report['reps']}"
             " replays; GB/s: weight bytes read (moe: the touched experts) over the time; rel. error: the largest"
             " |error| against fp32 on the unquantized weights (dense fp8/awq: on the dequantized ones) over the"
             " largest |output|)", "",
             "| case | M | variant | us | GB/s | TFLOP/s | rel. error |", "|---|---:|---|---:|---:|---:|---:|"]
    lines += [f"| {r['case']} | {r['tokens']} | {r['variant']} | {r['us']:.1f} | {r['GBps']:.0f} | {r['TFLOPs']:.1f} "
              f"| {r['rel_error']:.2g} |" for r in report["rows"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    gpu = torch.cuda.get_device_name()
    report = {"gpu": gpu, "copies": args.copies, "reps": args.reps, "rows": [],
              "command": "python -m bench.kernels.quant_kernels "
                         + " ".join(argv if argv is not None else sys.argv[1:])}
    for case in args.cases.split(","):
        report["rows"] += bench_moe(tokens, args) if case == "moe" else bench_dense(case, tokens, args)
    text = markdown(report)
    print(text)
    name = gpu.split()[-1].lower()  # "NVIDIA H200" -> h200
    write_result(pathlib.Path(args.out), f"quant_kernels_{name}", report, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
