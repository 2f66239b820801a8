"""How quantized weights are laid out for the CUDA kernels, on the CPU: q|k|v as one stored weight,
the experts' gate|up stack the kernels read (and replicas copied into it), and which MoE backend a
quantized layer gets."""

import pytest
import torch

from services.model.exchange.comm import ExpertComm
from services.model.moe import MoELayer
from services.model.moe_backend import TorchMoE, make_moe_backend
from services.model.quant.experts import QuantExperts
from services.model.quant.formats import QuantConfig
from services.model.quant.linear import QuantWeight

QUANTS = {"fp8": QuantConfig("fp8"), "awq": QuantConfig("awq", group_size=32)}


def _w(n, k, seed):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1


@pytest.mark.parametrize("method", sorted(QUANTS))
def test_qkv_concatenated_is_exactly_the_separate_weights(method):
    # q and k end on 128-row block boundaries (FP8's condition); v's last block is partial.
    parts = [QuantWeight.quantize(_w(n, 160, seed), QUANTS[method]) for seed, n in enumerate((256, 128, 72))]
    qkv = QuantWeight.concat_outputs(parts)
    assert (qkv.out_features, qkv.in_features) == (456, 160)
    assert torch.equal(qkv.dequantize(), torch.cat([p.dequantize() for p in parts]))
    for (key, tensor), dim in zip(qkv.tensors.items(), [-2 if method == "fp8" else -1] * 3):
        assert tensor.shape[dim] == sum(p.tensors[key].shape[dim] for p in parts), key


def test_fp8_qkv_whose_blocks_straddle_the_parts_stay_three():
    """A part ending inside a 128-row block: its last scale covers only its own rows, so the
    stored layouts cannot be put side by side (three projections instead)."""
    fp8 = [QuantWeight.quantize(_w(n, 160, seed), QUANTS["fp8"]) for seed, n in enumerate((128, 64, 64))]
    assert QuantWeight.concat_outputs(fp8) is None
    awq = [QuantWeight.quantize(_w(n, 160, seed), QUANTS["awq"]) for seed, n in enumerate((128, 64, 64))]
    assert QuantWeight.concat_outputs(awq) is not None
    mixed = [awq[0], QuantWeight.quantize(_w(64, 160, 5), QuantConfig("awq", group_size=16)), awq[2]]
    assert QuantWeight.concat_outputs(mixed) is None


def _experts(method, num_experts=3, width=64, hidden=160, spares=1):
    """(QuantExperts of `num_experts` experts + spares, the per-expert (gate, up, down))."""
    one = [tuple(QuantWeight.quantize(_w(n, k, 10 * e + p), QUANTS[method])
                 for p, (n, k) in enumerate(((width, hidden), (width, hidden), (hidden, width))))
           for e in range(num_experts)]
    stacks = [QuantWeight.stack([w[p] for w in one], spares) for p in range(3)]
    return QuantExperts(*stacks, dtype=torch.float32, cache_dense=False), one


@pytest.mark.parametrize("method", sorted(QUANTS))
def test_gate_up_is_one_stack_in_the_kernels_layout(method):
    experts, one = _experts(method)
    stored = experts.gate_up_tensors
    for e, (gate, up, _) in enumerate(one):
        if method == "fp8":  # rows: the gate's, then the up's; scales: the gate's blocks, then the up's
            assert torch.equal(stored["weight"][e].view(torch.uint8),
                               torch.cat((gate.tensors["weight"], up.tensors["weight"])).view(torch.uint8))
            assert torch.equal(stored["weight_scale_inv"][e],
                               torch.cat((gate.tensors["weight_scale_inv"], up.tensors["weight_scale_inv"])))
        else:  # AWQ stores [K, N]: the gate's columns, then the up's
            for key in ("qweight", "qzeros", "scales"):
                assert torch.equal(stored[key][e], torch.cat((gate.tensors[key], up.tensors[key]), dim=-1)), key
    # gate and up are views of it; the dense weights (the torch path's) agree.
    for key, tensor in experts.gate.tensors.items():
        assert tensor.untyped_storage().data_ptr() == stored[key].untyped_storage().data_ptr()
    w_gate_up, _ = experts.dense()
    assert torch.equal(w_gate_up[1], torch.cat((one[1][0].dequantize(), one[1][1].dequantize())))


@pytest.mark.parametrize("method", sorted(QUANTS))
def test_a_replica_lands_in_the_stack_the_kernels_read(method):
    experts, one = _experts(method)
    spare = experts.num_slots - 1
    assert not any(t[spare].view(torch.uint8).any() for t in experts.gate_up_tensors.values())
    experts.load_slot(spare, *one[2])
    for key, tensor in experts.gate_up_tensors.items():
        assert torch.equal(tensor[spare].view(torch.uint8), tensor[2].view(torch.uint8)), key
    for key, tensor in experts.down.tensors.items():
        assert torch.equal(tensor[spare].view(torch.uint8), tensor[2].view(torch.uint8)), key
    dense_gate_up, dense_down = experts.dense()
    assert torch.equal(dense_gate_up[spare], dense_gate_up[2]) and torch.equal(dense_down[spare], dense_down[2])


def test_quantized_layers_get_the_quantized_triton_backend():
    pytest.importorskip("triton")
    from services.model.kernels.quant_moe import QuantTritonMoE

    assert isinstance(make_moe_backend("auto", "cuda", quantized=True), QuantTritonMoE)
    assert isinstance(make_moe_backend("triton", "cuda", quantized=True), QuantTritonMoE)
    assert isinstance(make_moe_backend("auto", "cpu", quantized=True), TorchMoE)
    assert isinstance(make_moe_backend("torch", "cuda", quantized=True), TorchMoE)
    assert type(make_moe_backend("auto", "cuda")).__name__ == "TritonMoE"


def test_the_quantized_backend_keeps_cpu_tensors_on_the_torch_path():
    """QuantTritonMoE on CPU tensors (a quantized layer asked for "triton" on the CPU): the torch
    dispatch path on the dequantized weights, the same output as the torch backend's."""
    pytest.importorskip("triton")
    experts, _ = _experts("fp8", num_experts=4, spares=0)
    gate_ED = _w(4, 160, 20)
    layers = [MoELayer(gate_ED, experts, None, top_k=2, norm_topk_prob=True, comm=ExpertComm.local(),
                       hit_counts_E=torch.zeros(4, dtype=torch.int64), backend=name) for name in ("torch", "triton")]
    assert type(layers[1].backend).__name__ == "QuantTritonMoE"
    x = _w(5, 160, 21)
    assert torch.equal(layers[1](x), layers[0](x))
    assert torch.equal(layers[1].hit_counts_E, layers[0].hit_counts_E)
