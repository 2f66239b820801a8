"""KVPool: shapes, how many blocks fit in memory, and a float8 cache."""

import pytest
import torch

from services.kv_pool import KVPool, kv_cache_dtype
from services.model.attention import TorchReferenceAttention
from services.model.batch import SeqInput, build_forward_batch
from services.model.config import ModelConfig

CONFIG = ModelConfig(
    vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
)


def test_shapes_and_bytes():
    pool = KVPool.for_model(CONFIG, num_blocks=5, block_size=16, dtype=torch.bfloat16, device="cpu")
    assert pool.k_cache.shape == pool.v_cache.shape == (3, 5, 16, 2, 32)
    assert pool.k_cache.dtype == torch.bfloat16
    k, v = pool.layer(1)
    assert k.shape == (5, 16, 2, 32) and k.data_ptr() == pool.k_cache[1].data_ptr()
    assert pool.num_bytes == 2 * 3 * 5 * 16 * 2 * 32 * 2


def test_blocks_for_memory():
    # One block: K and V x 3 layers x 16 tokens x 2 heads x 32 dims x 2 bytes = 12,288 bytes.
    per_block = 2 * 3 * 16 * 2 * 32 * 2
    assert KVPool.blocks_for_memory(CONFIG, 16, 10 * per_block, torch.bfloat16) == 10
    assert KVPool.blocks_for_memory(CONFIG, 16, 10 * per_block - 1, torch.bfloat16) == 9
    assert KVPool.blocks_for_memory(CONFIG, 16, 10 * per_block, torch.float32) == 5
    assert KVPool.blocks_for_memory(CONFIG, 16, per_block - 1, torch.bfloat16) == 0
    pool = KVPool.for_model(CONFIG, 7, 16, torch.bfloat16, "cpu")
    assert KVPool.blocks_for_memory(CONFIG, 16, pool.num_bytes, torch.bfloat16) == 7


@pytest.mark.parametrize("block_size, memory", [(0, 1024), (16, -1)])
def test_blocks_for_memory_rejects_bad_input(block_size, memory):
    with pytest.raises(ValueError):
        KVPool.blocks_for_memory(CONFIG, block_size, memory, torch.float32)


def test_rejects_empty_pool():
    with pytest.raises(ValueError, match="num_blocks"):
        KVPool(2, 0, 16, 2, 32, torch.float32, "cpu")


def test_kv_cache_dtype_names():
    assert kv_cache_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert kv_cache_dtype("fp8_e4m3", torch.bfloat16) is torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_dtype("fp4", torch.bfloat16)


def test_fp8_cache_holds_twice_the_blocks_of_bf16():
    per_block_bf16 = 2 * 3 * 16 * 2 * 32 * 2
    assert KVPool.blocks_for_memory(CONFIG, 16, 10 * per_block_bf16, torch.float8_e4m3fn) == 20
    pool = KVPool.for_model(CONFIG, 4, 16, torch.float8_e4m3fn, "cpu")
    assert pool.k_cache.dtype == torch.float8_e4m3fn and pool.num_bytes == 4 * per_block_bf16 // 2


def test_reference_attention_with_an_fp8_cache():
    """New K/V are stored rounded to float8 and read back widened: the output equals the fp32
    reference run on a cache holding the same rounded values, and stays near the unrounded one."""
    generator = torch.Generator().manual_seed(0)
    seqs = [SeqInput(0, list(range(5)), 3, [2, 0], True), SeqInput(1, [7], 9, [1, 3, 4], True)]
    batch = build_forward_batch(seqs, 4, "cpu")
    q, k, v = (torch.randn(batch.num_tokens, h, 32, generator=generator) for h in (4, 2, 2))
    fp8 = KVPool(1, 6, 4, 2, 32, torch.float8_e4m3fn, "cpu")
    exact, rounded = (KVPool(1, 6, 4, 2, 32, torch.float32, "cpu") for _ in range(2))
    noise_k, noise_v = (torch.randn(exact.k_cache.shape, generator=generator) for _ in range(2))
    for pool in (fp8, exact):
        pool.k_cache.copy_(noise_k.to(pool.k_cache.dtype))
        pool.v_cache.copy_(noise_v.to(pool.v_cache.dtype))
    rounded.k_cache.copy_(fp8.k_cache.float())
    rounded.v_cache.copy_(fp8.v_cache.float())
    reference, scale = TorchReferenceAttention(), 32 ** -0.5
    out_fp8 = reference.forward(0, q, k, v, batch, fp8, scale)
    out_rounded = reference.forward(0, q, k.to(torch.float8_e4m3fn).float(), v.to(torch.float8_e4m3fn).float(),
                                    batch, rounded, scale)
    out_exact = reference.forward(0, q, k, v, batch, exact, scale)
    torch.testing.assert_close(out_fp8, out_rounded, rtol=0, atol=0)
    assert torch.equal(fp8.k_cache.float(), rounded.k_cache) and torch.equal(fp8.v_cache.float(), rounded.v_cache)
    assert 0 < (out_fp8 - out_exact).abs().max() < 0.25  # e4m3 keeps 3 mantissa bits: ~6% per value


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_copied_blocks_take_every_layers_keys_and_values_and_sources_are_read_first(dtype):
    pool = KVPool.for_model(CONFIG, num_blocks=4, block_size=2, dtype=dtype, device="cpu")
    values = torch.arange(pool.k_cache.numel(), dtype=torch.float32).reshape(pool.k_cache.shape) % 200
    pool.k_cache.copy_(values.to(dtype))
    pool.v_cache.copy_((-values).to(dtype))
    k_before, v_before = pool.k_cache.float().clone(), pool.v_cache.float().clone()
    pool.copy_blocks([(0, 1), (1, 0), (2, 3)])  # 0 and 1 swap: each reads the other's old contents
    for block, source in ((0, 1), (1, 0), (2, 2), (3, 2)):
        assert torch.equal(pool.k_cache[:, block].float(), k_before[:, source])
        assert torch.equal(pool.v_cache[:, block].float(), v_before[:, source])
    pool.copy_blocks([])  # nothing to do
    assert torch.equal(pool.k_cache[:, 3].float(), k_before[:, 2])
