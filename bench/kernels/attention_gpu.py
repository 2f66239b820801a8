"""The Triton paged attention on one GPU: bf16 accuracy against the torch reference, and speed.

    PYTHONUNBUFFERED=1 python3 -m bench.kernels.attention_gpu --out bench/results

1. Accuracy (bf16, block size 16, scrambled block tables). Decode batches
   (padding rows included, several split counts) and mixed prefill batches
   (chunks starting mid-sequence, a decode token, a whole prompt) for the
   Qwen3-30B-A3B (32 query / 4 KV heads) and 235B-A22B (64 / 4) attention
   shapes, head_dim 128. The Triton output is compared with the bf16 torch
   reference and with an fp32 reference (the same inputs upcast): max abs
   difference. A CUDA graph of a decode step replayed on a batch with other
   lengths (copied into its static batch) must equal the eager result.
2. Decode speed, Qwen3-30B-A3B shape: batch 1, 64, 256 at context 1K and 4K
   (every sequence that long). One timed unit is the backend's forward (KV
   write, decode, split reduce) over L layers of a pool larger than the L2
   cache, so the KV really comes from HBM, as in a decode step; per-layer
   time = total / L. Eager and replayed as one CUDA graph; medians of CUDA
   event timings. Bandwidth = KV bytes read (context x KV heads x head_dim x
   2 (K and V) x 2 bytes) / time, against the H200's ~4.3 TB/s (a
   device-to-device copy measures 4.25 TB/s, shared facts).
   Three more rows use a block table 32K tokens wide (as a CUDA graph's
   static batch has), to show the split count chosen from the width still
   fits short contexts. Sweeps of the split count and tile shape show how
   good the defaults are.
3. Prefill speed: whole prompts of 2,048, 4,096 and 8,192 tokens and chunks of
   512 after 3,584 cached, 4,096 after 4,096 and 2,048 after 2,048 and 6,144
   (a 4-8K prompt's later chunks in serving): the backend (whole prompts
   through torch's fused attention), its prefill kernel alone (kernel_only),
   other kernel tiles, and the torch reference (up to 4,096 tokens).
4. Prompt lengths (--sections lengths): the host time (synchronized) of torch's
   fused attention at a length it has not run before, against a second call,
   for whole prompts of lengths no earlier call had: exactly at the length
   (cuDNN first, as before the buckets; and flash alone), and at the length's
   bucket (sdpa_length, what the backend runs); then how long warming every
   bucket up to 8,192 tokens takes (the expert's --warm-prompt-tokens).
5. Whole-prompt backends (--sections sdpa): one causal prompt of 2,048, 4,096
   and 8,192 tokens through each of torch's fused kernels alone (cuDNN, flash,
   memory-efficient), with the query heads grouped over the KV heads
   (enable_gqa, as served) and with K/V expanded to every query head, against
   the prefill kernel: us and TFLOP/s, or the error of a kernel that refuses
   the call. (A 4K prompt's attention is about 40% of its eager step.)
6. Chunks after a cached prefix (--sections chunks): 2,048 new tokens after
   2,048 and 6,144 cached, 4,096 after 4,096, 512 after 3,584: the prefill
   kernel against torch's fused kernels on the same K/V made contiguous,
   bottom-right causal (flash) or as two calls merged by their log-sum-exps
   (the chunk over itself causal, over the prefix unmasked; cuDNN and flash),
   grouped or expanded K/V, and the gather of the K/V out of the pool.

7. The decode kernel over a float8 cache (--sections fp8decode): 256, 64 and 8
   sequences at a 1,536-token context (a 1K-in/1K-out run's mean), the
   default launch against other stage counts, block sizes, register caps and
   splits (FP8_DECODE_VARIANTS), each with its largest difference from the
   default's output, and the bf16 cache's default beside them.

Writes attention_gpu.md and attention_gpu.json under --out. Exit status 1 if
an accuracy check fails. Needs CUDA, torch and triton only.
"""

import argparse
import json
import pathlib
import random
import statistics
import sys
import time
import traceback

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from services.kv_pool import KVPool  # noqa: E402
from services.model.attention import TorchReferenceAttention  # noqa: E402
from services.model.batch import SeqInput, build_decode_batch, build_forward_batch, copy_batch_  # noqa: E402
from services.model.kernels import attention as triton_attention  # noqa: E402
from services.model.kernels.attention import TritonPagedAttention, decode_num_splits  # noqa: E402

BLOCK_SIZE = 16
HEAD_DIM = 128
SHAPES = {"30B-A3B": (32, 4), "235B-A22B": (64, 4)}
HBM_TBPS = 4.3
# bf16 outputs of unit-scale attention: the reference itself rounds at ~4e-3.
TOLERANCE = 2e-2
L2_BYTES = 50 * 2**20
DEVICE = torch.device("cuda")


def _seqs(specs, num_blocks, rng) -> list[SeqInput]:
    """SeqInputs of (new tokens, cached tokens) each, over disjoint scrambled blocks."""
    blocks = rng.sample(range(num_blocks), sum(-(-(q + c) // BLOCK_SIZE) for q, c in specs))
    seqs, used = [], 0
    for i, (q_len, cached) in enumerate(specs):
        n = -(-(q_len + cached) // BLOCK_SIZE)
        seqs.append(SeqInput(i, [1] * q_len, cached, blocks[used:used + n], True))
        used += n
    return seqs


def _inputs(num_tokens, num_heads, num_kv_heads, dtype, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return [torch.randn(num_tokens, h, HEAD_DIM, generator=g, device=DEVICE, dtype=dtype)
            for h in (num_heads, num_kv_heads, num_kv_heads)]


def _pool(num_layers, num_blocks, num_kv_heads, dtype, seed=0) -> KVPool:
    pool = KVPool(num_layers, num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM, dtype, DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    for cache in (pool.k_cache, pool.v_cache):
        if cache.element_size() == 1:  # float8: no randn of its own
            cache.copy_(torch.randn(cache.shape, generator=g, device=DEVICE).to(dtype))
        else:
            cache.copy_(torch.randn(cache.shape, generator=g, device=DEVICE, dtype=dtype))
    return pool


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _check(name, backend, batch, num_heads, num_kv_heads, cache_dtype=torch.bfloat16) -> dict:
    """Triton vs the bf16 and the fp32 reference on one batch. With a float8 cache_dtype
    both references read the same float8 cache (the fp32 one widened, its new K/V rounded
    through float8 as the cache stores them)."""
    num_blocks = 512
    q, k, v = _inputs(batch.num_tokens, num_heads, num_kv_heads, torch.bfloat16)
    pool = _pool(1, num_blocks, num_kv_heads, cache_dtype)
    ref_pool = _pool(1, num_blocks, num_kv_heads, cache_dtype)
    ref32_pool = KVPool(1, num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM, torch.float32, DEVICE)
    ref32_pool.k_cache.copy_(ref_pool.k_cache.float())
    ref32_pool.v_cache.copy_(ref_pool.v_cache.float())
    scale = HEAD_DIM ** -0.5
    out = backend.forward(0, q, k, v, batch, pool, scale).float()
    ref = TorchReferenceAttention().forward(0, q, k, v, batch, ref_pool, scale).float()
    k32, v32 = (x.to(cache_dtype).float() for x in (k, v))
    ref32 = TorchReferenceAttention().forward(0, q.float(), k32, v32, batch, ref32_pool, scale)
    row = {"check": name, "max_abs_diff_vs_bf16_ref": (out - ref).abs().max().item(),
           "max_abs_diff_vs_fp32_ref": (out - ref32).abs().max().item(),
           "bf16_ref_vs_fp32_ref": (ref - ref32).abs().max().item(),
           "kv_equal": _same_bits(pool.k_cache, ref_pool.k_cache) and _same_bits(pool.v_cache, ref_pool.v_cache),
           "finite": bool(torch.isfinite(out).all())}
    row["ok"] = row["kv_equal"] and row["finite"] and row["max_abs_diff_vs_fp32_ref"] <= TOLERANCE
    return row


def accuracy() -> list[dict]:
    rows, rng = [], random.Random(0)
    decode_specs = [(1, c) for c in (0, 15, 16, 100, 1000, 2047, 3000, 511)]
    mixed_specs = [(300, 500), (1, 1200), (1000, 0), (17, 33), (64, 1)]
    mixed_decode_specs = [(1, 700), (300, 500), (1, 1200), (1000, 0), (1, 40), (17, 33), (1, 2000), (1, 0)]
    for shape_name, (num_heads, num_kv_heads) in SHAPES.items():
        for splits in (1, 8, None):
            batch = build_decode_batch(_seqs(decode_specs, 512, rng), BLOCK_SIZE, DEVICE, num_rows=11, max_blocks=200)
            rows.append(_check(f"{shape_name} decode, 8 seqs + 3 padding rows, splits {splits or 'auto'}",
                               TritonPagedAttention(splits), batch, num_heads, num_kv_heads))
        batch = build_forward_batch(_seqs(mixed_specs, 512, rng), BLOCK_SIZE, DEVICE)
        rows.append(_check(f"{shape_name} mixed prefill (chunks mid-sequence + decode)", TritonPagedAttention(),
                           batch, num_heads, num_kv_heads))
        # Decodes first, between chunks and last, and a one-token prompt, through the decode kernel.
        batch = build_forward_batch(_seqs(mixed_decode_specs, 512, rng), BLOCK_SIZE, DEVICE)
        rows.append(_check(f"{shape_name} mixed prefill, mixed_decode (5 decodes via the decode kernel)",
                           TritonPagedAttention(mixed_decode=True), batch, num_heads, num_kv_heads))
        # Whole prompts of 1,536 and 1,200 tokens through torch's fused attention, beside a chunk and a decode.
        batch = build_forward_batch(_seqs([(1536, 0), (300, 500), (1, 900), (1200, 0)], 512, rng), BLOCK_SIZE, DEVICE)
        rows.append(_check(f"{shape_name} whole prompts via the fused attention (+ chunk, decode)",
                           TritonPagedAttention(), batch, num_heads, num_kv_heads))
        # --kv-cache-dtype fp8_e4m3: the same kernels over a float8 cache.
        batch = build_decode_batch(_seqs(decode_specs, 512, rng), BLOCK_SIZE, DEVICE, num_rows=11, max_blocks=200)
        rows.append(_check(f"{shape_name} decode, fp8 KV cache", TritonPagedAttention(), batch, num_heads,
                           num_kv_heads, torch.float8_e4m3fn))
        batch = build_forward_batch(_seqs(mixed_specs, 512, rng), BLOCK_SIZE, DEVICE)
        rows.append(_check(f"{shape_name} mixed prefill, fp8 KV cache", TritonPagedAttention(), batch, num_heads,
                           num_kv_heads, torch.float8_e4m3fn))
    rows.append(_graph_replay_check())
    return rows


def _graph_replay_check() -> dict:
    """A decode graph replayed on other lengths equals the eager forward."""
    num_heads, num_kv_heads = SHAPES["30B-A3B"]
    rng, backend, scale = random.Random(1), TritonPagedAttention(), HEAD_DIM ** -0.5
    pool = _pool(1, 8192, num_kv_heads, torch.bfloat16)
    first = _seqs([(1, rng.randrange(1, 1500)) for _ in range(50)], 8192, rng)
    second = _seqs([(1, rng.randrange(1, 1500)) for _ in range(60)], 8192, rng)
    static = build_decode_batch(first, BLOCK_SIZE, DEVICE, num_rows=64, max_blocks=100)
    q, k, v = _inputs(64, num_heads, num_kv_heads, torch.bfloat16)
    graph, out = _capture(lambda: backend.forward(0, q, k, v, static, pool, scale))
    batch = build_decode_batch(second, BLOCK_SIZE, DEVICE, num_rows=64, max_blocks=100)
    copy_batch_(static, batch)
    graph.replay()
    eager = backend.forward(0, q, k, v, batch, pool, scale)
    diff = (out.float() - eager.float()).abs().max().item()
    return {"check": "30B-A3B decode CUDA graph replayed on other lengths vs eager (batch 64)",
            "max_abs_diff_vs_bf16_ref": diff, "ok": diff == 0.0}


def _capture(fn):
    """fn captured in a CUDA graph (after a warm-up that compiles the kernels) and its output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _time_ms(fn, iters) -> float:
    """Median of CUDA-event timings of fn(), after a warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _decode_setup(batch_size, context, num_kv_heads, table_tokens, cache_dtype=torch.bfloat16):
    """A pool of random K/V over more layers than the L2 cache holds, and a decode batch of batch_size
    sequences of `context` tokens on scattered blocks; the bytes a layer's decode reads."""
    num_blocks = batch_size * context // BLOCK_SIZE
    element_size = torch.empty((), dtype=cache_dtype).element_size()
    layer_bytes = 2 * num_blocks * BLOCK_SIZE * num_kv_heads * HEAD_DIM * element_size
    num_layers = max(1, min(48, -(-4 * L2_BYTES // layer_bytes)))
    pool = _pool(num_layers, num_blocks, num_kv_heads, cache_dtype)
    blocks = list(range(num_blocks))
    random.Random(2).shuffle(blocks)
    per_seq = context // BLOCK_SIZE
    seqs = [SeqInput(i, [1], context - 1, blocks[i * per_seq:(i + 1) * per_seq], True) for i in range(batch_size)]
    batch = build_decode_batch(seqs, BLOCK_SIZE, DEVICE, num_rows=batch_size, max_blocks=table_tokens // BLOCK_SIZE)
    return pool, batch, layer_bytes


# Variants timed beside the default (auto splits, block_n 64, 4 warps) on some shapes.
SPLIT_SWEEP = [dict(decode_splits=n) for n in (1, 2, 4, 8, 16, 32, 64)]
TILE_SWEEP = [dict(block_n=n, num_warps=w) for n, w in ((32, 4), (128, 4), (64, 8), (128, 8), (32, 2))]
SWEPT = {(1, 1024): SPLIT_SWEEP, (1, 4096): SPLIT_SWEEP, (64, 1024): SPLIT_SWEEP,
         (64, 4096): SPLIT_SWEEP + TILE_SWEEP, (256, 4096): TILE_SWEEP + SPLIT_SWEEP[:3]}


def decode_speed(iters) -> tuple[list[dict], list[dict]]:
    num_heads, num_kv_heads = SHAPES["30B-A3B"]
    rows, sweep = [], []
    num_sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    # (batch, context, block table width in tokens): a CUDA graph's table is as
    # wide as the longest context it takes, whatever the step's real contexts.
    shapes = [(b, c, c) for b in (1, 64, 256) for c in (1024, 4096)]
    shapes += [(1, 1024, 32768), (1, 4096, 32768), (64, 1024, 32768)]
    for batch_size, context, table_tokens in shapes:
        pool, batch, layer_bytes = _decode_setup(batch_size, context, num_kv_heads, table_tokens)
        num_layers = pool.k_cache.shape[0]
        q, k, v = _inputs(batch_size, num_heads, num_kv_heads, torch.bfloat16)
        auto = decode_num_splits(batch_size, num_kv_heads, table_tokens, num_sms)
        swept = SWEPT.get((batch_size, context), []) if table_tokens == context else []
        for variant in [{}] + swept:
            backend = TritonPagedAttention(**variant)

            def step():
                for layer in range(num_layers):
                    backend.forward(layer, q, k, v, batch, pool, HEAD_DIM ** -0.5)

            try:
                graph, _ = _capture(step)
            except Exception as error:  # noqa: BLE001 - a variant that does not compile is a result
                sweep.append({"batch": batch_size, "context": context, **variant, "error": repr(error)[:200]})
                continue
            per_layer_graph = _time_ms(graph.replay, iters) / num_layers
            row = {"batch": batch_size, "context": context, "table_tokens": table_tokens,
                   "splits": variant.get("decode_splits", auto),
                   "block_n": backend.block_n, "num_warps": backend.num_warps, "layers_per_timing": num_layers,
                   "graph_us": 1e3 * per_layer_graph, "graph_tbps": layer_bytes / per_layer_graph / 1e9}
            del graph
            if variant:
                sweep.append(row)
                continue
            per_layer_eager = _time_ms(step, max(5, iters // 4)) / num_layers
            row |= {"eager_us": 1e3 * per_layer_eager, "eager_tbps": layer_bytes / per_layer_eager / 1e9,
                    "kv_mib_per_layer": layer_bytes / 2**20}
            if batch_size <= 64 and context == table_tokens == 1024:
                ref = TorchReferenceAttention()
                row["torch_ref_us"] = 1e3 * _time_ms(lambda: ref.forward(0, q, k, v, batch, pool, HEAD_DIM ** -0.5), 5)
            rows.append(row)
            print(f"decode b={batch_size} ctx={context}: {row}", flush=True)
        pool = batch = None  # frees the pool before the next shape's
        torch.cuda.empty_cache()
    return rows, sweep


# The float8 cache's decode kernel under other launch settings (--sections fp8decode): backend knobs,
# attention.DECODE_LAUNCH entries (num_stages) and its register cap (attention.FP8_DECODE_MAXNREG).
FP8_DECODE_VARIANTS = {
    "default": {},
    "stages1": {"launch": {"num_stages": 1}},
    "stages2": {"launch": {"num_stages": 2}},
    "nocap": {"maxnreg": None},
    "n128_nocap": {"backend": {"block_n": 128}, "maxnreg": None},
    "splits2": {"backend": {"decode_splits": 2}},
}


def fp8_decode_sweep(iters) -> list[dict]:
    """The decode kernel over a float8 cache at serving's big batches (contexts of a 1K-in/1K-out run),
    each variant of FP8_DECODE_VARIANTS as a CUDA graph over L layers, with its largest difference from
    the default's output; the bf16 cache's default beside it (its bandwidth counts its own bytes)."""
    num_heads, num_kv_heads = SHAPES["30B-A3B"]
    rows = []
    saved = triton_attention.DECODE_LAUNCH, triton_attention.FP8_DECODE_MAXNREG
    for batch_size, context in ((256, 1536), (64, 1536), (8, 1536)):
        for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            pool, batch, layer_bytes = _decode_setup(batch_size, context, num_kv_heads, context, cache_dtype)
            num_layers = pool.k_cache.shape[0]
            q, k, v = _inputs(batch_size, num_heads, num_kv_heads, torch.bfloat16)
            variants = FP8_DECODE_VARIANTS if cache_dtype == torch.float8_e4m3fn else {"default": {}}
            reference = None
            for name, variant in variants.items():
                triton_attention.DECODE_LAUNCH = variant.get("launch", {})
                triton_attention.FP8_DECODE_MAXNREG = variant.get("maxnreg", saved[1])
                backend = TritonPagedAttention(**variant.get("backend", {}))

                def step():
                    for layer in range(num_layers):
                        out = backend.forward(layer, q, k, v, batch, pool, HEAD_DIM ** -0.5)
                    return out

                row = {"batch": batch_size, "context": context, "cache": str(cache_dtype).replace("torch.", ""),
                       "variant": name}
                try:
                    graph, out = _capture(step)
                    graph.replay()
                    torch.cuda.synchronize()
                    per_layer = _time_ms(graph.replay, iters) / num_layers
                except Exception as error:  # noqa: BLE001 - a variant that does not compile is a result
                    rows.append(row | {"error": repr(error)[:200]})
                    print(f"fp8decode {rows[-1]}", flush=True)
                    continue
                reference = out.clone() if reference is None else reference
                row |= {"graph_us": 1e3 * per_layer, "graph_tbps": layer_bytes / per_layer / 1e9,
                        "max_diff_vs_default": (out.float() - reference.float()).abs().max().item()}
                rows.append(row)
                print(f"fp8decode {row}", flush=True)
                del graph
            triton_attention.DECODE_LAUNCH, triton_attention.FP8_DECODE_MAXNREG = saved
            pool = batch = None
            torch.cuda.empty_cache()
    return rows


def prefill_speed(iters) -> list[dict]:
    num_heads, num_kv_heads = SHAPES["30B-A3B"]
    rows = []
    for q_len, cached in ((2048, 0), (512, 3584), (4096, 0), (8192, 0), (4096, 4096), (2048, 2048), (2048, 6144)):
        seqs = _seqs([(q_len, cached)], (q_len + cached) // BLOCK_SIZE, random.Random(3))
        batch = build_forward_batch(seqs, BLOCK_SIZE, DEVICE)
        pool = _pool(1, (q_len + cached) // BLOCK_SIZE, num_kv_heads, torch.bfloat16)
        q, k, v = _inputs(q_len, num_heads, num_kv_heads, torch.bfloat16)
        row = {"new_tokens": q_len, "cached_tokens": cached}
        backends = {"triton": TritonPagedAttention(), "kernel_only": TritonPagedAttention(sdpa_min_tokens=0),
                    "torch_ref": TorchReferenceAttention(),
                    "triton_256x8": TritonPagedAttention(prefill_rows=256, num_warps=8, sdpa_min_tokens=0),
                    "triton_128x4": TritonPagedAttention(prefill_rows=128),
                    "triton_128x8": TritonPagedAttention(prefill_rows=128, num_warps=8)}
        for name, backend in backends.items():
            if name == "torch_ref" and q_len + cached > 4096:  # its score matrix alone would take seconds
                continue
            if name.startswith("triton_"):  # a variant; one that does not compile is a result
                try:
                    backend.forward(0, q, k, v, batch, pool, HEAD_DIM ** -0.5)
                except Exception as error:  # noqa: BLE001
                    row[f"{name}_us"] = repr(error)[:100]
                    continue
            ms = _time_ms(lambda: backend.forward(0, q, k, v, batch, pool, HEAD_DIM ** -0.5), iters)
            # Causal: each new token attends to its position + 1 keys; 4 flops per (head, key, dim).
            flops = 4 * num_heads * HEAD_DIM * sum(cached + i + 1 for i in range(q_len))
            row |= {f"{name}_us": 1e3 * ms, f"{name}_tflops": flops / ms / 1e9}
        rows.append(row)
        print(f"prefill {row}", flush=True)
    return rows


def _host_ms(fn) -> float:
    """Wall ms of one call, the device drained before and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start)


def prompt_lengths() -> list[dict]:
    num_heads, num_kv_heads = SHAPES["30B-A3B"]
    q, k, v = _inputs(8192 + 1024, num_heads, num_kv_heads, torch.bfloat16)
    o = torch.empty_like(q)
    scale = HEAD_DIM ** -0.5
    ordered = triton_attention._SDPA_BACKENDS

    def exact(length, backends):
        def run():
            with sdpa_kernel(backends, set_priority=True):
                torch.nn.functional.scaled_dot_product_attention(
                    *(x[:length].transpose(0, 1).unsqueeze(0) for x in (q, k, v)), is_causal=True, scale=scale,
                    enable_gqa=True)
        return run

    def bucketed(length):
        def run():
            with sdpa_kernel(ordered, set_priority=True):
                triton_attention._attend_whole_prompt(q, k, v, o, 0, length, scale)
        return run

    rows = []
    for base in (1500, 3000, 4500, 6000, 7500):
        for length in (base + 7, base + 23, base + 41):  # never a multiple of 64: no bucket
            row = {"length": length, "bucket": triton_attention.sdpa_length(length)}
            flash = [SDPBackend.FLASH_ATTENTION]
            for name, run in (("exact", exact(length, ordered)), ("flash", exact(length, flash))):
                row[f"{name}_first_ms"] = _host_ms(run)
                row[f"{name}_again_ms"] = _host_ms(run)
            rows.append(row)
    for row in rows:  # after every exact call: the buckets' first calls are their own
        run = bucketed(row["length"])
        row["bucketed_first_ms"] = _host_ms(run)
        row["bucketed_again_ms"] = _host_ms(run)
        print(f"lengths {row}", flush=True)
    warmed = TritonPagedAttention()
    pool = _pool(1, 1, num_kv_heads, torch.bfloat16)
    warm_ms = _host_ms(lambda: warmed.warm_whole_prompts(pool, num_heads, torch.bfloat16, 8192))
    rows.append({"length": "warm 1024..8192", "bucket": len(triton_attention.sdpa_lengths(1024, 8192)),
                 "bucketed_first_ms": warm_ms})
    print(f"lengths {rows[-1]}", flush=True)
    return rows


def prompt_backends(iters) -> list[dict]:
    num_heads, num_kv_heads = SHAPES["30B-A3B"]
    group, scale = num_heads // num_kv_heads, HEAD_DIM ** -0.5
    rows = []
    for length in (2048, 4096, 8192):
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in _inputs(length, num_heads, num_kv_heads, torch.bfloat16))
        k_all, v_all = (x.repeat_interleave(group, dim=1) for x in (k, v))
        flops = 4 * num_heads * HEAD_DIM * length * (length + 1) / 2
        row = {"tokens": length}
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            for layout, kv, gqa in (("gqa", (k, v), True), ("expanded", (k_all, v_all), False)):
                name = f"{backend.name.lower().removesuffix('_attention')}_{layout}"

                def run(kv=kv, gqa=gqa, backend=backend):
                    with sdpa_kernel([backend]):
                        torch.nn.functional.scaled_dot_product_attention(q, *kv, is_causal=True, scale=scale,
                                                                         enable_gqa=gqa)
                try:
                    ms = _time_ms(run, iters)
                except Exception as error:  # noqa: BLE001 (a kernel that refuses the call is a result)
                    row[f"{name}_us"] = repr(error)[:80]
                    continue
                row[f"{name}_us"], row[f"{name}_tflops"] = 1e3 * ms, flops / ms / 1e9
        rows.append(row)
        print(f"sdpa {row}", flush=True)
    return rows


def _merged(out_a, lse_a, out_b, lse_b):
    """Two attentions of the same queries over disjoint keys, as one: each output weighted by
    its share of the softmax sum (the log-sum-exps, natural log, per query head and row)."""
    lse_a, lse_b = (x.reshape(*out_a.shape[:3], 1).float() for x in (lse_a, lse_b))
    top = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    return ((out_a.float() * w_a + out_b.float() * w_b) / (w_a + w_b)).to(out_a.dtype)


def chunk_backends(iters) -> list[dict]:
    """A chunk of new tokens after a cached prefix (K/V contiguous, 32 q / 4 KV heads): the
    prefill kernel (from the paged pool) against torch's fused kernels with the causal mask at
    the bottom right (CausalBias: flash) and as two calls whose outputs are merged by their
    log-sum-exps (the chunk over itself, causal from the top left, and over the prefix, no
    mask) through cuDNN and flash; the gather of the prefix's K/V from the pool apart.
    Each against the bottom-right flash call: max abs difference."""
    from torch.nn.attention.bias import causal_lower_right

    num_heads, num_kv_heads = SHAPES["30B-A3B"]
    group, scale = num_heads // num_kv_heads, HEAD_DIM ** -0.5
    aten = torch.ops.aten
    rows = []
    for q_len, cached in ((2048, 2048), (2048, 6144), (4096, 4096), (512, 3584), (2112, 2000), (1504, 1392)):
        context = q_len + cached
        seqs = _seqs([(q_len, cached)], context // BLOCK_SIZE, random.Random(3))
        batch = build_forward_batch(seqs, BLOCK_SIZE, DEVICE)
        pool = _pool(1, context // BLOCK_SIZE, num_kv_heads, torch.bfloat16)
        q_new, k_new, v_new = _inputs(q_len, num_heads, num_kv_heads, torch.bfloat16)
        kernel = TritonPagedAttention(sdpa_min_tokens=0)
        kernel.forward(0, q_new, k_new, v_new, batch, pool, scale)  # stores the chunk's K/V
        blocks = batch.block_tables_BM[0, :context // BLOCK_SIZE].long()
        k_cache, v_cache = pool.layer(0)

        def gather():
            return [c[blocks].flatten(0, 1)[:context] for c in (k_cache, v_cache)]
        k_all, v_all = gather()
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q_new, k_all, v_all))  # [1, heads, tokens, D]
        k_x, v_x = (x.repeat_interleave(group, dim=1) for x in (k, v))
        flops = 4 * num_heads * HEAD_DIM * sum(cached + i + 1 for i in range(q_len))
        row = {"new_tokens": q_len, "cached_tokens": cached}

        def kernel_run():
            return kernel.forward(0, q_new, k_new, v_new, batch, pool, scale).transpose(0, 1).unsqueeze(0)

        def flash_right(k=k, v=v, gqa=True):
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=causal_lower_right(q_len, context), scale=scale, enable_gqa=gqa)

        def two_part(op, k=k, v=v):
            def call(keys, values, causal):
                if op == "cudnn":
                    out = aten._scaled_dot_product_cudnn_attention(q, keys, values, None, True, 0.0, causal, False,
                                                                   scale=scale)
                else:
                    out = aten._scaled_dot_product_flash_attention(q, keys, values, 0.0, causal, False, scale=scale)
                return out[0], out[1]
            own = call(k[:, :, cached:], v[:, :, cached:], True)
            prefix = call(k[:, :, :cached], v[:, :, :cached], False)
            return _merged(*own, *prefix)

        reference = flash_right()
        candidates = {"kernel": kernel_run, "flash_right_gqa": flash_right,
                      "flash_right_expanded": lambda: flash_right(k_x, v_x, False),
                      "cudnn_two_gqa": lambda: two_part("cudnn"), "cudnn_two_expanded": lambda: two_part("cudnn", k_x, v_x),
                      "flash_two_gqa": lambda: two_part("flash"), "flash_two_expanded": lambda: two_part("flash", k_x, v_x)}
        for name, run in candidates.items():
            try:
                diff = (run().float() - reference.float()).abs().max().item()
                ms = _time_ms(run, iters)
            except Exception as error:  # noqa: BLE001 (a kernel that refuses the call is a result)
                row[f"{name}_us"] = repr(error)[:80]
                continue
            row |= {f"{name}_us": 1e3 * ms, f"{name}_tflops": flops / ms / 1e9, f"{name}_diff": diff}
        row["gather_us"] = 1e3 * _time_ms(gather, iters)
        rows.append(row)
        print(f"chunks {row}", flush=True)
    return rows


def _table(rows: list[dict], columns: list[str]) -> str:
    def fmt(value):
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"), help="directory of the result files")
    parser.add_argument("--iters", type=int, default=50, help="timed iterations per measurement")
    parser.add_argument("--sections", default="checks,decode,prefill",
                        help="which of checks (accuracy), decode, prefill, lengths, sdpa, chunks, fp8decode to run")
    args = parser.parse_args()
    wanted = set(args.sections.split(","))
    if not torch.cuda.is_available():
        print("attention_gpu needs CUDA", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(DEVICE)
    result = {"device": props.name, "num_sms": props.multi_processor_count, "torch": torch.__version__,
              "triton": __import__("triton").__version__, "errors": []}
    sections = (("checks", accuracy), ("decode", lambda: decode_speed(args.iters)),
                ("prefill", lambda: prefill_speed(args.iters)), ("lengths", prompt_lengths),
                ("sdpa", lambda: prompt_backends(args.iters)), ("chunks", lambda: chunk_backends(args.iters)),
                ("fp8decode", lambda: fp8_decode_sweep(args.iters)))
    for name, run in sections:
        if name not in wanted:
            result[name] = []
            continue
        try:  # one failing section still leaves the others' results
            result[name] = run()
        except Exception as error:  # noqa: BLE001 - reported in the results, and the exit status
            traceback.print_exc()
            result["errors"].append(f"{name}: {error!r}")
            result[name] = []
    result["decode"], result["split_sweep"] = result["decode"] or ([], [])
    checks, decode, sweep, prefill = result["checks"], result["decode"], result["split_sweep"], result["prefill"]
    lengths, backends, chunks = result["lengths"], result["sdpa"], result["chunks"]
    fp8decode = result["fp8decode"]
    md = "\n\n".join([
        f"# Triton paged attention on {props.name} ({props.multi_processor_count} SMs), "
        f"torch {result['torch']}, triton {result['triton']}",
        "Produced by `python3 -m bench.kernels.attention_gpu` (see its docstring for the method).",
        "## Accuracy (bf16; tolerance vs the fp32 reference %g)" % TOLERANCE,
        _table(checks, ["check", "max_abs_diff_vs_bf16_ref", "max_abs_diff_vs_fp32_ref", "bf16_ref_vs_fp32_ref",
                        "kv_equal", "ok"]),
        f"## Decode, Qwen3-30B-A3B attention (32 q / 4 KV heads, head_dim 128, block 16), per layer; "
        f"HBM peak ~{HBM_TBPS} TB/s",
        _table(decode, ["batch", "context", "table_tokens", "splits", "kv_mib_per_layer", "graph_us", "graph_tbps", "eager_us",
                        "eager_tbps", "torch_ref_us", "layers_per_timing"]),
        "## Decode variants: split count, block_n, warps (CUDA graph, per layer)",
        _table(sweep, ["batch", "context", "splits", "block_n", "num_warps", "graph_us", "graph_tbps", "error"]),
        "## Prefill, one sequence (32 q / 4 KV heads; triton_RxW: R rows per program, W warps)",
        _table(prefill, ["new_tokens", "cached_tokens", "triton_us", "triton_tflops", "kernel_only_us",
                         "kernel_only_tflops", "triton_256x8_us", "triton_128x4_us", "triton_128x8_us", "torch_ref_us",
                         "torch_ref_tflops"]),
        "## Whole prompts at new lengths: host ms of the first and a second call (the last row: warming "
        "every bucket up to 8,192 tokens, the bucket column the number of buckets)",
        _table(lengths, ["length", "bucket", "exact_first_ms", "exact_again_ms", "flash_first_ms", "flash_again_ms",
                         "bucketed_first_ms", "bucketed_again_ms"]),
        "## One whole causal prompt through each of torch's fused kernels (32 q / 4 KV heads): us, TFLOP/s",
        _table(backends, ["tokens", *(f"{b}_{layout}_{unit}" for b in ("cudnn", "flash", "efficient")
                                      for layout in ("gqa", "expanded") for unit in ("us", "tflops"))]),
        "## A chunk after a cached prefix: the prefill kernel against torch's fused kernels, bottom-right "
        "causal (flash_right) or two calls merged by their log-sum-exps (two): us, TFLOP/s, max abs diff "
        "from flash_right_gqa; gather_us: the prefix's K/V out of the pool",
        _table(chunks, ["new_tokens", "cached_tokens", "gather_us",
                        *(f"{c}_{unit}" for c in ("kernel", "flash_right_gqa", "flash_right_expanded", "cudnn_two_gqa",
                                                  "cudnn_two_expanded", "flash_two_gqa", "flash_two_expanded")
                          for unit in ("us", "tflops", "diff"))]),
        "## Decode over a float8 cache: launch variants (CUDA graph, per layer; bandwidth of the cache's "
        "own bytes; the bf16 cache's default beside it)",
        _table(fp8decode, ["batch", "context", "cache", "variant", "graph_us", "graph_tbps", "max_diff_vs_default",
                           "error"]),
        "Errors: " + ("; ".join(result["errors"]) or "none"),
    ]) + "\n"
    print(md, flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_gpu.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "attention_gpu.md").write_text(md)
    checked = checks or "checks" not in wanted
    return 0 if checked and all(c["ok"] for c in checks) and not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
