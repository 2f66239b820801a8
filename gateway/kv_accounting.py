"""KV block accounting of one rank: the gateway's view of the rank's paged KV pool.

The rank owns the KV tensors; the gateway owns which block ids are in use.
`BlockAllocator` hands out block ids of one rank's pool and keeps the block
table of every sequence placed on that rank, grown as the sequence grows.
Blocks come back when the sequence is released (the gateway releases a
sequence in the same step plan that tells the rank to forget it).

No gRPC here: the batcher drives it and the tests call it directly.
"""

import collections


class BlockAllocator:
    """Block ids [0, num_blocks) of one rank's KV pool and the block tables using them."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # FIFO reuse: a freed block is handed out last, which spreads writes and
        # keeps a just-freed block's stale KV around longest (useful for a later prefix cache).
        self._free_ids: collections.deque[int] = collections.deque(range(num_blocks))
        self._is_used = [False] * num_blocks
        self._tables: dict[int, list[int]] = {}

    @property
    def num_free(self) -> int:
        """Blocks not held by any sequence."""
        return len(self._free_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens tokens."""
        assert num_tokens >= 0, num_tokens
        return -(-num_tokens // self.block_size)

    def allocate(self, num: int) -> list[int]:
        """Takes num free block ids; the caller checks num_free first."""
        assert 0 <= num <= len(self._free_ids), (num, len(self._free_ids))
        block_ids = [self._free_ids.popleft() for _ in range(num)]
        for block_id in block_ids:
            self._is_used[block_id] = True
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        """Returns block ids to the pool; freeing a block twice is a bug."""
        for block_id in block_ids:
            assert self._is_used[block_id], f"double free of block {block_id}"
            self._is_used[block_id] = False
            self._free_ids.append(block_id)

    # Per-sequence block tables.

    def has_sequence(self, seq_id: int) -> bool:
        """True while the sequence holds a block table here."""
        return seq_id in self._tables

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's blocks, in order (a copy)."""
        return list(self._tables[seq_id])

    def num_new_blocks(self, seq_id: int, num_tokens: int) -> int:
        """Blocks the sequence must add so that its table covers num_tokens tokens."""
        num_held = len(self._tables.get(seq_id, ()))
        return max(0, self.blocks_needed(num_tokens) - num_held)

    def can_grow(self, seq_id: int, num_tokens: int) -> bool:
        """True if the free blocks suffice to cover num_tokens tokens of the sequence."""
        return self.num_new_blocks(seq_id, num_tokens) <= self.num_free

    def grow(self, seq_id: int, num_tokens: int) -> list[int]:
        """Extends (or creates) the sequence's table to cover num_tokens; returns the new ids."""
        new_ids = self.allocate(self.num_new_blocks(seq_id, num_tokens))
        self._tables.setdefault(seq_id, []).extend(new_ids)
        return new_ids

    def release(self, seq_id: int) -> int:
        """Frees all blocks of the sequence and forgets it; returns how many were freed."""
        block_ids = self._tables.pop(seq_id)
        self.free(block_ids)
        return len(block_ids)
