"""Quantized variants of the random-weight presets and of `moemesh make-model`, and the
expert service's --quantized-kernel flag."""

import json

import pytest
import torch

from expert_svc.config import ExpertConfig
from services.model import random_weights
from services.model.make_model import awq_group_size, main
from services.model.quant.formats import QuantConfig
from services.model.quant.linear import QuantWeight

TINY = random_weights.PRESETS["tiny"]


@pytest.mark.parametrize("method", ["fp8", "awq"])
def test_released_shapes_have_quantized_presets(method, tmp_path):
    name = f"qwen3-235b-a22b-{method}"
    assert random_weights.preset(name) == random_weights.PRESETS["qwen3-235b-a22b"]
    assert random_weights.preset_quant(name) == QuantConfig(method)
    assert random_weights.preset_quant("qwen3-235b-a22b") is None
    random_weights.write_model_dir(tmp_path, name)
    hub = json.loads((tmp_path / "config.json").read_text())
    assert hub["quantization_config"] == QuantConfig(method).to_hub_dict()
    # The directory serves its preset: its config.json describes the same model.
    assert random_weights.serving_model_config(str(tmp_path), name) == random_weights.preset(name)
    with pytest.raises(ValueError, match="qwen3-30b-a3b-awq"):
        random_weights.preset("qwen3-30b-a3b-int4")


@pytest.mark.parametrize("quant", [QuantConfig("fp8"), QuantConfig("awq", group_size=32)], ids=["fp8", "awq"])
def test_random_weights_quantize_the_projections_of_the_same_draw(quant):
    quantized = random_weights.RandomWeights(TINY, [1, 6], 3, dtype=torch.float32, quant=quant)
    dense = random_weights.RandomWeights(TINY, [1, 6], 3, dtype=torch.float32)
    name = "model.layers.2.mlp.experts.6.up_proj.weight"
    w = quantized[name]
    assert isinstance(w, QuantWeight) and w.method == quant.method
    assert (w.out_features, w.in_features) == (TINY.moe_intermediate_size, TINY.hidden_size)
    again = quantized[name]
    assert all(torch.equal(t, again.tensors[k]) for k, t in w.tensors.items())
    error = (w.dequantize() - dense[name]).abs().max()
    assert 0 < error < 0.25 * dense[name].abs().max()
    for unquantized in ("model.layers.0.mlp.gate.weight", "lm_head.weight", "model.embed_tokens.weight"):
        assert torch.equal(quantized[unquantized], dense[unquantized])


def test_make_model_writes_the_published_quantization_configs(tmp_path):
    assert main([str(tmp_path / "fp8"), "--quantize", "fp8", "--no-tokenizer"]) == 0
    assert json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert main([str(tmp_path / "awq"), "--preset", "tiny-h160", "--quantize", "awq", "--no-tokenizer"]) == 0
    assert json.loads((tmp_path / "awq" / "config.json").read_text())["quantization_config"] == {
        "quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    assert awq_group_size(random_weights.PRESETS["qwen3-30b-a3b"]) == 128


def test_the_quantized_kernel_flag_is_checked():
    from expert_svc.config import _QUANTIZED_KERNELS
    from services.model.quant.dispatch import QUANTIZED_KERNELS

    assert _QUANTIZED_KERNELS == QUANTIZED_KERNELS  # the config's copy (it imports no torch)
    assert ExpertConfig(member_id="e0", model="m").quantized_kernel == "auto"
    assert ExpertConfig(member_id="e0", model="m", quantized_kernel="weight-only").quantized_kernel == "weight-only"
    with pytest.raises(ValueError, match=r"quantized_kernel must be one of .*'weight-only'.*got 'int8'"):
        ExpertConfig(member_id="e0", model="m", quantized_kernel="int8")


@pytest.mark.parametrize("quant", [QuantConfig("fp8"), QuantConfig("awq", group_size=32)], ids=["fp8", "awq"])
def test_random_weights_count_the_stored_bytes(quant):
    weights = random_weights.RandomWeights(TINY, [0], 1, dtype=torch.bfloat16, quant=quant)
    expected = sum(w.num_bytes() if isinstance(w, QuantWeight) else w.nbytes for w in weights.values())
    assert weights.num_bytes() == expected
    assert expected < random_weights.RandomWeights(TINY, [0], 1, dtype=torch.bfloat16).num_bytes()


def test_qwen3_235b_a22b_awq_fits_one_h200():
    config = random_weights.preset("qwen3-235b-a22b-awq")
    weights = random_weights.RandomWeights(config, range(config.num_experts), 0,
                                           quant=random_weights.preset_quant("qwen3-235b-a22b-awq"))
    assert 120e9 < weights.num_bytes() < 130e9 < 141e9  # bf16 embeddings, LM head and gates included
