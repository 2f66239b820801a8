"""The one-rank grouped MoE (services/model/triton_moe.py) against moe.py's torch path, on the
CPU through Triton's interpreter.

TRITON_INTERPRET=1 must be set before the kernels are defined, so this file sets it first.
fp32 (the model's CPU dtype) and fp16 (rounded by the interpreter as a GPU rounds it); bf16 on
the GPU is checked by bench/moe_large_batch.py.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from services.model.moe import ExpertComm, MoELayer, step_capacity  # noqa: E402
from tests.triton_interpreter import interpreted  # noqa: E402


@pytest.fixture(scope="module")
def tmoe():
    """services.model.triton_moe under the interpreter, or a skip without triton."""
    with interpreted("triton_moe") as module:
        yield module


def _routed_ids(num_tokens: int, num_experts: int, top_k: int, seed: int) -> torch.Tensor:
    """Each token's top_k distinct experts in increasing order, as route gives them."""
    generator = torch.Generator().manual_seed(seed)
    scores_TE = torch.rand(num_tokens, num_experts, generator=generator)
    return scores_TE.topk(top_k, dim=1).indices.sort(dim=1).values


@pytest.mark.parametrize("num_tokens", [0, 1, 5, 130, 1100])
@pytest.mark.parametrize("block_m", [1, 16])
def test_align_groups_rows_by_expert(tmoe, num_tokens, block_m):
    """Segments padded to block_m in expert order, rows in increasing r within one (130 tokens:
    several align chunks; 1100: more chunks than the place kernel reads at once), and pos_R the
    inverse of sorted_ids_P."""
    num_experts, top_k = 12, 3
    ids_TK = _routed_ids(num_tokens, num_experts, top_k, seed=num_tokens)
    a = tmoe.align(ids_TK, num_experts, block_m)
    counts_E = torch.bincount(ids_TK.flatten(), minlength=num_experts)
    padded_E = (counts_E + block_m - 1) // block_m * block_m
    assert torch.equal(a.counts_E.long(), counts_E)
    assert torch.equal(a.ends_E.long(), padded_E.cumsum(0))
    assert torch.equal(a.starts_E.long(), padded_E.cumsum(0) - padded_E)
    assert a.sorted_ids_P.shape[0] >= int(padded_E.sum())
    for expert in range(num_experts):
        start, count = int(a.starts_E[expert]), int(counts_E[expert])
        rows = (ids_TK.flatten() == expert).nonzero().flatten()
        assert torch.equal(a.sorted_ids_P[start:start + count].long(), rows)
    assert torch.equal(a.sorted_ids_P[a.pos_R.long()].long(), torch.arange(num_tokens * top_k))


def _moe_layer(hidden: int, width: int, dtype=torch.float32, num_experts=8, top_k=3, seed=9) -> MoELayer:
    generator = torch.Generator().manual_seed(seed)
    w_gate_up = torch.randn(num_experts, 2 * width, hidden, generator=generator) / hidden ** 0.5
    w_down = torch.randn(num_experts, hidden, width, generator=generator) / width ** 0.5
    w_gate = torch.randn(num_experts, hidden, generator=generator)
    return MoELayer(w_gate.to(dtype), w_gate_up.to(dtype), w_down.to(dtype), top_k=top_k, norm_topk_prob=True,
                    comm=ExpertComm.local(), hit_counts_E=torch.zeros(num_experts, dtype=torch.int64))


def _reference(layer: MoELayer, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """moe.py's output and hit counts, in fixed-capacity mode as the model picks it."""
    capacity = step_capacity(x_TD.shape[0], layer.top_k, layer.w_gate_ED.shape[0], 256)
    out_TD = layer(x_TD, capacity)
    return out_TD, layer.hit_counts_E.clone()


# Small tiles (the interpreter is slow) that still split D and F: uneven shapes take the masked
# loads, even ones (D, F multiples of block_k) the unmasked ones.
def _config(tmoe, block_m=16, gate_up=(16, 16, 4, 2), down=(32, 16, 4, 2)):
    return tmoe.MoEConfig(block_m, tmoe.GemmBlocks(*gate_up), tmoe.GemmBlocks(*down))


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 33, 70])
@pytest.mark.parametrize("shape", [(48, 40), (64, 32)])
@pytest.mark.parametrize("gemms", ["triton", "torch"])
def test_grouped_moe_matches_moe_layer(tmoe, num_tokens, shape, gemms):
    hidden, width = shape
    layer = _moe_layer(hidden, width)
    x_TD = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(num_tokens))
    expected_TD, expected_hits_E = _reference(layer, x_TD)
    hits_E = torch.full((8,), 3, dtype=torch.int64)
    out_TD = tmoe.grouped_moe(x_TD, layer.w_gate_ED, layer.w_gate_up_LGD, layer.w_down_LDF, 3, True, hits_E,
                              config=_config(tmoe), gemms=gemms)
    assert out_TD.shape == (num_tokens, hidden)
    torch.testing.assert_close(out_TD, expected_TD, atol=1e-5, rtol=1e-5)
    assert torch.equal(hits_E - 3, expected_hits_E) and int(expected_hits_E.sum()) == num_tokens * 3


def test_default_config_runs(tmoe):
    """The GPU's tiles (block_m 32, wide blocks past D and F) on a small odd batch."""
    layer = _moe_layer(48, 40)
    x_TD = torch.randn(37, 48, generator=torch.Generator().manual_seed(2))
    expected_TD, _ = _reference(layer, x_TD)
    out_TD = tmoe.grouped_moe(x_TD, layer.w_gate_ED, layer.w_gate_up_LGD, layer.w_down_LDF, 3, True,
                              torch.zeros(8, dtype=torch.int64))
    torch.testing.assert_close(out_TD, expected_TD, atol=1e-5, rtol=1e-5)


def test_half_precision_rounds_like_torch(tmoe):
    """fp16: every intermediate rounded as moe.py rounds it. Products of an exact fp32 sum
    agree to the bit or to one unit where the reduction order differs; a skipped rounding of
    gate, SiLU or a weighted output shows as many units on many elements."""
    layer = _moe_layer(64, 32, dtype=torch.float16)
    x_TD = torch.randn(21, 64, generator=torch.Generator().manual_seed(4)).half()
    expected_TD, expected_hits_E = _reference(layer, x_TD)
    hits_E = torch.zeros(8, dtype=torch.int64)
    out_TD = tmoe.grouped_moe(x_TD, layer.w_gate_ED, layer.w_gate_up_LGD, layer.w_down_LDF, 3, True, hits_E,
                              config=_config(tmoe))
    ulp_TD = (out_TD.float() - expected_TD.float()).abs() / expected_TD.float().abs().clamp_min(1e-3) * 1024
    assert torch.equal(hits_E, expected_hits_E)
    assert (out_TD == expected_TD).float().mean() > 0.95 and ulp_TD.max() <= 2
