"""Quantized checkpoints as load_weights reads them: the stored layouts as QuantWeights, and
each broken tensor refused with an error that names it."""

import dataclasses
import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.model.checkpoint import CheckpointError, load_weights
from services.model.make_model import PRESETS, make_random_checkpoint
from services.model.quant.formats import QuantConfig, awq_dequantize
from services.model.quant.linear import QuantWeight

# Hidden 160: not a multiple of 128, so FP8's edge blocks are partial; AWQ groups of 32.
SMALL = dataclasses.replace(PRESETS["tiny-h160"], vocab_size=512, eos_token_ids=(510, 511))
QUANTS = {"fp8": QuantConfig("fp8"), "awq": QuantConfig("awq", group_size=32)}


@pytest.fixture(scope="module", params=sorted(QUANTS))
def quant_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_random_checkpoint(path, SMALL, seed=5, with_tokenizer=False, quant=QUANTS[request.param])
    return path


def _copy(src, dst, edit=None, config_edit=None):
    """A copy of checkpoint src in dst, its tensors (and config.json) changed in place by edit."""
    dst.mkdir(exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    if edit is not None:
        edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    hub = json.loads((src / "config.json").read_text())
    if config_edit is not None:
        config_edit(hub)
    (dst / "config.json").write_text(json.dumps(hub))
    return dst


def test_projections_load_as_their_stored_layouts_and_the_rest_dense(quant_dir):
    method = json.loads((quant_dir / "config.json").read_text())["quantization_config"]["quant_method"]
    stored = load_file(quant_dir / "model.safetensors")
    weights = load_weights(quant_dir, SMALL, [2, 5], dtype=torch.float32)
    q = weights["model.layers.0.mlp.experts.5.down_proj.weight"]
    assert isinstance(q, QuantWeight) and q.method == method
    assert (q.out_features, q.in_features) == (SMALL.hidden_size, SMALL.moe_intermediate_size)
    for name, tensor in q.hub_tensors("model.layers.0.mlp.experts.5.down_proj.weight").items():
        assert torch.equal(tensor, stored[name]), name
    assert all(isinstance(weights[f"model.layers.1.{p}.weight"], QuantWeight)  # the dense MLP layer and attention
               for p in ("mlp.gate_proj", "mlp.down_proj", "self_attn.q_proj", "self_attn.o_proj"))
    for name in ("model.layers.0.mlp.gate.weight", "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert weights[name].dtype == torch.float32, name
    assert not any(".experts.3." in name for name in weights)


def _set(name, value):
    def edit(tensors):
        tensors[name].view(-1)[1] = value
    return edit


def _zero(name):
    def edit(tensors):
        tensors[name] = torch.zeros_like(tensors[name])
    return edit


def _drop(name):
    def edit(tensors):
        del tensors[name]
    return edit


def _reshape(name, shape):
    def edit(tensors):
        tensors[name] = torch.ones(shape, dtype=tensors[name].dtype)
    return edit


BAD_SCALE = "zero, negative, NaN or Inf"
FP8_CASES = {
    "scale-zero": ("model.layers.0.self_attn.q_proj.weight_scale_inv", _set, 0.0, BAD_SCALE),
    "scale-negative": ("model.layers.2.mlp.experts.1.up_proj.weight_scale_inv", _set, -0.5, BAD_SCALE),
    "scale-nan": ("model.layers.1.mlp.down_proj.weight_scale_inv", _set, float("nan"), BAD_SCALE),
    "scale-inf": ("model.layers.3.self_attn.o_proj.weight_scale_inv", _set, float("inf"), BAD_SCALE),
    "weight-all-zero": ("model.layers.0.mlp.experts.4.gate_proj.weight", _zero, None, "all zeros"),
    "weight-nan": ("model.layers.0.mlp.experts.2.up_proj.weight", _set, float("nan"), r"has 1 NaN value\(s\)"),
    # A tensor the checkpoint keeps unquantized (a norm), checked as in bf16 checkpoints.
    "norm-inf": ("model.layers.2.self_attn.q_norm.weight", _set, float("inf"), "NaN or Inf"),
    "missing-scale": ("model.layers.0.mlp.experts.4.down_proj.weight_scale_inv", _drop, None,
                      "model.layers.0.mlp.experts.4.down_proj.weight.*no weight_scale_inv beside it"),
    # hidden 160 needs 2 blocks across: one scale is too few
    "scale-shape": ("model.layers.0.self_attn.k_proj.weight_scale_inv", _reshape, (1, 1), r"shape \[1, 1\], expected \[1, 2\]"),
}
AWQ_CASES = {
    "scale-zero": ("model.layers.0.self_attn.v_proj.scales", _set, 0.0, BAD_SCALE),
    "scale-negative": ("model.layers.2.mlp.experts.6.down_proj.scales", _set, -1.0, BAD_SCALE),
    "scale-nan": ("model.layers.1.mlp.up_proj.scales", _set, float("nan"), BAD_SCALE),
    "scale-inf": ("model.layers.3.mlp.experts.0.gate_proj.scales", _set, float("inf"), BAD_SCALE),
    "qweight-all-zero": ("model.layers.2.mlp.experts.7.up_proj.qweight", _zero, None, "all zeros"),
    "missing-scales": ("model.layers.0.mlp.experts.2.gate_proj.scales", _drop, None,
                       "model.layers.0.mlp.experts.2.gate_proj.qweight.*no.*scales.*missing scale"),
    "missing-qzeros": ("model.layers.3.self_attn.q_proj.qzeros", _drop, None, "no.*qzeros"),
    # o_proj reads heads * head_dim = 128 in-features: 4 groups of 32
    "qzeros-shape": ("model.layers.0.self_attn.o_proj.qzeros", _reshape, (3, 20), r"shape \[3, 20\], expected \[4, 20\]"),
}


@pytest.mark.parametrize("method, case", [("fp8", c) for c in FP8_CASES] + [("awq", c) for c in AWQ_CASES])
def test_each_broken_tensor_is_refused_naming_it(tmp_path_factory, method, case):
    src = tmp_path_factory.getbasetemp() / f"src-{method}"
    if not (src / "config.json").is_file():
        make_random_checkpoint(src, SMALL, seed=5, with_tokenizer=False, quant=QUANTS[method])
    name, make_edit, value, message = (FP8_CASES if method == "fp8" else AWQ_CASES)[case]
    edit = make_edit(name, value) if value is not None else make_edit(name)
    broken = _copy(src, tmp_path_factory.mktemp(case), edit)
    with pytest.raises(CheckpointError, match=message) as caught:
        load_weights(broken, SMALL, range(SMALL.num_experts))
    module = name.rsplit(".", 1)[0]
    assert module in str(caught.value)


def test_a_quantized_module_listed_as_not_converted_is_refused(tmp_path_factory):
    src = tmp_path_factory.mktemp("awq-skip")
    make_random_checkpoint(src, SMALL, seed=5, with_tokenizer=False, quant=QUANTS["awq"])
    broken = _copy(src, tmp_path_factory.mktemp("b"), config_edit=lambda hub: hub["quantization_config"].update(
        modules_to_not_convert=["self_attn.k_proj"]))
    with pytest.raises(CheckpointError, match=r"'model.layers.0.self_attn.k_proj.qweight' is quantized, but .* "
                                              r"modules_to_not_convert \['self_attn.k_proj'\]"):
        load_weights(broken, SMALL, [0])


def test_a_quantized_gate_is_dequantized_to_bf16_once_with_a_warning(tmp_path_factory, caplog):
    src = tmp_path_factory.mktemp("awq-gate")
    make_random_checkpoint(src, SMALL, seed=5, with_tokenizer=False, quant=QUANTS["awq"])
    gate = "model.layers.2.mlp.gate.weight"

    def quantize_gate(tensors):
        tensors.update(QuantWeight.quantize(tensors.pop(gate), QUANTS["awq"]).hub_tensors(gate))

    quantized = _copy(src, tmp_path_factory.mktemp("q"), quantize_gate)
    stored = load_file(quantized / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="services.model.checkpoint"):
        weights = load_weights(quantized, SMALL, [0, 1])
    dense = weights[gate]
    assert isinstance(dense, torch.Tensor) and dense.dtype == torch.bfloat16
    expected = awq_dequantize(stored[gate[:-7] + ".qweight"], stored[gate[:-7] + ".qzeros"],
                              stored[gate[:-7] + ".scales"], 32).to(torch.bfloat16)
    assert torch.equal(dense, expected)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and gate in warnings[0] and "dequantizes it to bfloat16" in warnings[0]


def test_an_fp8_tensor_in_an_unquantized_checkpoint_names_the_missing_scale(tmp_path_factory):
    src = tmp_path_factory.mktemp("fp8-noconfig")
    make_random_checkpoint(src, SMALL, seed=5, with_tokenizer=False, quant=QUANTS["fp8"])
    broken = _copy(src, tmp_path_factory.mktemp("b"), config_edit=lambda hub: hub.pop("quantization_config"))
    with pytest.raises(CheckpointError, match=r"'model.layers.0.self_attn.q_proj.weight'.*F8_E4M3 but has no "
                                              r"weight_scale_inv"):
        load_weights(broken, SMALL, [0])
