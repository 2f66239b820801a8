"""The paged KV cache of one rank: fixed-size blocks of K and V per layer.

A token at position p of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size`. The gateway owns
which blocks belong to which sequence; the pool is only the storage.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from services.model.batch import to_device
from services.model.config import ModelConfig


# ExpertConfig.kv_cache_dtype's names; "auto" is the model's compute dtype.
KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn}


def kv_cache_dtype(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for a kv_cache_dtype name ("auto": compute_dtype)."""
    if name == "auto":
        return compute_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be 'auto' or one of {sorted(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES[name]


class KVPool:
    """K and V caches, each [num_layers, num_blocks, block_size, num_kv_heads, head_dim].

    The caches may hold a narrower type than the model computes in (float8):
    attention writes new K/V rounded to it and reads them back widened.
    """

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        for name, value in (("num_layers", num_layers), ("num_blocks", num_blocks),
                            ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim)):
            if value <= 0:
                raise ValueError(f"KVPool {name} must be positive, got {value}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)

    @classmethod
    def for_model(cls, config: ModelConfig, num_blocks: int, block_size: int, dtype, device) -> "KVPool":
        """A pool shaped for the model's layers and KV heads."""
        return cls(config.num_hidden_layers, num_blocks, block_size,
                   config.num_key_value_heads, config.head_dim, dtype, device)

    @staticmethod
    def blocks_for_memory(config: ModelConfig, block_size: int, memory_bytes: int, dtype) -> int:
        """How many blocks (K and V, all layers) fit in memory_bytes."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if memory_bytes < 0:
            raise ValueError(f"memory_bytes must not be negative, got {memory_bytes}")
        return memory_bytes // _bytes_per_block(config, block_size, dtype)

    def layer(self, layer: int) -> tuple[Tensor, Tensor]:
        """The layer's K and V caches, each [num_blocks, block_size, num_kv_heads, head_dim]."""
        return self.k_cache[layer], self.v_cache[layer]

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copies each (source, destination) block's keys and values in every layer, every
        source read before any destination is written; queued on the device, no host sync."""
        if not copies:
            return
        index_2C = to_device(torch.tensor(copies, dtype=torch.long).T.contiguous(), self.k_cache.device)
        for cache in (self.k_cache, self.v_cache):
            # Byte views for float8 caches, which index_put does not take on every device.
            raw = cache.view(torch.uint8) if cache.element_size() == 1 else cache
            raw[:, index_2C[1]] = raw[:, index_2C[0]]

    @property
    def num_bytes(self) -> int:
        """Memory held by both caches."""
        return 2 * self.k_cache.numel() * self.k_cache.element_size()


def _bytes_per_block(config: ModelConfig, block_size: int, dtype) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    # 2: one K and one V entry per token, head and layer.
    return (2 * config.num_hidden_layers * block_size * config.num_key_value_heads
            * config.head_dim * element_size)
