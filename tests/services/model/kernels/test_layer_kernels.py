"""The layer loop's kernels (services/model/kernels/: norm, rotary, gemv, fused_layer) against the
torch code they replace, on the CPU through Triton's interpreter.

TRITON_INTERPRET=1 must be set before the kernels are defined, so this file
sets it first. fp32 throughout (the model's CPU dtype) but for the fp16 checks
of the roundings; bf16 is checked on a GPU by the benchmarks.
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
from tests.triton_interpreter import interpreted_fixture  # noqa: E402


# The kernel modules, each imported under the interpreter (or the test skipped without triton).
norm = interpreted_fixture("kernels.norm")
rotary = interpreted_fixture("kernels.rotary")
gemv = interpreted_fixture("kernels.gemv")
launch = interpreted_fixture("kernels.launch")
fused_layer = interpreted_fixture("kernels.fused_layer")


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dim", [64, 48])
def test_add_rms_norm_matches_torch(norm, dim):
    x, h, w = _randn(5, dim, seed=1), _randn(5, dim, seed=2), _randn(dim, seed=3)
    x_fused = x.clone()
    y = norm.add_rms_norm_(x_fused, h, w, 1e-6)
    torch.testing.assert_close(x_fused, x + h, atol=0, rtol=0)  # the residual, updated in place
    torch.testing.assert_close(y, rms_norm(x + h, w, 1e-6), atol=1e-5, rtol=1e-5)
    # No residual: a plain RMSNorm leaving x alone.
    x_before = x.clone()
    torch.testing.assert_close(norm.add_rms_norm_(x, None, w, 1e-6), rms_norm(x_before, w, 1e-6),
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(x, x_before)
    assert norm.add_rms_norm_(torch.empty(0, dim), torch.empty(0, dim), w, 1e-6).shape == (0, dim)


def _check_qkv_norm_rotary(rotary, heads, num_tokens):
    num_heads, num_kv_heads, head_dim = heads
    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, seed=4)
    q_norm, k_norm = _randn(head_dim, seed=5), _randn(head_dim, seed=6)
    positions = torch.tensor([0, 3, 17, 5, 900, 2]).repeat(num_tokens // 6 + 1)[:num_tokens]
    cos, sin = RotaryEmbedding(head_dim, 10000.0, "cpu").cos_sin(positions, torch.float32)
    q, k, v = rotary.qkv_norm_rotary(qkv, q_norm, k_norm, cos, sin, num_heads, num_kv_heads, 1e-6)
    q_ref, k_ref, v_ref = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], 1)
    q_ref = apply_rotary(rms_norm(q_ref.reshape(num_tokens, num_heads, head_dim), q_norm, 1e-6), cos, sin)
    k_ref = apply_rotary(rms_norm(k_ref.reshape(num_tokens, num_kv_heads, head_dim), k_norm, 1e-6), cos, sin)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(v, v_ref.reshape(num_tokens, num_kv_heads, head_dim))


@pytest.mark.parametrize("heads", [(4, 2, 32), (3, 1, 24)])
def test_qkv_norm_rotary_matches_torch(rotary, heads):
    _check_qkv_norm_rotary(rotary, heads, 6)


@pytest.mark.parametrize("num_tokens", [6, 7, 37])
@pytest.mark.parametrize("heads", [(4, 2, 32), (3, 1, 24)])
def test_qkv_norm_rotary_token_blocks(rotary, heads, num_tokens, monkeypatch):
    """Blocks of several tokens per program (as a prefill step takes them, here from 5 tokens
    on), the last one partial: 6 tokens in blocks of 2, 7 in 2s and 37 in 16s."""
    monkeypatch.setattr(rotary, "QKV_ONE_TOKEN_STEPS", 4)
    assert rotary.qkv_tokens_per_program(num_tokens) == {6: 2, 7: 2, 37: 16}[num_tokens]
    _check_qkv_norm_rotary(rotary, heads, num_tokens)


def test_qkv_tokens_per_program(rotary):
    """One token per program up to 32 tokens, then about 32 blocks of up to 16 tokens."""
    assert [rotary.qkv_tokens_per_program(t) for t in (1, 32, 33, 64, 65, 128, 256, 512, 513, 65536)] == [
        1, 1, 2, 2, 4, 4, 8, 16, 16, 16]


@pytest.mark.parametrize("shape", [(40, 48), (64, 256)])
def test_gemv_matches_f_linear(gemv, shape):
    """Several column blocks and reduction steps, the last of each partial at (40, 48)."""
    x, w = _randn(1, shape[1], seed=20), _randn(*shape, seed=21)
    out = gemv.gemv(x, w, gemv.GemvTiles(block_n=16, block_k=32, stages=1, warps=4))
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w), atol=1e-5, rtol=1e-5)


def test_gemv_rounds_once_in_half_precision(gemv):
    """fp16: fp32 sums rounded once to fp16, as F.linear (the CPU's half matmul) rounds them."""
    half = torch.float16
    x, w = _randn(1, 256, seed=22).to(half), (_randn(48, 256, seed=23) / 16).to(half)
    out = gemv.gemv(x, w, gemv.GemvTiles(block_n=8, block_k=64, stages=1, warps=4))
    assert torch.equal(out, torch.nn.functional.linear(x.float(), w.float()).to(half))


def test_linear_takes_gemv_for_one_token(gemv, launch, monkeypatch):
    x, w = _randn(3, 48, seed=24), _randn(40, 48, seed=25)
    calls = []
    monkeypatch.setattr(gemv, "gemv", lambda *args: calls.append(args[0].shape[0]) or args[0] @ args[1].T)
    for num_tokens in (0, 1, 2, 3):
        torch.testing.assert_close(gemv.linear(x[:num_tokens], w), x[:num_tokens] @ w.T)
    monkeypatch.setattr(launch, "SINGLE_TOKEN_KERNELS", False)
    gemv.linear(x[:1], w)
    assert calls == [1]


def test_linear_takes_the_tiles_of_its_weight_shape(gemv, launch, monkeypatch):
    """GEMV_TILES_BY_SHAPE's tiles for the weights of that shape, GEMV_TILES for the others;
    plain launches on the CPU (no programmatic dependent launch off CUDA)."""
    own, default = gemv.GemvTiles(4, 16, 1, 4), gemv.GemvTiles(8, 32, 1, 4)
    monkeypatch.setattr(gemv, "GEMV_TILES_BY_SHAPE", {(40, 48): own})
    monkeypatch.setattr(gemv, "GEMV_TILES", default)
    calls = []
    monkeypatch.setattr(gemv, "gemv", lambda x, w, tiles: calls.append(tiles) or x @ w.T)
    gemv.linear(_randn(1, 48), _randn(40, 48))
    gemv.linear(_randn(1, 48), _randn(24, 48))
    assert calls == [own, default]
    assert not launch.uses_pdl(_randn(1, 48))


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
def test_model_fused_layers_match_torch(fused_layer, monkeypatch, num_rows):
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
            patch.setattr(qwen3_moe, "fused_kernels", lambda device: fused_layer.fused_layer_kernels())
            logits = models[1].forward_at_capacity(batch, pools[1], capacity)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(pools[1].k_cache, pools[0].k_cache, atol=1e-5, rtol=0)
    assert torch.equal(models[1].hit_counts_LE, models[0].hit_counts_LE)


def test_model_fused_layers_run_an_empty_step(fused_layer, monkeypatch):
    """A rank with nothing scheduled still runs the step (its peers' collectives need it):
    the fused loop must take a batch of zero tokens (it once failed reshaping [0, -1])."""
    config = _config()
    model = qwen3_moe.Qwen3MoeModel(config, random_weights(config, seed=5), expert_ids=range(4))
    pool = KVPool.for_model(config, 8, 4, torch.float32, "cpu")
    with monkeypatch.context() as patch:
        patch.setattr(qwen3_moe, "fused_kernels", lambda device: fused_layer.fused_layer_kernels())
        logits = model.forward_at_capacity(build_forward_batch([], 4, "cpu"), pool, None)
    assert logits.shape == (0, config.vocab_size)
    assert int(model.hit_counts_LE.sum()) == 0


def test_half_precision_rounds_like_torch(norm, rotary):
    """In fp16 (numpy's half: the interpreter rounds it as a GPU does) the kernels round every
    intermediate the torch code stores in the model dtype: the same bits."""
    half = torch.float16
    x, h, w = _randn(3, 256, seed=11).to(half), _randn(3, 256, seed=12).to(half), _randn(256, seed=13).to(half)
    x_fused = x.clone()
    assert torch.equal(norm.add_rms_norm_(x_fused, h, w, 1e-6), rms_norm(x + h, w, 1e-6))
    assert torch.equal(x_fused, x + h)
    qkv, norms = _randn(3, 8 * 128, seed=14).to(half), _randn(2, 128, seed=15).to(half)
    cos, sin = RotaryEmbedding(128, 1e6, "cpu").cos_sin(torch.tensor([1, 50, 3000]), half)
    q, k, _ = rotary.qkv_norm_rotary(qkv, norms[0], norms[1], cos, sin, 4, 2, 1e-6)
    assert torch.equal(q, apply_rotary(rms_norm(qkv[:, :512].reshape(3, 4, 128), norms[0], 1e-6), cos, sin))
    assert torch.equal(k, apply_rotary(rms_norm(qkv[:, 512:768].reshape(3, 2, 128), norms[1], 1e-6), cos, sin))


def test_half_precision_token_blocks(rotary, monkeypatch):
    """qkv_norm_rotary's token blocks (9 tokens in blocks of 4) round as the torch code: same bits."""
    half = torch.float16
    monkeypatch.setattr(rotary, "QKV_ONE_TOKEN_STEPS", 4)
    qkv, norms = _randn(9, 8 * 128, seed=16).to(half), _randn(2, 128, seed=17).to(half)
    cos, sin = RotaryEmbedding(128, 1e6, "cpu").cos_sin(torch.tensor([1, 50, 3000, 7, 0, 12, 99, 4, 2048]), half)
    q, k, v = rotary.qkv_norm_rotary(qkv, norms[0], norms[1], cos, sin, 4, 2, 1e-6)
    assert rotary.qkv_tokens_per_program(9) == 4
    assert torch.equal(q, apply_rotary(rms_norm(qkv[:, :512].reshape(9, 4, 128), norms[0], 1e-6), cos, sin))
    assert torch.equal(k, apply_rotary(rms_norm(qkv[:, 512:768].reshape(9, 2, 128), norms[1], 1e-6), cos, sin))
    assert torch.equal(v, qkv[:, 768:].reshape(9, 2, 128))


def test_fused_layer_kernels_follow_the_switch(fused_layer, gemv, launch, monkeypatch):
    """The loop's kernels are the modules' own, read at each step; none while launch.ENABLED is
    off; and none on the CPU, which keeps the torch loop."""
    monkeypatch.setattr(gemv, "linear", lambda x_TD, w_ND: torch.full((x_TD.shape[0], w_ND.shape[0]), 3.0))
    assert torch.equal(fused_layer.fused_layer_kernels().linear(torch.ones(2, 4), torch.ones(5, 4)),
                       torch.full((2, 5), 3.0))
    monkeypatch.setattr(launch, "ENABLED", False)
    assert fused_layer.fused_layer_kernels() is None
    assert qwen3_moe.fused_kernels(torch.device("cpu")) is None
