"""bench/serving/quant_plan.py and quant_speed.py's arithmetic: the bytes a decode step reads in each
stored layout, the memory plan of Qwen3-235B-A22B AWQ on one H200, and the result table."""

import dataclasses

import pytest

from bench.serving import quant_plan, quant_speed
from bench.serving.gpu_speed import bound
from services.model.random_weights import preset


def test_a_step_reads_the_stored_bytes():
    config = preset("qwen3-30b-a3b")
    bf16, fp8, awq = (quant_plan.step_weight_bytes(config, quant_plan.preset_quant(p), 1)
                      for p in ("qwen3-30b-a3b", "qwen3-30b-a3b-fp8", "qwen3-30b-a3b-awq"))
    assert bf16 == pytest.approx(bound(config, 1)["weight_gb_per_step"] * 1e9, rel=1e-3)  # gpu_speed's bf16 bound
    assert 3.3e9 < fp8 < 3.45e9  # the "about 3.4 GB", the bf16 LM head (0.62 GB) included
    lm_head = 2 * config.vocab_size * config.hidden_size
    # AWQ: 4 bits plus a zero point (4 bits) and an fp16 scale per group of 128: 0.5195 bytes a weight.
    assert (awq - lm_head) == pytest.approx((fp8 - lm_head) * 0.5195, rel=0.01)
    # Every expert is touched at a large batch: the bound's bytes grow to all the weights.
    assert quant_plan.step_weight_bytes(config, quant_plan.preset_quant("qwen3-30b-a3b-fp8"), 4096) > 29e9


def test_bounds_in_tokens_per_s():
    b1 = quant_plan.quant_bound("qwen3-30b-a3b-fp8", 1)
    assert b1["tokens_per_s"] == pytest.approx(4.25e12 / (b1["weight_gb_per_step"] * 1e9), rel=1e-3)
    assert 650 / b1["tokens_per_s"] == pytest.approx(0.51, abs=0.02)  # the target: about half of it
    c256 = quant_plan.quant_bound("qwen3-30b-a3b-fp8", 256, context=1536)
    assert c256["tokens_per_s_with_kv"] < c256["tokens_per_s"]
    assert quant_plan.quant_bound("qwen3-30b-a3b-fp8", 256, 1536, kv_element_bytes=1)["tokens_per_s_with_kv"] > \
        c256["tokens_per_s_with_kv"]


def test_qwen3_235b_a22b_awq_fits_one_h200_with_its_kv_room():
    plan = quant_plan.memory_plan("qwen3-235b-a22b-awq")
    assert 120e9 < plan.weight_bytes < 126e9 and plan.device_bytes == 143_771 * 2**20
    assert plan.fits and plan.left_after_kv >= plan.reserve_bytes > 2e9
    kv_per_token = 2 * 94 * 4 * 128 * 2  # K and V, 94 layers, 4 KV heads of 128, bf16
    assert plan.kv_tokens == plan.kv_bytes // (16 * kv_per_token) * 16
    assert 64 * 1024 < plan.kv_tokens < 64 * 2048  # c64 at 1K-in/1K-out fills it before its last tokens
    fp8_kv = quant_plan.memory_plan("qwen3-235b-a22b-awq", kv_element_bytes=1)
    assert fp8_kv.kv_tokens >= 2 * plan.kv_tokens - 16
    assert quant_plan.kv_fraction("qwen3-235b-a22b-awq") == quant_plan.DEFAULT_KV_FRACTION
    summary = plan.summary()
    assert summary["kv_tokens"] == plan.kv_tokens and summary["weight_gb"] == round(plan.weight_bytes / 1e9, 2)


def test_a_tight_device_gets_a_smaller_kv_fraction_and_a_too_small_one_an_error():
    weights = quant_plan.memory_plan("qwen3-235b-a22b-awq").weight_bytes
    tight = weights + quant_plan.CUDA_CONTEXT_BYTES + 12_000_000_000
    fraction = quant_plan.kv_fraction("qwen3-235b-a22b-awq", device_bytes=tight)
    assert fraction < quant_plan.DEFAULT_KV_FRACTION
    assert not quant_plan.memory_plan("qwen3-235b-a22b-awq", device_bytes=tight).fits
    assert quant_plan.memory_plan("qwen3-235b-a22b-awq", device_bytes=tight, kv_fraction=fraction).fits
    with pytest.raises(ValueError, match="reserve"):
        quant_plan.kv_fraction("qwen3-235b-a22b-fp8")  # 236 GB: two H200s


def test_activations_grow_with_the_step():
    config = preset("qwen3-235b-a22b")
    small, big = (quant_plan.step_activation_bytes(config, t, 8) for t in (256, 8192))
    assert big > 20 * small
    wide = dataclasses.replace(config, vocab_size=2 * config.vocab_size)
    assert quant_plan.step_activation_bytes(wide, 256, 8) - small == 4 * 8 * config.vocab_size


def test_mix_bound_adds_prefill_at_the_peak_and_decode_at_the_hbm_bound():
    shapes = [(4096, 32, 0.6), (2048, 128, 0.3), (8192, 16, 0.1)]
    bf16, fp8 = (quant_plan.mix_bound(p, shapes, 32) for p in ("qwen3-30b-a3b", "qwen3-30b-a3b-fp8"))
    assert bf16["mean_prompt_tokens"] == pytest.approx(3891.2) and bf16["mean_output_tokens"] == pytest.approx(59.2)
    assert fp8["prefill_ms_per_request"] == pytest.approx(bf16["prefill_ms_per_request"] / 2, rel=0.01)
    for b in (bf16, fp8):
        total_s = (b["prefill_ms_per_request"] + b["decode_ms_per_request"]) / 1e3
        assert b["requests_per_s"] == pytest.approx(1 / total_s, rel=0.01)
    config = preset("qwen3-30b-a3b")
    flops = quant_plan.prompt_flops(config, 1)
    # A3B's 3.3 B active parameters less the embedding and the LM head (0.31 B each: the head
    # runs on sampled rows only), 2 FLOPs each.
    assert 2 * 2.6e9 < flops < 2 * 2.9e9


def _report(fp8_b1: float) -> dict:
    def row(conc, **figures):
        latency = dict.fromkeys(("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99"), 1.0)
        return {"concurrency": conc, "requests_per_s": 1.0, "output_tokens_per_s": 0.0, "num_ok": 1,
                "num_requests": 1, **latency, **figures}

    return {"config": {"kind": "nvidia-h200", "prompt_scale": 1.0, "output_scale": 1.0, "expert_arg": []}, "presets": {
        "qwen3-30b-a3b": {"cases": {"b1": row(1, decode_tokens_per_s_per_seq=400.0),
                                    "mix": row(32, requests_per_s=4.0)}},
        "qwen3-30b-a3b-fp8": {"cases": {"b1": row(1, decode_tokens_per_s_per_seq=fp8_b1),
                                        "c256": row(256, output_tokens_per_s=12_500.0),
                                        "mix": row(32, requests_per_s=5.0)}}}}


def test_the_table_sets_each_figure_against_its_bound_the_baseline_and_the_target():
    rows = {(r["preset"], r["case"]): r for r in quant_speed.table(_report(700.0))}
    b1 = rows[("qwen3-30b-a3b-fp8", "b1")]
    assert b1["unit"] == "decode tok/s" and b1["vs_first"] == 1.75 and b1["target_met"]
    assert b1["bound"] == quant_plan.quant_bound("qwen3-30b-a3b-fp8", 1)["tokens_per_s"]
    assert b1["share_of_bound"] == round(700.0 / b1["bound"], 3)
    assert b1["bound_with_kv"] == quant_plan.quant_bound("qwen3-30b-a3b-fp8", 1, 1536)["tokens_per_s_with_kv"]
    mix = rows[("qwen3-30b-a3b-fp8", "mix")]
    assert mix["unit"] == "req/s" and mix["vs_first"] == 1.25 and "target" not in mix
    assert rows[("qwen3-30b-a3b-fp8", "c256")]["target_met"]
    assert rows[("qwen3-30b-a3b", "b1")]["vs_first"] is None
    assert not {(r["preset"], r["case"]): r for r in quant_speed.table(_report(600.0))}[
        ("qwen3-30b-a3b-fp8", "b1")]["target_met"]
    text = quant_speed.markdown({"command": "x", "date": "d", **_report(700.0)})
    assert "| qwen3-30b-a3b-fp8 | b1 | 1 | 700.0 | decode tok/s |" in text and ">= 650: met" in text


def test_each_preset_runs_gpu_speeds_mesh_with_its_plan(monkeypatch, tmp_path):
    seen = {}

    def run_mesh(args, cases, model_dir, drive):
        seen[args.preset] = (args, cases, (model_dir / "config.json").is_file())
        return {"cases": {"b1": {"concurrency": 1}}, "startup_s": 1.0, "log_tails": {}}

    monkeypatch.setattr(quant_speed.gpu_speed, "run_mesh", run_mesh)
    monkeypatch.setattr(quant_speed, "write_model_dir", lambda path, preset: _model_dir(path))
    args = quant_speed.parse_args(["--cases", "b1,c16", "--expert-arg=--kv-cache-dtype=fp8_e4m3", "--max-batch-tokens",
                                   "4096"])
    out = quant_speed.run_preset(args, "qwen3-235b-a22b-awq")
    run_args, cases, has_config = seen["qwen3-235b-a22b-awq"]
    assert cases == ["b1", "c16"] and has_config and run_args.max_batch_tokens == 4096
    assert run_args.expert_arg == ["--kv-cache-dtype=fp8_e4m3"]  # the default fraction leaves the reserve
    assert out["plan"]["kv_tokens"] > 0 and out["cases"] == {"b1": {"concurrency": 1}}
    assert out["kv_tokens_needed"] == {"b1": 2048, "c16": 16 * 2048}
    assert quant_speed.kv_tokens_needed(["c64", "mix"], 1.0, 0.25) == {"c64": 64 * 1280}

    args.device_bytes = 130_000_000_000  # a smaller GPU: the plan lowers the fraction
    out = quant_speed.run_preset(args, "qwen3-235b-a22b-awq")
    run_args = seen["qwen3-235b-a22b-awq"][0]
    assert run_args.expert_arg[1] == "--kv-memory-fraction" and float(run_args.expert_arg[2]) < 0.8
    assert out["plan"]["fits"]
    too_big = quant_speed.run_preset(args, "qwen3-235b-a22b-fp8")  # 236 GB: refused before any mesh starts
    assert "reserve" in too_big["error"] and not too_big["plan"]["fits"] and "qwen3-235b-a22b-fp8" not in seen


def _model_dir(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path
