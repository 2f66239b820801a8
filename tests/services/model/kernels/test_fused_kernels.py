"""The fused decode kernels (services/model/triton_fused.py) against the torch code they replace,
on the CPU through Triton's interpreter.

TRITON_INTERPRET=1 must be set before the kernels are defined, so this file
sets it first. fp32 throughout (the model's CPU dtype); the bf16 roundings are
checked on a GPU by bench/decode_graph_check.py.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from services.kv_pool import KVPool  # noqa: E402
from services.model import qwen3_moe  # noqa: E402
from services.model.batch import SeqInput, build_decode_batch, build_forward_batch  # noqa: E402
from services.model.config import ModelConfig  # noqa: E402
from services.model.layers import RotaryEmbedding, apply_rotary, rms_norm  # noqa: E402
from services.model.make_model import random_weights  # noqa: E402
from services.model.moe import ExpertComm, MoELayer, gate  # noqa: E402
from tests.triton_interpreter import interpreted  # noqa: E402


@pytest.fixture(scope="module")
def fused():
    """services.model.triton_fused under the interpreter, or a skip without triton."""
    with interpreted("triton_fused") as module:
        yield module


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dim", [64, 48])
def test_add_rms_norm_matches_torch(fused, dim):
    x, h, w = _randn(5, dim, seed=1), _randn(5, dim, seed=2), _randn(dim, seed=3)
    x_fused = x.clone()
    y = fused.add_rms_norm_(x_fused, h, w, 1e-6)
    torch.testing.assert_close(x_fused, x + h, atol=0, rtol=0)  # the residual, updated in place
    torch.testing.assert_close(y, rms_norm(x + h, w, 1e-6), atol=1e-5, rtol=1e-5)
    # No residual: a plain RMSNorm leaving x alone.
    x_before = x.clone()
    torch.testing.assert_close(fused.add_rms_norm_(x, None, w, 1e-6), rms_norm(x_before, w, 1e-6),
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(x, x_before)
    assert fused.add_rms_norm_(torch.empty(0, dim), torch.empty(0, dim), w, 1e-6).shape == (0, dim)


def _check_qkv_norm_rotary(fused, heads, num_tokens):
    num_heads, num_kv_heads, head_dim = heads
    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, seed=4)
    q_norm, k_norm = _randn(head_dim, seed=5), _randn(head_dim, seed=6)
    positions = torch.tensor([0, 3, 17, 5, 900, 2]).repeat(num_tokens // 6 + 1)[:num_tokens]
    cos, sin = RotaryEmbedding(head_dim, 10000.0, "cpu").cos_sin(positions, torch.float32)
    q, k, v = fused.qkv_norm_rotary(qkv, q_norm, k_norm, cos, sin, num_heads, num_kv_heads, 1e-6)
    q_ref, k_ref, v_ref = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], 1)
    q_ref = apply_rotary(rms_norm(q_ref.reshape(num_tokens, num_heads, head_dim), q_norm, 1e-6), cos, sin)
    k_ref = apply_rotary(rms_norm(k_ref.reshape(num_tokens, num_kv_heads, head_dim), k_norm, 1e-6), cos, sin)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(v, v_ref.reshape(num_tokens, num_kv_heads, head_dim))


@pytest.mark.parametrize("heads", [(4, 2, 32), (3, 1, 24)])
def test_qkv_norm_rotary_matches_torch(fused, heads):
    _check_qkv_norm_rotary(fused, heads, 6)


@pytest.mark.parametrize("num_tokens", [6, 7, 37])
@pytest.mark.parametrize("heads", [(4, 2, 32), (3, 1, 24)])
def test_qkv_norm_rotary_token_blocks(fused, heads, num_tokens, monkeypatch):
    """Blocks of several tokens per program (as a prefill step takes them, here from 5 tokens
    on), the last one partial: 6 tokens in blocks of 2, 7 in 2s and 37 in 16s."""
    monkeypatch.setattr(fused, "QKV_ONE_TOKEN_STEPS", 4)
    assert fused.qkv_tokens_per_program(num_tokens) == {6: 2, 7: 2, 37: 16}[num_tokens]
    _check_qkv_norm_rotary(fused, heads, num_tokens)


def test_qkv_tokens_per_program(fused):
    """One token per program up to 32 tokens, then about 32 blocks of up to 16 tokens."""
    assert [fused.qkv_tokens_per_program(t) for t in (1, 32, 33, 64, 65, 128, 256, 512, 513, 65536)] == [
        1, 1, 2, 2, 4, 4, 8, 16, 16, 16]


@pytest.mark.parametrize("top_k", [3, 4, 8])
def test_route_breaks_ties_to_the_lowest_expert(fused, top_k):
    """Equal probabilities (equal logits) are taken lowest expert first, as the K largest are
    picked, across every one of the K places; 12 experts padded to a block of 16."""
    logits = torch.tensor([[1.0] * 12,
                           [0.0, 2.0, 2.0, 1.0, 2.0, 2.0, 1.0, 1.0, 3.0, 1.0, 0.5, 2.0],
                           [-1.0] * 6 + [4.0] * 6])
    ids, weights, _ = fused.route(logits, top_k, True, torch.zeros(12, dtype=torch.int64), torch.float32)
    # stable descending sort: among equal values the lower index comes first
    expected = logits.argsort(dim=1, descending=True, stable=True)[:, :top_k].sort(dim=1).values
    assert torch.equal(ids, expected)
    assert torch.allclose(weights.sum(1), torch.ones(3))


@pytest.mark.parametrize("norm", [True, False])
def test_route_matches_gate(fused, norm):
    x, w_gate = _randn(7, 32, seed=7), _randn(12, 32, seed=8)
    ids_ref, weights_ref, counts_ref = gate(x, w_gate, 3, norm)
    order = ids_ref.argsort(dim=1)  # route gives each token's experts in increasing order
    hits = torch.full((12,), 5, dtype=torch.int64)
    ids, weights, pos = fused.route(torch.nn.functional.linear(x, w_gate), 3, norm, hits, torch.float32)
    assert torch.equal(ids, ids_ref.gather(1, order))
    torch.testing.assert_close(weights, weights_ref.gather(1, order), atol=1e-6, rtol=1e-5)
    assert torch.equal(hits, counts_ref + 5)
    k_plus_1 = torch.arange(1, 4, dtype=torch.int8).expand(7, 3)
    expected_pos = torch.zeros(7, 12, dtype=torch.int8).scatter_(1, ids, k_plus_1)
    assert torch.equal(pos, expected_pos)


@pytest.mark.parametrize("shape", [(40, 48), (64, 256)])
def test_gemv_matches_f_linear(fused, shape):
    """Several column blocks and reduction steps, the last of each partial at (40, 48)."""
    x, w = _randn(1, shape[1], seed=20), _randn(*shape, seed=21)
    out = fused.gemv(x, w, fused.GemvTiles(block_n=16, block_k=32, stages=1, warps=4))
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w), atol=1e-5, rtol=1e-5)


def test_gemv_rounds_once_in_half_precision(fused):
    """fp16: fp32 sums rounded once to fp16, as F.linear (the CPU's half matmul) rounds them."""
    half = torch.float16
    x, w = _randn(1, 256, seed=22).to(half), (_randn(48, 256, seed=23) / 16).to(half)
    out = fused.gemv(x, w, fused.GemvTiles(block_n=8, block_k=64, stages=1, warps=4))
    assert torch.equal(out, torch.nn.functional.linear(x.float(), w.float()).to(half))


def test_linear_takes_gemv_for_one_token(fused, monkeypatch):
    x, w = _randn(3, 48, seed=24), _randn(40, 48, seed=25)
    calls = []
    monkeypatch.setattr(fused, "gemv", lambda *args: calls.append(args[0].shape[0]) or args[0] @ args[1].T)
    for num_tokens in (0, 1, 2, 3):
        torch.testing.assert_close(fused.linear(x[:num_tokens], w), x[:num_tokens] @ w.T)
    monkeypatch.setattr(fused, "SINGLE_TOKEN_KERNELS", False)
    fused.linear(x[:1], w)
    assert calls == [1]


def test_linear_takes_the_tiles_of_its_weight_shape(fused, monkeypatch):
    """GEMV_TILES_BY_SHAPE's tiles for the weights of that shape, GEMV_TILES for the others;
    plain launches on the CPU (no programmatic dependent launch off CUDA)."""
    own, default = fused.GemvTiles(4, 16, 1, 4), fused.GemvTiles(8, 32, 1, 4)
    monkeypatch.setattr(fused, "GEMV_TILES_BY_SHAPE", {(40, 48): own})
    monkeypatch.setattr(fused, "GEMV_TILES", default)
    calls = []
    monkeypatch.setattr(fused, "gemv", lambda x, w, tiles: calls.append(tiles) or x @ w.T)
    fused.linear(_randn(1, 48), _randn(40, 48))
    fused.linear(_randn(1, 48), _randn(24, 48))
    assert calls == [own, default]
    assert not fused.uses_pdl(_randn(1, 48))


def _assert_routes_like_route(fused, x, w_gate, norm, ids, weights, hits):
    """ids and weights as route's from F.linear's logits; hits (from 5) counted; counters reset."""
    num_experts = w_gate.shape[0]
    ids_ref, weights_ref, pos_ref = fused.route(torch.nn.functional.linear(x, w_gate), 3, norm,
                                                torch.zeros(num_experts, dtype=torch.int64), torch.float32)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(weights, weights_ref, atol=1e-6, rtol=1e-5)
    assert torch.equal(hits - 5, torch.bincount(ids.flatten(), minlength=num_experts))
    assert not fused._GATE_ROUTE_COUNTS[x.device].any()  # set back for the next step
    return pos_ref


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("num_experts", [12, 40])
def test_gate_route_matches_route(fused, norm, num_experts):
    """12 experts: one program per split, its block partly past the experts; 40: three blocks.
    Hidden 72 in 8 splits of 9: every split partial."""
    x, w_gate = _randn(1, 72, seed=26), _randn(num_experts, 72, seed=27)
    hits = torch.full((num_experts,), 5, dtype=torch.int64)
    ids, weights, pos = fused.gate_route(x, w_gate, 3, norm, hits)
    assert torch.equal(pos, _assert_routes_like_route(fused, x, w_gate, norm, ids, weights, hits))


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("num_experts", [12, 40])
@pytest.mark.parametrize("num_tokens", [2, 16, 37])
def test_gate_route_rows_matches_route(fused, norm, num_experts, num_tokens):
    """Blocks of 16 rows (37: the last one partial; x a strided view), hidden 72 in 8 splits
    rounded up to the 64-wide step: one split partial, the rest past the end (empty). Each
    block's rows per expert come out as align's count kernel counts them."""
    x = _randn(num_tokens, 80, seed=30)[:, :72]
    w_gate = _randn(num_experts, 72, seed=31)
    hits = torch.full((num_experts,), 5, dtype=torch.int64)
    ids, weights, counts = fused.gate_route_rows(x, w_gate, 3, norm, hits)
    _assert_routes_like_route(fused, x, w_gate, norm, ids, weights, hits)
    blocks = [torch.bincount(ids[i:i + 16].flatten(), minlength=num_experts) for i in range(0, num_tokens, 16)]
    assert torch.equal(counts, torch.stack(blocks).int())


@pytest.mark.parametrize("num_tokens", [1, 20])
def test_gate_routing_rounds_the_logits_like_f_linear(fused, num_tokens):
    """fp16: each row's logits rounded to fp16 before the softmax, as moe.gate's F.linear output
    (one token: gate_route; more: gate_route_rows)."""
    half = torch.float16
    x, w_gate = _randn(num_tokens, 64, seed=28).to(half), _randn(16, 64, seed=29).to(half)
    ids_ref, weights_ref, _ = gate(x, w_gate, 4, True)
    route = fused.gate_route if num_tokens == 1 else fused.gate_route_rows
    ids, weights, _ = route(x, w_gate, 4, True, torch.zeros(16, dtype=torch.int64))
    order = ids_ref.argsort(dim=1)
    assert torch.equal(ids, ids_ref.gather(1, order))
    assert torch.equal(weights, weights_ref.gather(1, order))


def _moe_layer(num_experts=8, hidden=48, width=40, top_k=3, seed=9):
    generator = torch.Generator().manual_seed(seed)
    w_gate_up = torch.randn(num_experts, 2 * width, hidden, generator=generator) / hidden ** 0.5
    w_down = torch.randn(num_experts, hidden, width, generator=generator) / width ** 0.5
    w_gate = torch.randn(num_experts, hidden, generator=generator)
    return MoELayer(w_gate, w_gate_up, w_down, top_k=top_k, norm_topk_prob=True, comm=ExpertComm.local(),
                    hit_counts_E=torch.zeros(num_experts, dtype=torch.int64))


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
def test_fused_moe_matches_moe_layer(fused, num_tokens, tiles):
    layer = _moe_layer()
    x = _randn(num_tokens, 48, seed=10)
    expected = layer(x)
    expected_hits = layer.hit_counts_E.clone()
    hits = torch.zeros(8, dtype=torch.int64)
    tiles = dict(small=fused.MoeTiles(**SMALL_TILES), fma=fused.MoeTiles(**FMA_TILES),
                 one_token=fused.MoeTiles(**ONE_TOKEN_TILES)).get(tiles, fused.moe_tiles(num_tokens))
    out = fused.fused_moe_tiled(x, layer.w_gate_ED, layer.w_gate_up_LGD, layer.w_down_LDF, 3, True, hits, tiles)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(hits, expected_hits) and hits.sum() == num_tokens * 3


def test_fused_moe_with_unused_slots(fused):
    """Tokens that all pick among experts 0-3 of 8: the step touches 4 experts of 8 slots,
    and the programs of the unused slots must write nothing."""
    layer = _moe_layer()
    layer.w_gate_ED[:4].abs_()
    layer.w_gate_ED[4:] = -layer.w_gate_ED[4:].abs()
    x = _randn(6, 48, seed=11).abs()
    expected = layer(x)
    hits = torch.zeros(8, dtype=torch.int64)
    out = fused.fused_moe_tiled(x, layer.w_gate_ED, layer.w_gate_up_LGD, layer.w_down_LDF, 3, True, hits,
                                fused.MoeTiles(**SMALL_TILES))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert hits[4:].sum() == 0 and torch.equal(hits, layer.hit_counts_E)


def test_fused_moe_rounds_like_torch_in_half_precision(fused):
    """fp16 (the interpreter's tl.dot reads bf16 as raw bits, so bf16 is checked on a GPU by
    bench/moe_small_batch.py): every intermediate rounded as moe.experts/combine round it."""
    half = torch.float16
    layer = _moe_layer(num_experts=16, hidden=64, width=48, top_k=4)
    weights = [w.to(half) for w in (layer.w_gate_ED, layer.w_gate_up_LGD, layer.w_down_LDF)]
    layer = MoELayer(*weights, top_k=4, norm_topk_prob=True, comm=ExpertComm.local(),
                     hit_counts_E=torch.zeros(16, dtype=torch.int64))
    x = _randn(5, 64, seed=12).to(half)
    out = fused.fused_moe_tiled(x, *weights, 4, True, torch.zeros(16, dtype=torch.int64),
                                fused.MoeTiles(**SMALL_TILES))
    assert torch.equal(out, layer(x))


@pytest.mark.parametrize("single_token_kernels", [True, False])
@pytest.mark.parametrize("tiles", [SMALL_TILES, FMA_TILES, ONE_TOKEN_TILES])
def test_fused_moe_one_token_rounds_like_torch(fused, monkeypatch, single_token_kernels, tiles):
    """One token (gate_route, or the matmul and route; tl.dot, FMA or one-token kernels),
    fp16: the same bits as the MoELayer."""
    half = torch.float16
    monkeypatch.setattr(fused, "SINGLE_TOKEN_KERNELS", single_token_kernels)
    monkeypatch.setattr(fused, "ONE_TOKEN_MOE_TILES", fused.MoeTiles(**tiles))
    layer = _moe_layer(num_experts=16, hidden=64, width=48, top_k=4)
    weights = [w.to(half) for w in (layer.w_gate_ED, layer.w_gate_up_LGD, layer.w_down_LDF)]
    layer = MoELayer(*weights, top_k=4, norm_topk_prob=True, comm=ExpertComm.local(),
                     hit_counts_E=torch.zeros(16, dtype=torch.int64))
    for seed in range(3):
        x = _randn(1, 64, seed=30 + seed).to(half)
        hits = torch.zeros(16, dtype=torch.int64)
        assert torch.equal(fused.fused_moe(x, *weights, 4, True, hits), layer(x))
        assert hits.sum() == 4


def test_fused_moe_empty_step(fused):
    layer = _moe_layer()
    hits = torch.zeros(8, dtype=torch.int64)
    out = fused.fused_moe(torch.empty(0, 48), layer.w_gate_ED, layer.w_gate_up_LGD, layer.w_down_LDF, 3, True, hits)
    assert out.shape == (0, 48) and hits.sum() == 0


def test_moe_hook_stays_off_on_the_cpu(fused, monkeypatch):
    """The CPU keeps the torch MoE whatever the batch (its outputs stay bit-identical)."""
    monkeypatch.setattr(fused, "fused_moe", lambda *args: pytest.fail("fused_moe ran on the CPU"))
    layer = _moe_layer()
    layer(_randn(2, 48), capacity=8 * 3)
    assert qwen3_moe._fused_kernels(torch.device("cpu")) is None


def test_qkv_weights_are_views_of_one_matrix():
    config = _config()
    model = qwen3_moe.Qwen3MoeModel(config, random_weights(config, seed=2), expert_ids=range(4))
    layer = model.layers[0]
    assert layer.w_qkv_XD.shape == ((4 + 2 * 2) * 32, 64)
    for view in (layer.w_q_HKD, layer.w_k_GKD, layer.w_v_GKD):
        assert view.is_contiguous() and view.untyped_storage().data_ptr() == layer.w_qkv_XD.data_ptr()


def _config() -> ModelConfig:
    return ModelConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, intermediate_size=96, moe_intermediate_size=32,
                       num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=128,
                       dtype=torch.float32)


@pytest.mark.parametrize("num_rows", [1, 2])
def test_model_fused_layers_match_torch(fused, monkeypatch, num_rows):
    """The whole model with the fused layer loop (forced on the CPU) against the torch loop:
    a prefill chunk, then decode steps (1 row: gemv and gate_route; 2: one padding row);
    same logits, same hit counts."""
    config = _config()
    weights = random_weights(config, seed=5)
    models = [qwen3_moe.Qwen3MoeModel(config, weights, expert_ids=range(4)) for _ in range(2)]
    pools = [KVPool.for_model(config, 8, 4, torch.float32, "cpu") for _ in models]
    tokens = torch.randint(128, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    batches = [build_forward_batch([SeqInput(0, tokens[:7], 0, [3, 1], True)], 4, "cpu")]
    batches += [build_decode_batch([SeqInput(0, [tokens[n]], n, [3, 1, 6], True)], 4, "cpu", num_rows=num_rows,
                                   max_blocks=3) for n in (7, 8)]
    for batch, capacity in zip(batches, (None, 4, 4)):
        expected = models[0].forward_at_capacity(batch, pools[0], capacity)
        with monkeypatch.context() as patch:
            patch.setattr(qwen3_moe, "_fused_kernels", lambda device: fused)
            logits = models[1].forward_at_capacity(batch, pools[1], capacity)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(pools[1].k_cache, pools[0].k_cache, atol=1e-5, rtol=0)
    assert torch.equal(models[1].hit_counts_LE, models[0].hit_counts_LE)


def test_model_fused_layers_run_an_empty_step(fused, monkeypatch):
    """A rank with nothing scheduled still runs the step (its peers' collectives need it):
    the fused loop must take a batch of zero tokens (it once failed reshaping [0, -1])."""
    config = _config()
    model = qwen3_moe.Qwen3MoeModel(config, random_weights(config, seed=5), expert_ids=range(4))
    pool = KVPool.for_model(config, 8, 4, torch.float32, "cpu")
    with monkeypatch.context() as patch:
        patch.setattr(qwen3_moe, "_fused_kernels", lambda device: fused)
        logits = model.forward_at_capacity(build_forward_batch([], 4, "cpu"), pool, None)
    assert logits.shape == (0, config.vocab_size)
    assert int(model.hit_counts_LE.sum()) == 0


def test_half_precision_rounds_like_torch(fused):
    """In fp16 (numpy's half: the interpreter rounds it as a GPU does) the kernels round every
    intermediate the torch code stores in the model dtype: the same bits."""
    half = torch.float16
    x, h, w = _randn(3, 256, seed=11).to(half), _randn(3, 256, seed=12).to(half), _randn(256, seed=13).to(half)
    x_fused = x.clone()
    assert torch.equal(fused.add_rms_norm_(x_fused, h, w, 1e-6), rms_norm(x + h, w, 1e-6))
    assert torch.equal(x_fused, x + h)
    qkv, norms = _randn(3, 8 * 128, seed=14).to(half), _randn(2, 128, seed=15).to(half)
    cos, sin = RotaryEmbedding(128, 1e6, "cpu").cos_sin(torch.tensor([1, 50, 3000]), half)
    q, k, _ = fused.qkv_norm_rotary(qkv, norms[0], norms[1], cos, sin, 4, 2, 1e-6)
    assert torch.equal(q, apply_rotary(rms_norm(qkv[:, :512].reshape(3, 4, 128), norms[0], 1e-6), cos, sin))
    assert torch.equal(k, apply_rotary(rms_norm(qkv[:, 512:768].reshape(3, 2, 128), norms[1], 1e-6), cos, sin))


def test_half_precision_token_blocks(fused, monkeypatch):
    """qkv_norm_rotary's token blocks (9 tokens in blocks of 4) round as the torch code: same bits."""
    half = torch.float16
    monkeypatch.setattr(fused, "QKV_ONE_TOKEN_STEPS", 4)
    qkv, norms = _randn(9, 8 * 128, seed=16).to(half), _randn(2, 128, seed=17).to(half)
    cos, sin = RotaryEmbedding(128, 1e6, "cpu").cos_sin(torch.tensor([1, 50, 3000, 7, 0, 12, 99, 4, 2048]), half)
    q, k, v = fused.qkv_norm_rotary(qkv, norms[0], norms[1], cos, sin, 4, 2, 1e-6)
    assert fused.qkv_tokens_per_program(9) == 4
    assert torch.equal(q, apply_rotary(rms_norm(qkv[:, :512].reshape(9, 4, 128), norms[0], 1e-6), cos, sin))
    assert torch.equal(k, apply_rotary(rms_norm(qkv[:, 512:768].reshape(9, 2, 128), norms[1], 1e-6), cos, sin))
    assert torch.equal(v, qkv[:, 768:].reshape(9, 2, 128))


def test_op_count_cpu(tmp_path):
    """bench/op_count.py on the CPU: the eager path's aten ops per decode layer, written out."""
    import json

    from bench import op_count

    assert op_count.main(["--out", str(tmp_path)]) == 0
    counts = json.loads((tmp_path / "op_count_cpu.json").read_text())["cpu_eager"]
    assert counts["layers"] == 4 and counts["ops_per_step"] == 4 * counts["ops_per_layer"]
    assert 50 < counts["ops_per_layer"] < 500 and counts["top"]["aten::linear"] >= 4
