"""Gate routing and the small-batch MoE (services/model/kernels/routing.py, moe_small.py) against
the torch MoE layer, on the CPU through Triton's interpreter.

TRITON_INTERPRET=1 must be set before the kernels are defined, so this file
sets it first. fp32 throughout (the model's CPU dtype) but for the fp16 checks
of the roundings; bf16 is checked on a GPU by the benchmarks.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from services.model.exchange.comm import ExpertComm  # noqa: E402
from services.model.moe import MoELayer  # noqa: E402
from services.model.moe_backend import TorchMoE  # noqa: E402
from services.model.moe_dispatch import gate  # noqa: E402
from tests.triton_interpreter import interpreted_fixture  # noqa: E402


# The kernel modules, each imported under the interpreter (or the test skipped without triton).
routing = interpreted_fixture("kernels.routing")
moe_small = interpreted_fixture("kernels.moe_small")
launch = interpreted_fixture("kernels.launch")


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("top_k", [3, 4, 8])
def test_route_breaks_ties_to_the_lowest_expert(routing, top_k):
    """Equal probabilities (equal logits) are taken lowest expert first, as the K largest are
    picked, across every one of the K places; 12 experts padded to a block of 16."""
    logits = torch.tensor([[1.0] * 12,
                           [0.0, 2.0, 2.0, 1.0, 2.0, 2.0, 1.0, 1.0, 3.0, 1.0, 0.5, 2.0],
                           [-1.0] * 6 + [4.0] * 6])
    ids, weights, _ = routing.route(logits, top_k, True, torch.zeros(12, dtype=torch.int64), torch.float32)
    # stable descending sort: among equal values the lower index comes first
    expected = logits.argsort(dim=1, descending=True, stable=True)[:, :top_k].sort(dim=1).values
    assert torch.equal(ids, expected)
    assert torch.allclose(weights.sum(1), torch.ones(3))


@pytest.mark.parametrize("norm", [True, False])
def test_route_matches_gate(routing, norm):
    x, w_gate = _randn(7, 32, seed=7), _randn(12, 32, seed=8)
    ids_ref, weights_ref, counts_ref = gate(x, w_gate, 3, norm)
    order = ids_ref.argsort(dim=1)  # route gives each token's experts in increasing order
    hits = torch.full((12,), 5, dtype=torch.int64)
    ids, weights, pos = routing.route(torch.nn.functional.linear(x, w_gate), 3, norm, hits, torch.float32)
    assert torch.equal(ids, ids_ref.gather(1, order))
    torch.testing.assert_close(weights, weights_ref.gather(1, order), atol=1e-6, rtol=1e-5)
    assert torch.equal(hits, counts_ref + 5)
    k_plus_1 = torch.arange(1, 4, dtype=torch.int8).expand(7, 3)
    expected_pos = torch.zeros(7, 12, dtype=torch.int8).scatter_(1, ids, k_plus_1)
    assert torch.equal(pos, expected_pos)


def _assert_routes_like_route(routing, x, w_gate, norm, ids, weights, hits):
    """ids and weights as route's from F.linear's logits; hits (from 5) counted; counters reset."""
    num_experts = w_gate.shape[0]
    ids_ref, weights_ref, pos_ref = routing.route(torch.nn.functional.linear(x, w_gate), 3, norm,
                                                torch.zeros(num_experts, dtype=torch.int64), torch.float32)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(weights, weights_ref, atol=1e-6, rtol=1e-5)
    assert torch.equal(hits - 5, torch.bincount(ids.flatten(), minlength=num_experts))
    assert not routing._GATE_ROUTE_COUNTS[x.device].any()  # set back for the next step
    return pos_ref


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("num_experts", [12, 40])
def test_gate_route_matches_route(routing, norm, num_experts):
    """12 experts: one program per split, its block partly past the experts; 40: three blocks.
    Hidden 72 in 8 splits of 9: every split partial."""
    x, w_gate = _randn(1, 72, seed=26), _randn(num_experts, 72, seed=27)
    hits = torch.full((num_experts,), 5, dtype=torch.int64)
    ids, weights, pos = routing.gate_route(x, w_gate, 3, norm, hits)
    assert torch.equal(pos, _assert_routes_like_route(routing, x, w_gate, norm, ids, weights, hits))


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("num_experts", [12, 40])
@pytest.mark.parametrize("num_tokens", [2, 16, 37])
def test_gate_route_rows_matches_route(routing, norm, num_experts, num_tokens):
    """Blocks of 16 rows (37: the last one partial; x a strided view), hidden 72 in 8 splits
    rounded up to the 64-wide step: one split partial, the rest past the end (empty). Each
    block's rows per expert come out as align's count kernel counts them."""
    x = _randn(num_tokens, 80, seed=30)[:, :72]
    w_gate = _randn(num_experts, 72, seed=31)
    hits = torch.full((num_experts,), 5, dtype=torch.int64)
    ids, weights, counts = routing.gate_route_rows(x, w_gate, 3, norm, hits)
    _assert_routes_like_route(routing, x, w_gate, norm, ids, weights, hits)
    blocks = [torch.bincount(ids[i:i + 16].flatten(), minlength=num_experts) for i in range(0, num_tokens, 16)]
    assert torch.equal(counts, torch.stack(blocks).int())


@pytest.mark.parametrize("num_tokens", [1, 20])
def test_gate_routing_rounds_the_logits_like_f_linear(routing, num_tokens):
    """fp16: each row's logits rounded to fp16 before the softmax, as moe_dispatch.gate's F.linear output
    (one token: gate_route; more: gate_route_rows)."""
    half = torch.float16
    x, w_gate = _randn(num_tokens, 64, seed=28).to(half), _randn(16, 64, seed=29).to(half)
    ids_ref, weights_ref, _ = gate(x, w_gate, 4, True)
    route = routing.gate_route if num_tokens == 1 else routing.gate_route_rows
    ids, weights, _ = route(x, w_gate, 4, True, torch.zeros(16, dtype=torch.int64))
    order = ids_ref.argsort(dim=1)
    assert torch.equal(ids, ids_ref.gather(1, order))
    assert torch.equal(weights, weights_ref.gather(1, order))


def _moe_layer(num_experts=8, hidden=48, width=40, top_k=3, seed=9, backend="auto"):
    generator = torch.Generator().manual_seed(seed)
    w_gate_up = torch.randn(num_experts, 2 * width, hidden, generator=generator) / hidden ** 0.5
    w_down = torch.randn(num_experts, hidden, width, generator=generator) / width ** 0.5
    w_gate = torch.randn(num_experts, hidden, generator=generator)
    return MoELayer(w_gate, w_gate_up, w_down, top_k=top_k, norm_topk_prob=True, comm=ExpertComm.local(),
                    hit_counts_E=torch.zeros(num_experts, dtype=torch.int64), backend=backend)


# Tiles smaller than the test shape (D 48, F 40), so that every loop runs several times
# and the last block of each is partial.
SMALL_TILES = dict(gate_up_f=16, gate_up_d=16, gate_up_stages=2, gate_up_warps=4, down_o=16, down_f=16,
                   down_warps=4)
# The same with a single token's gate_up on the CUDA cores.
FMA_TILES = dict(SMALL_TILES, gate_up_fma=True)
# The same through the one-token kernels (top_k 3 of a 4-row block: the last row masked).
ONE_TOKEN_TILES = dict(SMALL_TILES, one_token=True, down_stages=2)


@pytest.mark.parametrize(("num_tokens", "tiles"), [(n, t) for n in (1, 2, 5, 16, 19, 64) for t in ("default", "small")]
                         + [(1, "fma"), (1, "one_token")])  # these take one token
def test_fused_moe_matches_moe_layer(moe_small, num_tokens, tiles):
    layer = _moe_layer()
    x = _randn(num_tokens, 48, seed=10)
    expected = layer(x)
    expected_hits = layer.hit_counts_E.clone()
    hits = torch.zeros(8, dtype=torch.int64)
    tiles = dict(small=moe_small.MoeTiles(**SMALL_TILES), fma=moe_small.MoeTiles(**FMA_TILES),
                 one_token=moe_small.MoeTiles(**ONE_TOKEN_TILES)).get(tiles, moe_small.moe_tiles(num_tokens))
    out = moe_small.fused_moe_tiled(x, layer.w_gate_ED, layer.w_gate_up_LGD, layer.w_down_LDF, 3, True, hits, tiles)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(hits, expected_hits) and hits.sum() == num_tokens * 3


def test_fused_moe_with_unused_slots(moe_small):
    """Tokens that all pick among experts 0-3 of 8: the step touches 4 experts of 8 slots,
    and the programs of the unused slots must write nothing."""
    layer = _moe_layer()
    layer.w_gate_ED[:4].abs_()
    layer.w_gate_ED[4:] = -layer.w_gate_ED[4:].abs()
    x = _randn(6, 48, seed=11).abs()
    expected = layer(x)
    hits = torch.zeros(8, dtype=torch.int64)
    out = moe_small.fused_moe_tiled(x, layer.w_gate_ED, layer.w_gate_up_LGD, layer.w_down_LDF, 3, True, hits,
                                moe_small.MoeTiles(**SMALL_TILES))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert hits[4:].sum() == 0 and torch.equal(hits, layer.hit_counts_E)


def test_fused_moe_rounds_like_torch_in_half_precision(moe_small):
    """fp16 (the interpreter's tl.dot reads bf16 as raw bits, so bf16 is checked on a GPU by
    the benchmarks): every intermediate rounded as moe_experts.experts and moe_dispatch.combine
    round it."""
    half = torch.float16
    layer = _moe_layer(num_experts=16, hidden=64, width=48, top_k=4)
    weights = [w.to(half) for w in (layer.w_gate_ED, layer.w_gate_up_LGD, layer.w_down_LDF)]
    layer = MoELayer(*weights, top_k=4, norm_topk_prob=True, comm=ExpertComm.local(),
                     hit_counts_E=torch.zeros(16, dtype=torch.int64))
    x = _randn(5, 64, seed=12).to(half)
    out = moe_small.fused_moe_tiled(x, *weights, 4, True, torch.zeros(16, dtype=torch.int64),
                                moe_small.MoeTiles(**SMALL_TILES))
    assert torch.equal(out, layer(x))


# Without the single-token kernels one token takes moe_tiles(1)'s tiles, not ONE_TOKEN_MOE_TILES:
# one case covers it.
@pytest.mark.parametrize(("single_token_kernels", "tiles"),
                         [(True, SMALL_TILES), (True, FMA_TILES), (True, ONE_TOKEN_TILES), (False, None)],
                         ids=["dot", "fma", "one-token", "no-single-token-kernels"])
def test_fused_moe_one_token_rounds_like_torch(launch, moe_small, monkeypatch, single_token_kernels, tiles):
    """One token (gate_route, or the matmul and route; tl.dot, FMA or one-token kernels),
    fp16: the same bits as the MoELayer."""
    half = torch.float16
    monkeypatch.setattr(launch, "SINGLE_TOKEN_KERNELS", single_token_kernels)
    if tiles is not None:
        monkeypatch.setattr(moe_small, "ONE_TOKEN_MOE_TILES", moe_small.MoeTiles(**tiles))
    else:
        monkeypatch.setattr(moe_small, "ONE_TOKEN_MOE_TILES", None)  # never read without them
    layer = _moe_layer(num_experts=16, hidden=64, width=48, top_k=4)
    weights = [w.to(half) for w in (layer.w_gate_ED, layer.w_gate_up_LGD, layer.w_down_LDF)]
    layer = MoELayer(*weights, top_k=4, norm_topk_prob=True, comm=ExpertComm.local(),
                     hit_counts_E=torch.zeros(16, dtype=torch.int64))
    for seed in range(3):
        x = _randn(1, 64, seed=30 + seed).to(half)
        hits = torch.zeros(16, dtype=torch.int64)
        assert torch.equal(moe_small.fused_moe(x, *weights, 4, True, hits), layer(x))
        assert hits.sum() == 4


def test_fused_moe_empty_step(moe_small):
    layer = _moe_layer()
    hits = torch.zeros(8, dtype=torch.int64)
    out = moe_small.fused_moe(torch.empty(0, 48), layer.w_gate_ED, layer.w_gate_up_LGD, layer.w_down_LDF, 3, True, hits)
    assert out.shape == (0, 48) and hits.sum() == 0


def test_moe_hook_stays_off_on_the_cpu(moe_small, monkeypatch):
    """The CPU keeps the torch MoE whatever the batch (its outputs stay bit-identical): "auto" is
    the torch backend there, and the Triton backend given CPU tensors takes the torch path."""
    monkeypatch.setattr(moe_small, "fused_moe", lambda *args: pytest.fail("fused_moe ran on the CPU"))
    assert isinstance(_moe_layer().backend, TorchMoE)
    x = _randn(2, 48)
    assert torch.equal(_moe_layer(backend="triton")(x, capacity=8 * 3), _moe_layer()(x, capacity=8 * 3))
