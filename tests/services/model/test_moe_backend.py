"""The MoE backend registry (services/model/moe_backend.py): names, the "auto" choice by device,
and a registered backend computing a layer's steps."""

import pytest
import torch

from services.model.exchange.comm import ExpertComm
from services.model.moe import MoELayer
from services.model.moe_backend import (MOE_BACKEND_NAMES, MOE_BACKENDS, QUANTIZED_TRITON, MoEBackend, TorchMoE,
                                        gathers_on, make_moe_backend)


def _layer(backend: str) -> MoELayer:
    generator = torch.Generator().manual_seed(3)
    w_gate_ED, w_gate_up_EGD, w_down_EDF = (torch.randn(*shape, generator=generator)
                                            for shape in ((4, 16), (4, 16, 16), (4, 16, 8)))
    return MoELayer(w_gate_ED, w_gate_up_EGD, w_down_EDF, top_k=2, norm_topk_prob=True, comm=ExpertComm.local(),
                    hit_counts_E=torch.zeros(4, dtype=torch.int64), backend=backend)


def test_auto_is_torch_on_the_cpu():
    assert isinstance(make_moe_backend("auto", "cpu"), TorchMoE)
    assert isinstance(_layer("auto").backend, TorchMoE)
    assert not gathers_on("cpu")


def test_an_unknown_backend_is_refused_by_name():
    with pytest.raises(ValueError, match="'nope' is not one of"):
        make_moe_backend("nope", "cpu")
    assert set(MOE_BACKEND_NAMES) >= set(MOE_BACKENDS) - {QUANTIZED_TRITON}


def test_a_registered_backend_computes_the_layer(monkeypatch):
    """The layer hands each step, and its routed_ids probe, to the backend it was built with."""

    class Doubled(MoEBackend):
        def forward(self, layer, x_TD, capacity, add_norm):
            return 2 * TorchMoE().forward(layer, x_TD, capacity, add_norm)

    monkeypatch.setitem(MOE_BACKENDS, "doubled", Doubled)
    x_TD = torch.randn(5, 16, generator=torch.Generator().manual_seed(4))
    reference, doubled = _layer("torch"), _layer("doubled")
    assert torch.equal(doubled(x_TD), 2 * reference(x_TD))
    assert torch.equal(doubled.hit_counts_E, reference.hit_counts_E)
    assert torch.equal(doubled.routed_ids(x_TD), reference.routed_ids(x_TD))
