"""KVPool: shapes and how many blocks fit in memory."""

import pytest
import torch

from services.kv_pool import KVPool
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
