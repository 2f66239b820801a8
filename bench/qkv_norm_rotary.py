"""Times triton_fused.qkv_norm_rotary on the GPU and checks it against the torch reference.

    python3 bench/qkv_norm_rotary.py

Qwen3-30B-A3B heads (32 q, 4 KV, head_dim 128), bf16. Per token count: the kernel as
configured, the same kernel with one token per program (QKV_ONE_TOKEN_STEPS raised),
the cap on tokens per program swept, and the share of q/k elements bit-equal to the
torch code (services/model/layers.py).
"""

import sys

import torch
import triton

sys.path.insert(0, ".")
from services.model import triton_fused as fused  # noqa: E402
from services.model.layers import RotaryEmbedding, apply_rotary, rms_norm  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, EPS = 32, 4, 128, 1e-6


def time_us(fn) -> float:
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50)


def main() -> None:
    h, g, k = HEADS, KV_HEADS, HEAD_DIM
    for tokens in (1, 64, 256, 1024, 4096, 16384):
        qkv = torch.randn(tokens, (h + 2 * g) * k, device="cuda").to(torch.bfloat16)
        q_norm, k_norm = torch.randn(2, k, device="cuda").to(torch.bfloat16)
        positions = torch.arange(tokens, device="cuda") * 7 % 40000
        cos, sin = RotaryEmbedding(k, 1e6, "cuda").cos_sin(positions, torch.bfloat16)

        def run():
            return fused.qkv_norm_rotary(qkv, q_norm, k_norm, cos, sin, h, g, EPS)

        q, key, v = run()
        q_ref = apply_rotary(rms_norm(qkv[:, :h * k].reshape(tokens, h, k), q_norm, EPS), cos, sin)
        k_ref = apply_rotary(rms_norm(qkv[:, h * k:(h + g) * k].reshape(tokens, g, k), k_norm, EPS), cos, sin)
        equal = ((q == q_ref).float().mean().item(), (key == k_ref).float().mean().item(),
                 torch.equal(v.flatten(1), qkv[:, (h + g) * k:]))
        configured = time_us(run)
        saved = fused.QKV_ONE_TOKEN_STEPS
        fused.QKV_ONE_TOKEN_STEPS = 1 << 30
        one_token = time_us(run)
        fused.QKV_ONE_TOKEN_STEPS = saved
        by_cap, saved = {}, fused.QKV_MAX_TOKENS_PER_PROGRAM
        for cap in (8, 16, 32):
            fused.QKV_MAX_TOKENS_PER_PROGRAM = cap
            by_cap[cap] = round(time_us(run), 1)
        fused.QKV_MAX_TOKENS_PER_PROGRAM = saved
        print(f"T={tokens}: {configured:.1f} us (tokens/program {fused.qkv_tokens_per_program(tokens)}), "
              f"one token/program {one_token:.1f} us, by cap {by_cap}, q/k bit-equal {equal[0]:.4f}/{equal[1]:.4f}, "
              f"v equal {equal[2]}", flush=True)


if __name__ == "__main__":
    main()
