"""bench/serving/mixed_step.py's attention variants on the CPU, through Triton's interpreter:
each setting runs the mixed step and is compared with the default setting's logits.

TRITON_INTERPRET=1 must be set before the kernels are defined, so this file sets it first.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from bench.serving import mixed_step  # noqa: E402
from services.kv_pool import KVPool  # noqa: E402
from services.model.batch import SeqInput  # noqa: E402
from services.model.qwen3_moe import Qwen3MoeModel  # noqa: E402
from services.model.random_weights import RandomWeights, preset  # noqa: E402
from tests.triton_interpreter import interpreted  # noqa: E402


def test_parse_variants():
    assert mixed_step.parse_variants("a=mixed_decode:1; b=prefill_rows:128,num_warps:8;") == {
        "a": {"mixed_decode": 1}, "b": {"prefill_rows": 128, "num_warps": 8}}
    assert mixed_step.parse_variants("") == {}
    assert set(mixed_step.parse_variants(mixed_step.DEFAULT_VARIANTS)) == {
        "mixed_decode", "rows128", "rows128_mixed", "block_n128", "rows32", "stages2", "stages4", "sdpa_off"}


def test_variants_time_the_mixed_step_and_match_the_default():
    with interpreted("kernels.attention"):
        config = preset("tiny")
        config = dataclasses.replace(config, num_hidden_layers=1, mlp_only_layers=())
        model = Qwen3MoeModel(config, RandomWeights(config, range(config.num_experts), 0, device="cpu"),
                              expert_ids=range(config.num_experts), dtype=torch.float32, device="cpu",
                              attention="torch")
        kv = KVPool.for_model(config, 12, mixed_step.BLOCK, torch.float32, "cpu")
        generator = torch.Generator().manual_seed(0)
        kv.k_cache.copy_(torch.randn(kv.k_cache.shape, generator=generator))
        kv.v_cache.copy_(torch.randn(kv.v_cache.shape, generator=generator))
        seqs = [SeqInput(0, [5], 20, [0, 1], True), SeqInput(1, [6, 7, 8, 9, 10], 3, [2], True),
                SeqInput(2, [11], 9, [3], True), SeqInput(3, list(range(12, 30)), 0, [4, 5], True)]
        results = mixed_step.time_variants(model, kv, seqs, mixed_step.parse_variants(
            "md=mixed_decode:1;r32=prefill_rows:32,num_warps:2,prefill_stages:2;bad=no_such_knob:1"), "cpu")
    assert model.attention.__class__.__name__ == "TorchReferenceAttention"  # put back
    for name in ("md", "r32"):
        assert results[name]["wall_ms"] > 0 and results[name]["max_logit_diff"] < 1e-3, results[name]
    assert results["bad"]["wall_ms"] is None and "error" in results["bad"]
