"""bench/serving/gpu_speed.py's pieces that run on the CPU: the transformers baseline gets
the mesh's weights, the bounds and the step attribution add up."""

import pytest
import torch

from bench.serving.gpu_speed import add_ratios, bound, hf_model, kv_cache_dtype, sampling_params, step_attribution
from services.kv_pool import KVPool
from services.model.batch import SeqInput, build_forward_batch
from services.model.qwen3_moe import Qwen3MoeModel
from services.model.random_weights import RandomWeights, preset


def test_transformers_baseline_runs_the_mesh_weights():
    config = preset("tiny")
    weights = RandomWeights(config, range(config.num_experts), seed=3, dtype=torch.float32)
    hf = hf_model(config, weights, torch.float32, "cpu", attn_implementation="eager")
    ids = [5, 17, 3, 42, 8, 11]
    with torch.no_grad():
        expected_SV = hf(torch.tensor([ids])).logits[0, -1:]

    ours = Qwen3MoeModel(config, weights, expert_ids=range(config.num_experts), dtype=torch.float32)
    kv = KVPool.for_model(config, 4, 4, torch.float32, "cpu")
    batch = build_forward_batch([SeqInput(0, ids, 0, [0, 1], True)], 4, "cpu")
    got_SV = ours.forward(batch, kv, max_tokens_per_rank=len(ids))
    torch.testing.assert_close(got_SV, expected_SV, atol=1e-4, rtol=1e-4)


def test_bound_with_kv_is_slower_and_splits_over_ranks():
    config = preset("qwen3-30b-a3b")
    weights_only, with_kv = bound(config, 256), bound(config, 256, context=1536)
    assert with_kv["tokens_per_s"] == weights_only["tokens_per_s"]
    assert with_kv["tokens_per_s_with_kv"] < 0.7 * weights_only["tokens_per_s"]  # 38 GB of KV vs 60 GB
    two = bound(config, 256, num_ranks=2, context=1536)
    assert two["step_ms_with_kv"] < 0.6 * with_kv["step_ms_with_kv"]


def test_an_fp8_kv_cache_halves_the_kv_bytes_and_is_named_in_the_targets():
    assert kv_cache_dtype(["--kv-cache-dtype", "fp8_e4m3"]) == kv_cache_dtype(["--kv-cache-dtype=fp8_e4m3"]) == "fp8_e4m3"
    assert kv_cache_dtype(["--attention-backend", "triton"]) == "auto"

    def report(expert_arg):
        row = {"concurrency": 256, "output_tokens_per_s": 8100.0, "itl_ms_p50": 28.0}
        return {"config": {"preset": "qwen3-30b-a3b", "ranks": 1, "prompt_scale": 1.0, "output_scale": 1.0,
                           "expert_arg": expert_arg}, "mesh": {"cases": {"c256": row}}}

    bf16, fp8 = report([]), report(["--kv-cache-dtype", "fp8_e4m3"])
    add_ratios(bf16)
    add_ratios(fp8)
    bf16_row, fp8_row = bf16["mesh"]["cases"]["c256"], fp8["mesh"]["cases"]["c256"]
    assert abs(fp8_row["kv_gb_per_step"] - bf16_row["kv_gb_per_step"] / 2) <= 0.01
    assert fp8_row["bound"]["tokens_per_s_with_kv"] > bf16_row["bound"]["tokens_per_s_with_kv"]
    assert bf16["targets"] == {"c256 >= 8,000 output tok/s on one H200": True}
    assert fp8["targets"] == {"c256 >= 8,000 output tok/s on one H200 (KV cache fp8_e4m3)": True}


def test_a_sampled_run_is_named_in_the_targets():
    assert sampling_params("0.8,0.95") == (0.8, 0.95)
    for bad in ("0,0.9", "0.8,1.5", "0.8"):
        with pytest.raises(ValueError):
            sampling_params(bad)
    report = {"config": {"preset": "qwen3-30b-a3b", "ranks": 1, "prompt_scale": 1.0, "output_scale": 1.0,
                         "expert_arg": [], "sampling": "0.8,0.95"},
              "mesh": {"cases": {"c256": {"concurrency": 256, "output_tokens_per_s": 7000.0, "itl_ms_p50": 30.0}}}}
    add_ratios(report)
    assert report["targets"] == {"c256 >= 8,000 output tok/s on one H200 (sampled: temperature, top_p 0.8,0.95)": False}


def test_step_attribution_is_the_difference_of_two_scrapes():
    # (step seconds, steps, GC seconds, collections, full-collection seconds, full collections,
    # prefix-cache hit tokens, prompt tokens looked up)
    before = {"expert0": (1.0, 10.0, 0.5, 40.0, 0.25, 1.0, 0.0, 0.0),
              "gateway": (2.0, 10.0, 0.0, 0.0, 0.0, 0.0, 16.0, 100.0)}
    after = {"expert0": (3.0, 110.0, 0.625, 90.0, 0.3, 2.0, 0.0, 0.0),
             "gateway": (4.5, 110.0, 0.2, 7.0, 0.15, 3.0, 16.0, 1124.0)}
    got = step_attribution(before, after, wall_s=4.0)
    assert got == {"expert0": {"steps": 100, "mean_step_ms": 20.0, "wall_ms_per_step": 40.0, "busy_share": 0.5,
                               "gc_ms": 125.0, "gc_full": 1, "gc_full_ms": 50.0},
                   "gateway": {"steps": 100, "mean_step_ms": 25.0, "wall_ms_per_step": 40.0, "busy_share": 0.625,
                               "gc_ms": 200.0, "gc_full": 3, "gc_full_ms": 150.0,
                               "prefix_hit_tokens": 0, "prefix_query_tokens": 1024}}


def test_step_attribution_reports_the_device_time_of_steps_with_and_without_prompt_tokens():
    # ... then (device seconds, steps) of steps with prompt tokens, and of those without
    before = {"expert0": (1.0, 10.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 5.0, 0.1, 5.0)}
    after = {"expert0": (3.0, 110.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.5, 25.0, 0.9, 85.0)}
    got = step_attribution(before, after, wall_s=4.0)["expert0"]
    assert (got["device_prefill_steps"], got["device_prefill_ms"]) == (20, 100.0)
    assert (got["device_decode_steps"], got["device_decode_ms"]) == (80, 10.0)


def test_step_attribution_reports_launch_and_device_gap_means_beside_the_device_time():
    # ... then device, launch, gap and launch CPU (seconds, steps) pairs, each prefill then decode (TIMINGS)
    zeros = (0.0,) * 6
    before = {"expert0": (1.0, 10.0, *zeros, 0.5, 5.0, 0.1, 5.0, 0.2, 5.0, 0.0, 5.0, 0.0, 4.0, 0.05, 5.0,
                          0.1, 5.0, 0.0, 5.0)}
    after = {"expert0": (3.0, 110.0, *zeros, 2.5, 25.0, 0.9, 85.0, 1.2, 25.0, 0.4, 85.0, 0.1, 24.0, 0.13, 85.0,
                         0.5, 25.0, 0.32, 85.0)}
    got = step_attribution(before, after, wall_s=4.0)["expert0"]
    assert (got["launch_prefill_ms"], got["launch_decode_ms"]) == (50.0, 5.0)
    assert (got["gap_prefill_ms"], got["gap_decode_ms"]) == (5.0, 1.0)
    assert (got["launch_cpu_prefill_ms"], got["launch_cpu_decode_ms"]) == (20.0, 4.0)
    assert got["device_prefill_steps"] == 20 and "launch_prefill_steps" not in got


def test_step_attribution_reports_a_cuda_ranks_allocator_counts():
    # ... then the allocator's retries and cudaMallocs (counters), after the four timings' pairs
    zeros = (0.0,) * 6
    before = {"expert0": (1.0, 10.0, *zeros, 0.5, 5.0, 0.1, 5.0, *(0.0,) * 12, 1.0, 300.0),
              "cpu": (1.0, 10.0, *zeros, *(0.0,) * 16, 0.0, 0.0)}
    after = {"expert0": (3.0, 110.0, *zeros, 2.5, 25.0, 0.9, 85.0, *(0.0,) * 12, 1.0, 312.0),
             "cpu": (3.0, 110.0, *zeros, *(0.0,) * 16, 0.0, 0.0)}
    got = step_attribution(before, after, wall_s=4.0)
    assert (got["expert0"]["alloc_retries"], got["expert0"]["cuda_mallocs"]) == (0, 12)
    assert "cuda_mallocs" not in got["cpu"]  # no device time: not a CUDA rank



def test_step_attribution_reports_a_gateways_mean_queue_time():
    # ... then (queue seconds, requests first scheduled) after the allocator's counters: a gateway's
    tail = (*(0.0,) * 16, 0.0, 0.0)
    before = {"gateway": (2.0, 10.0, *(0.0,) * 6, *tail, 1.0, 10.0), "expert0": (1.0, 10.0, *(0.0,) * 6, *tail, 0.0, 0.0)}
    after = {"gateway": (4.0, 110.0, *(0.0,) * 6, *tail, 4.0, 40.0), "expert0": (3.0, 110.0, *(0.0,) * 6, *tail, 0.0, 0.0)}
    got = step_attribution(before, after, wall_s=4.0)
    assert (got["gateway"]["queued"], got["gateway"]["queue_ms"]) == (30, 100.0)
    assert "queue_ms" not in got["expert0"]
