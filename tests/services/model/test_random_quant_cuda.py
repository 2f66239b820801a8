"""Random quantized preset weights drawn on the GPU (services/model/random_quant.py), as the benchmark
meshes draw them: finite, in the stored layout, fast, and the dequantized spread of the dense presets.
Skipped without CUDA; run on the H200 by bench/gpu_session.sh's quantacc step."""

import time

import pytest
import torch

from services.model.quant.formats import awq_unpack
from services.model.random_weights import RandomWeights, preset

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("name", ["qwen3-235b-a22b-fp8", "qwen3-235b-a22b-awq"])
def test_one_layer_of_the_235b_presets_is_drawn_in_the_stored_layout_quickly(name):
    config = preset(name)
    weights = RandomWeights.for_preset(name, config, range(config.num_experts), 0, dtype=torch.bfloat16,
                                       device="cuda")
    names = [n for n in weights if n.startswith("model.layers.3.")]
    weights["model.layers.2.mlp.experts.0.up_proj.weight"]  # the first draw loads its kernels: not timed
    torch.cuda.synchronize()
    start = time.perf_counter()
    drawn = {n: weights[n] for n in names}
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    # One of 94 layers (128 experts x 3 projections): the whole model in well under a minute.
    assert seconds < 0.5, seconds
    w = drawn["model.layers.3.mlp.experts.77.down_proj.weight"]
    assert w.device.type == "cuda" and (w.out_features, w.in_features) == (4096, 1536)
    dense = w.dequantize()
    assert dense.isfinite().all() and abs(dense.mean().item()) < 1e-3
    assert dense.std().item() == pytest.approx(0.02, rel=0.15)
    if w.method == "awq":
        assert awq_unpack(w.tensors["qzeros"]).unique().tolist() == [7, 8]
    gate = drawn["model.layers.3.mlp.gate.weight"]
    assert isinstance(gate, torch.Tensor) and gate.dtype == torch.bfloat16  # the router stays dense
    again = weights["model.layers.3.mlp.experts.77.down_proj.weight"]
    assert all(torch.equal(t.view(torch.uint8), again.tensors[k].view(torch.uint8)) for k, t in w.tensors.items())
