"""Quantized checkpoints through the serving model on the CPU: the same logits as transformers
fp32 on the dequantized weights, replicas copied as stored, the compute path choice, and the
routing agreement report."""

import dataclasses
import logging

import pytest
import torch

from services.kv_pool import KVPool
from services.model.batch import SeqInput, build_forward_batch
from services.model.checkpoint import load_weights
from services.model.make_model import PRESETS, make_random_checkpoint, write_dequantized_checkpoint
from services.model.qwen3_moe import Qwen3MoeModel
from services.model.quant import dispatch
from services.model.quant.formats import QuantConfig
from services.model.quant.linear import QuantWeight
from services.model.quant.routing import format_agreement, recorded_routing, routing_agreement

SMALL = dataclasses.replace(PRESETS["tiny-h160"], vocab_size=512, eos_token_ids=(510, 511))
QUANTS = {"fp8": QuantConfig("fp8"), "awq": QuantConfig("awq", group_size=32)}
PROMPTS = [torch.randint(512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 23)]


@pytest.fixture(scope="module", params=sorted(QUANTS))
def dirs(request, tmp_path_factory):
    """(quantized checkpoint, its dequantized fp32 twin)."""
    root = tmp_path_factory.mktemp(request.param)
    make_random_checkpoint(root / "q", SMALL, seed=11, with_tokenizer=False, quant=QUANTS[request.param])
    write_dequantized_checkpoint(root / "q", root / "dense")
    return root / "q", root / "dense"


def _model(model_dir, **kwargs) -> Qwen3MoeModel:
    return Qwen3MoeModel(SMALL, load_weights(model_dir, SMALL, range(SMALL.num_experts)),
                         expert_ids=range(SMALL.num_experts), **kwargs)


def _logits(model, ids) -> torch.Tensor:
    batch = build_forward_batch([SeqInput(0, ids, 0, [0, 1], True)], 16, "cpu")
    batch = dataclasses.replace(batch, sample_indices_S=torch.arange(len(ids)))
    return model.forward(batch, KVPool.for_model(SMALL, 2, 16, torch.float32, "cpu"))


def test_logits_match_transformers_fp32_on_the_dequantized_weights(dirs):
    from transformers import Qwen3MoeForCausalLM

    quantized, dense = dirs
    model = _model(quantized)
    assert isinstance(model.layers[0].w_q_HKD, QuantWeight) and model.layers[0].w_qkv_XD is None
    assert model.layers[0].feed_forward.quant_experts is not None
    hf = Qwen3MoeForCausalLM.from_pretrained(dense, dtype=torch.float32, attn_implementation="eager",
                                             experts_implementation="eager").eval()
    for ids in PROMPTS:
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0]
        ours = _logits(model, ids)
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-4)
        assert torch.equal(ours.argmax(-1), expected.argmax(-1))


def test_the_model_keeps_the_stored_layouts(dirs):
    quantized, _ = dirs
    weights = load_weights(quantized, SMALL, range(SMALL.num_experts))
    model = _model(quantized)
    moe = model.layers[0].feed_forward.quant_experts
    for e in (0, 7):
        one = weights[f"model.layers.0.mlp.experts.{e}.down_proj.weight"]
        for key, tensor in one.tensors.items():
            assert torch.equal(moe.down.tensors[key][e], tensor), key
    q = model.layers[2].w_o_DHK
    assert all(torch.equal(t, weights["model.layers.2.self_attn.o_proj.weight"].tensors[k]) for k, t in q.tensors.items())


def test_a_replica_slot_gets_the_stored_weights_and_scales(dirs):
    quantized, _ = dirs
    model = _model(quantized, num_spare_expert_slots=1)
    moe = model.layers[2].feed_forward
    assert moe.quant_experts.num_slots == SMALL.num_experts + 1
    w_gate_up_QGD = moe.w_gate_up_LGD
    assert torch.count_nonzero(w_gate_up_QGD[-1]) == 0
    hub = load_weights(quantized, SMALL, [3])
    moe.load_slot(SMALL.num_experts, hub, "model.layers.2.mlp.experts.3.")
    for proj, stack in (("gate_proj", moe.quant_experts.gate), ("down_proj", moe.quant_experts.down)):
        for key, tensor in hub[f"model.layers.2.mlp.experts.3.{proj}.weight"].tensors.items():
            assert torch.equal(stack.tensors[key][-1], tensor), (proj, key)
    # The cached dense weights (the CPU path's) were updated in place: the same tensor as before.
    assert moe.w_gate_up_LGD is w_gate_up_QGD
    assert torch.equal(moe.w_gate_up_LGD[-1], moe.w_gate_up_LGD[3])
    assert torch.equal(moe.w_down_LDF[-1], moe.w_down_LDF[3])


def test_routing_agreement_with_the_dequantized_twin(dirs):
    quantized, dense = dirs
    model, twin = _model(quantized), _model(dense)
    report = routing_agreement(model, twin, PROMPTS)
    assert [r.layer for r in report] == SMALL.moe_layers
    assert all(r.num_tokens == 28 and r.overlap == r.exact == 1.0 for r in report)
    # A twin whose gate of layer 2 swaps experts 0 and 1: a token routed to exactly one of them
    # there keeps one of its two experts (top-2), the others keep both.
    gate_ED = twin.layers[2].feed_forward.w_gate_ED
    gate_ED[[0, 1]] = gate_ED[[1, 0]].clone()
    ids_TK = recorded_routing(model, PROMPTS)[2]
    one_of_them_T = (ids_TK < 2).sum(-1) == 1
    assert 0 < one_of_them_T.sum() < len(ids_TK)
    report = routing_agreement(model, twin, PROMPTS)
    assert report[0].overlap == 1.0
    assert report[1].exact == pytest.approx(1 - one_of_them_T.float().mean().item())
    assert report[1].overlap == pytest.approx(1 - one_of_them_T.float().mean().item() / 2)
    text = format_agreement(report)
    assert "layer   2: top-k overlap" in text and "mean top-k overlap" in text
    # The recording left the layers as they were.
    assert all(type(model.layers[i].feed_forward).__name__ == "MoELayer" for i in SMALL.moe_layers)


def test_the_path_is_chosen_by_format_and_compute_capability(monkeypatch):
    assert dispatch.choose_path("auto", "fp8", "cpu").path == "reference"
    assert dispatch.choose_path("weight-only", "awq", "cpu").cache_dense
    with pytest.raises(ValueError, match="--quantized-kernel must be one of"):
        dispatch.choose_path("int4", "awq", "cpu")
    with pytest.raises(ValueError, match="needs an FP8 checkpoint; this one is AWQ"):
        dispatch.choose_path("fp8", "awq", "cpu")
    # No kernel module (a CUDA install without triton): dequantized per call, and the log says so.
    monkeypatch.setattr(dispatch, "_KERNELS", {})
    monkeypatch.setattr(dispatch, "load_kernels", lambda: "no triton")
    for capability, expected in (((9, 0), "fp8"), ((8, 9), "fp8"), ((8, 0), "weight-only")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        path = dispatch.choose_path("auto", "fp8", "cuda")
        assert path.path == expected and not path.cache_dense and path.kernel is None
        assert f"{capability[0]}.{capability[1]}" in path.reason
        assert path.reason.endswith("no kernel registered (no triton): dequantizing on the GPU per call")
        assert dispatch.choose_path("auto", "awq", "cuda").path == "weight-only"
    with pytest.raises(ValueError, match="needs FP8 tensor cores .* this GPU has 8.0: use weight-only"):
        dispatch.choose_path("fp8", "fp8", "cuda")
    kernel = lambda x, w: x  # noqa: E731
    monkeypatch.setitem(dispatch._KERNELS, ("fp8", "weight-only"), kernel)
    path = dispatch.choose_path("weight-only", "fp8", "cuda")
    assert path.kernel is kernel and "no kernel" not in path.reason


def test_a_registered_kernel_computes_the_projection():
    w = QuantWeight.quantize(torch.randn(16, 40), QUANTS["fp8"])
    x = torch.randn(3, 40)
    torch.testing.assert_close(dispatch.linear(x, w), x @ w.dequantize().T)
    w.kernel = lambda x_TK, weight: torch.full((x_TK.shape[0], weight.out_features), 7.0)
    assert torch.equal(dispatch.linear(x, w), torch.full((3, 16), 7.0))


def test_the_model_logs_the_path_once_per_format(dirs, caplog):
    with caplog.at_level(logging.INFO, logger="services.model.qwen3_moe"):
        model = _model(dirs[0])
    lines = [r.getMessage() for r in caplog.records if "quantized weights" in r.getMessage()]
    method = next(iter(model.quant_paths))
    assert lines == [f"{method} quantized weights: reference path (cpu: F.linear on weights dequantized once)"]


def test_dequantizing_per_call_gives_the_cached_paths_logits(dirs, monkeypatch):
    """CUDA without a kernel keeps no dequantized copy (the weights stay at their quantized
    size): the same logits, every projection and expert dequantized on each call."""
    quantized, _ = dirs
    cached = _model(quantized)
    monkeypatch.setattr("services.model.qwen3_moe.choose_path", lambda requested, method, device: dispatch.QuantPath(
        "weight-only", "per call", None, False))
    per_call = _model(quantized)
    moe = per_call.layers[0].feed_forward
    assert moe.w_down_LDF is not moe.w_down_LDF and moe.quant_experts._dense is None
    assert per_call.layers[0].w_q_HKD._dense is None
    for ids in PROMPTS:
        assert torch.equal(_logits(per_call, ids), _logits(cached, ids))
    assert per_call.layers[0].w_q_HKD._dense is None and moe.quant_experts._dense is None


def test_random_quantized_weights_route_as_their_dequantized_twin():
    """Random weights have no checkpoint to dequantize: Dequantized gives the twin in memory."""
    from services.model.quant.linear import Dequantized
    from services.model.random_weights import RandomWeights

    weights = RandomWeights(SMALL, range(SMALL.num_experts), 5, dtype=torch.float32, init_std=0.1,
                            quant=QUANTS["awq"])
    model = Qwen3MoeModel(SMALL, weights, expert_ids=range(SMALL.num_experts))
    twin = Qwen3MoeModel(SMALL, Dequantized(weights), expert_ids=range(SMALL.num_experts))
    assert not twin.quant_paths and model.quant_paths["awq"].path == "reference"
    assert all(r.overlap == r.exact == 1.0 for r in routing_agreement(model, twin, PROMPTS))
    bf16 = Qwen3MoeModel(SMALL, Dequantized(weights), expert_ids=range(SMALL.num_experts), dtype=torch.bfloat16)
    report = routing_agreement(model, bf16, PROMPTS)  # the bf16 twin rounds otherwise: a report, not a bound
    assert len(report) == len(SMALL.moe_layers) and all(0.5 <= r.overlap <= 1.0 for r in report)


def test_on_cuda_the_triton_kernels_are_registered_and_named_in_the_reason(monkeypatch):
    """choose_path on CUDA imports kernels/quant_linear.py (triton is installed here, the
    device mocked): every format and path gets its kernel, and the log's reason names it."""
    pytest.importorskip("triton")
    for capability, method, requested, expected in (((9, 0), "fp8", "auto", "fp8_tensor_cores"),
                                                    ((9, 0), "fp8", "weight-only", "fp8_weight_only"),
                                                    ((8, 0), "fp8", "auto", "fp8_weight_only"),
                                                    ((9, 0), "awq", "auto", "awq_weight_only")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        path = dispatch.choose_path(requested, method, "cuda")
        assert path.kernel.__name__ == expected and path.kernel.__module__ == dispatch.KERNEL_MODULE
        assert path.reason.endswith(f"; kernel {dispatch.KERNEL_MODULE}.{expected}") and "no kernel" not in path.reason
    assert {("fp8", "fp8"), ("fp8", "weight-only"), ("awq", "weight-only")} <= set(dispatch._KERNELS)
