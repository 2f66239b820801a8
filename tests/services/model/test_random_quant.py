"""Random quantized weights drawn in the stored layouts (services/model/random_quant.py): the
published layouts and dtypes, finite bytes, sane scales, and a checkpoint of them that the
loader's checks accept."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from services.model import random_quant
from services.model.checkpoint import SINGLE_FILE, load_weights
from services.model.make_model import PRESETS
from services.model.quant.formats import QuantConfig, awq_unpack
from services.model.quant.linear import QuantWeight
from services.model.quant.loading import check_stored, stored_layout
from services.model.random_weights import RandomWeights, preset_quant

CPU = torch.device("cpu")
SMALL = dataclasses.replace(PRESETS["tiny-h160"], vocab_size=512, eos_token_ids=(510, 511))
QUANTS = {"fp8": QuantConfig("fp8"), "awq": QuantConfig("awq", group_size=32)}
_SAFETENSORS_DTYPES = {torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32", torch.int32: "I32",
                       torch.float16: "F16"}


def test_every_fp8_byte_is_finite_and_near_the_range_of_a_real_checkpoint():
    w = random_quant.random_fp8(256, 384, 0.02, torch.Generator().manual_seed(1), CPU)
    values = w.tensors["weight"].float()
    assert w.tensors["weight"].dtype == torch.float8_e4m3fn and values.isfinite().all()
    assert 16 <= values.abs().min() and values.abs().max() == 240  # exponent fields 11..14, mantissa 7 included
    assert (values < 0).float().mean().item() == pytest.approx(0.5, abs=0.01)
    assert values.pow(2).mean().sqrt().item() == pytest.approx(random_quant.FP8_VALUE_RMS, rel=0.02)


@pytest.mark.parametrize(("n", "k"), [(256, 384), (160, 200)])  # 200: partial edge blocks
def test_fp8_layout_and_scales(n, k):
    w = random_quant.random_fp8(n, k, 0.02, torch.Generator().manual_seed(2), CPU)
    assert (w.method, w.out_features, w.in_features) == ("fp8", n, k)
    scale = w.tensors["weight_scale_inv"]
    assert scale.dtype == torch.float32 and scale.shape == (-(-n // 128), -(-k // 128))
    nominal = 0.02 / random_quant.FP8_VALUE_RMS
    assert (scale >= 0.75 * nominal).all() and (scale <= 1.25 * nominal).all()
    dense = w.dequantize()
    assert abs(dense.mean().item()) < 2e-3 and dense.std().item() == pytest.approx(0.02, rel=0.15)


def test_awq_layout_zero_points_and_scales():
    n, k, g = 256, 512, 128
    w = random_quant.random_awq(n, k, g, 0.02, torch.Generator().manual_seed(3), CPU)
    t = w.tensors
    assert {key: (v.dtype, tuple(v.shape)) for key, v in t.items()} == {
        "qweight": (torch.int32, (k, n // 8)), "qzeros": (torch.int32, (k // g, n // 8)),
        "scales": (torch.float16, (k // g, n))}
    assert awq_unpack(t["qweight"]).unique().tolist() == list(range(16))
    assert awq_unpack(t["qzeros"]).unique().tolist() == [7, 8]
    nominal = 0.02 / random_quant.AWQ_VALUE_RMS
    assert (t["scales"].float() >= 0.74 * nominal).all() and (t["scales"].float() <= 1.26 * nominal).all()
    dense = w.dequantize()
    assert abs(dense.mean().item()) < 1e-3 and dense.std().item() == pytest.approx(0.02, rel=0.1)
    with pytest.raises(ValueError, match="AWQ needs"):
        random_quant.random_awq(100, 512, g, 0.02, torch.Generator(), CPU)


@pytest.mark.parametrize("method", sorted(QUANTS))
def test_the_same_seed_draws_the_same_tensors(method):
    def draw(seed):
        return random_quant.random_quant(QUANTS[method], (64, 128), 0.02, torch.Generator().manual_seed(seed), CPU)

    a, b, c = draw(7), draw(7), draw(8)
    for key in a.tensors:
        assert torch.equal(a.tensors[key].view(torch.uint8), b.tensors[key].view(torch.uint8))
    assert not torch.equal(a.tensors[next(iter(a.tensors))].view(torch.uint8),
                           c.tensors[next(iter(c.tensors))].view(torch.uint8))


@pytest.mark.parametrize("method", sorted(QUANTS))
def test_the_loader_accepts_a_checkpoint_of_stored_random_weights(method, tmp_path):
    quant = QUANTS[method]
    weights = RandomWeights(SMALL, range(SMALL.num_experts), 4, dtype=torch.bfloat16, quant=quant, stored=True)
    tensors = {}
    for name in weights:
        w = weights[name]
        if isinstance(w, QuantWeight):
            layout = stored_layout(name, (w.out_features, w.in_features), w.hub_tensors(name), quant)
            for stored, tensor in w.hub_tensors(name).items():
                assert (tuple(tensor.shape), _SAFETENSORS_DTYPES[tensor.dtype]) in [
                    (shape, dtype) for shape, dtypes in [layout[stored]] for dtype in dtypes]
                check_stored(stored, tensor)  # raises on a bad scale or an all-zero weight
            tensors.update(w.hub_tensors(name))
        else:
            tensors[name] = w
    save_file(tensors, tmp_path / SINGLE_FILE, metadata={"format": "pt"})
    hub = SMALL.to_hub_dict() | {"quantization_config": quant.to_hub_dict()}
    (tmp_path / "config.json").write_text(json.dumps(hub))
    loaded = load_weights(tmp_path, SMALL, range(SMALL.num_experts))
    name = "model.layers.2.mlp.experts.3.down_proj.weight"
    assert isinstance(loaded[name], QuantWeight)
    torch.testing.assert_close(loaded[name].dequantize(), weights[name].dequantize(), rtol=0, atol=0)


def test_presets_draw_in_the_stored_layout_and_count_its_bytes():
    config = SMALL
    stored = RandomWeights.for_preset("qwen3-30b-a3b-awq", config, [0, 1], 0, dtype=torch.bfloat16, device="cpu")
    assert stored._stored and stored._quant == preset_quant("qwen3-30b-a3b-awq")
    with pytest.raises(ValueError, match="AWQ needs"):  # group 128 does not divide tiny-h160's in-features
        stored["model.layers.0.self_attn.q_proj.weight"]
    fp8 = RandomWeights.for_preset("qwen3-30b-a3b-fp8", config, [0, 1], 0, dtype=torch.bfloat16, device="cpu")
    w = fp8["model.layers.0.mlp.experts.1.up_proj.weight"]
    assert w.method == "fp8" and w.num_bytes() == config.moe_intermediate_size * config.hidden_size + 4 * 2
    assert fp8.num_bytes() == sum(v.num_bytes() if isinstance(v, QuantWeight) else v.nbytes for v in fp8.values())
