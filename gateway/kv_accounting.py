"""KV block accounting of one rank: the gateway's view of the rank's paged KV pool.

The rank owns the KV tensors; the gateway owns which block ids are in use.
`BlockAllocator` is the free list of one pool. `RankKV` adds the prefix cache
(prefix_cache.PrefixCache) and the block table of every sequence on the rank:

- `open` starts a sequence on the blocks of its longest cached prefix
  (referenced, not copied) and `grow` appends fresh blocks as it advances,
  evicting unreferenced cached blocks (LRU) when the free list runs dry;
  where the cached prefix goes on inside a block (`PrefixMatch.tail`), the
  sequence's first fresh block is a copy of that block (`pop_copy`: the
  rank copies it before the step), so it computes only the tokens after it;
- `publish` puts the sequence's full, computed blocks into the prefix cache,
  so that later sequences with the same prefix reuse them, `share_tail` its
  partly filled prompt block while it runs (a live node: copied from, never
  evicted) and `keep_tail` its partly filled last block once it ends;
- `release` drops the sequence: cached blocks lose a reference and stay
  cached, its other blocks go back to the free list.

Every block is in exactly one place: the free list, the prefix cache (with or
without references), or the private tail of one sequence's table. So
`num_free + cache.num_blocks + private blocks == num_blocks` always
(`check_invariants`), which the tests use to show that nothing leaks.

No gRPC here: the batcher drives it and the tests call it directly.
"""

import collections
import dataclasses
from collections.abc import Sequence

from gateway.prefix_cache import Node, PrefixCache, extend_block_hashes


class BlockAllocator:
    """The free list of block ids [0, num_blocks) of one rank's KV pool."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # FIFO reuse: a freed block is handed out last, which spreads writes.
        self._free_ids: collections.deque[int] = collections.deque(range(num_blocks))
        self._is_used = [False] * num_blocks

    @property
    def num_free(self) -> int:
        """Blocks on the free list."""
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

    def free(self, block_ids: Sequence[int]) -> None:
        """Returns block ids to the pool; freeing a block twice is a bug."""
        for block_id in block_ids:
            assert self._is_used[block_id], f"double free of block {block_id}"
            self._is_used[block_id] = False
            self._free_ids.append(block_id)


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The cached prefix a sequence would start from on one rank."""

    nodes: list[Node]
    # The tokens of the full nodes and of the tail.
    num_cached_tokens: int
    # Nodes of the match no sequence holds (the tail's included): they count as available until acquired.
    num_unreferenced: int
    # The block whose first num_cached_tokens % block_size tokens go on from the nodes' (copied, not shared).
    tail: Node | None = None


_NO_MATCH = PrefixMatch([], 0, 0)


@dataclasses.dataclass(slots=True)
class _Table:
    block_ids: list[int]
    # Cache nodes this sequence holds a reference on, one per leading block. Where
    # path[i].block_id != block_ids[i] the sequence computed a block that was already
    # cached: its own copy stays private and is freed on release.
    path: list[Node]
    is_publishing: bool = True
    # The cached block the sequence's first fresh block copies (held until pop_copy).
    copy_source: Node | None = None
    # Its own partly filled block as a live node of the cache (share_tail), while it is one.
    live_tail: Node | None = None


class RankKV:
    """Block ids of one rank's KV pool: free list, prefix cache, per-sequence tables."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_cache: bool = True) -> None:
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.cache = PrefixCache(block_size) if enable_prefix_cache else None
        self._tables: dict[int, _Table] = {}

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    @property
    def num_free(self) -> int:
        """Blocks on the free list."""
        return self.allocator.num_free

    @property
    def num_available(self) -> int:
        """Blocks a sequence could get now: free ones plus unreferenced cached ones."""
        return self.allocator.num_free + (self.cache.num_unreferenced if self.cache else 0)

    def blocks_needed(self, num_tokens: int) -> int:
        return self.allocator.blocks_needed(num_tokens)

    # The prefix cache.

    def match(self, token_ids: list[int], hashes: list[int], *, is_estimate: bool = False) -> PrefixMatch:
        """The longest cached prefix of token_ids, leaving at least one token to compute: full
        blocks, then the tokens a cached block after them begins with (the tail, copied).

        hashes is the sequence's list of block hashes, extended here as needed.
        An estimate skips comparing the tokens (see PrefixCache.match) and the tail: never open() one.
        """
        if self.cache is None or len(token_ids) <= 1:
            return _NO_MATCH
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        if len(hashes) < max_blocks:
            extend_block_hashes(hashes, token_ids, bs, max_blocks)
        nodes = self.cache.match(token_ids, hashes, max_blocks, is_verified=not is_estimate)
        num_cached = len(nodes) * bs
        num_unreferenced = sum(n.ref_count == 0 for n in nodes)
        if is_estimate:
            return PrefixMatch(nodes, num_cached, num_unreferenced)
        tail, num_tail = self.cache.match_tail(nodes[-1] if nodes else self.cache.root,
                                               token_ids[num_cached:num_cached + bs], len(token_ids) - 1 - num_cached)
        if tail is None:
            return PrefixMatch(nodes, num_cached, num_unreferenced) if nodes else _NO_MATCH
        return PrefixMatch(nodes, num_cached + num_tail, num_unreferenced + (tail.ref_count == 0), tail)

    def open(self, seq_id: int, match: PrefixMatch) -> list[int]:
        """Starts the sequence's table on the matched cached blocks; returns their ids. With a
        tail, the table's next block (the caller grows it) copies the tail's: see pop_copy."""
        assert seq_id not in self._tables, seq_id
        if match.nodes:
            self.cache.acquire(match.nodes)
        table = self._tables[seq_id] = _Table([n.block_id for n in match.nodes], list(match.nodes))
        if match.tail is not None:
            self.cache.acquire([match.tail])  # not evicted before its copy is planned
            table.copy_source = match.tail
        return list(table.block_ids)

    def pop_copy(self, seq_id: int) -> tuple[int, int] | None:
        """(source, destination) of the block copy the sequence starts with, once, after the
        grow that gives it its first fresh block; None without a tail. The rank copies before
        the step's work, so the source may be evicted from here on."""
        table = self._tables[seq_id]
        source, table.copy_source = table.copy_source, None
        if source is None:
            return None
        assert len(table.block_ids) > len(table.path), "pop_copy before the sequence's block was grown"
        self.cache.release([source])
        return source.block_id, table.block_ids[len(table.path)]

    def share_tail(self, seq_id: int, token_ids: list[int], num_tokens: int) -> None:
        """Lets later sequences copy the running sequence's partly filled block among its first
        num_tokens tokens (computed, or in a step already sent), after publish(): a live node
        under its last full block, replacing the one of an earlier chunk."""
        table = self._tables[seq_id]
        tail = self._tail_of(table, token_ids, num_tokens)
        live = table.live_tail
        if tail is None or (live is not None and live.token_ids == tail[1] and live.block_id == tail[2]):
            return
        self._drop_live(table)
        table.live_tail = self.cache.insert_live(*tail)

    def keep_tail(self, seq_id: int, token_ids: list[int], num_tokens: int) -> None:
        """Caches the ending sequence's partly filled last block among its first num_tokens
        (computed) tokens as a tail, after publish() has cached the full blocks before it."""
        table = self._tables[seq_id]
        self._drop_live(table)
        tail = self._tail_of(table, token_ids, num_tokens)
        if tail is not None and self.cache.insert_tail(*tail):
            table.block_ids.remove(tail[2])  # the cache's now, not freed by release()

    def _tail_of(self, table: _Table, token_ids: list[int], num_tokens: int) -> tuple[Node, tuple, int] | None:
        """(parent, tokens, block id) of the table's partly filled block after its published full
        ones, among the first num_tokens; None if there is none to share."""
        bs = self.block_size
        num_full, num_rest = divmod(min(num_tokens, len(token_ids)), bs)
        if (self.cache is None or not num_rest or not table.is_publishing or len(table.path) != num_full
                or len(table.block_ids) <= num_full or table.copy_source is not None):
            return None
        parent = table.path[-1] if table.path else self.cache.root
        return parent, tuple(token_ids[num_full * bs:num_full * bs + num_rest]), table.block_ids[num_full]

    def _drop_live(self, table: _Table) -> None:
        if table.live_tail is not None:
            self.cache.remove_live(table.live_tail)
            table.live_tail = None

    def publish(self, seq_id: int, token_ids: list[int], hashes: list[int], num_tokens: int) -> None:
        """Caches the sequence's full blocks among its first num_tokens tokens.

        num_tokens must be computed (or in a step already sent: the rank runs
        steps in order, so a later step that reuses a block finds its KV).
        """
        table = self._tables[seq_id]
        num_full = min(num_tokens // self.block_size, len(table.block_ids))
        if num_full <= len(table.path) or self.cache is None or not table.is_publishing:
            return  # the common case (a decode inside a block): nothing new is full
        if len(hashes) < num_full:
            extend_block_hashes(hashes, token_ids, self.block_size, num_full)
        bs = self.block_size
        self._drop_live(table)  # its block is full now (cached, or a private copy of a cached one)
        parent = table.path[-1] if table.path else self.cache.root
        for i in range(len(table.path), num_full):
            node = self.cache.insert(parent, hashes[i], tuple(token_ids[i * bs:(i + 1) * bs]),
                                     table.block_ids[i])
            if node is None:  # a hash collision: this sequence stops sharing
                table.is_publishing = False
                return
            table.path.append(node)
            parent = node

    # Per-sequence block tables.

    def has_sequence(self, seq_id: int) -> bool:
        """True while the sequence holds a block table here."""
        return seq_id in self._tables

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's blocks, in order (a copy)."""
        return list(self._tables[seq_id].block_ids)

    def num_new_blocks(self, seq_id: int, num_tokens: int) -> int:
        """Blocks the sequence must add so that its table covers num_tokens tokens."""
        return max(0, self.blocks_needed(num_tokens) - len(self._tables[seq_id].block_ids))

    def capacity(self, seq_id: int, reserve: int = 0) -> int:
        """Tokens the sequence's table could cover using the available blocks but `reserve`."""
        num_usable = max(0, self.num_available - reserve)
        return (len(self._tables[seq_id].block_ids) + num_usable) * self.block_size

    def can_grow(self, seq_id: int, num_tokens: int) -> bool:
        """True if the available blocks suffice to cover num_tokens tokens of the sequence."""
        return self.num_new_blocks(seq_id, num_tokens) <= self.num_available

    def grow(self, seq_id: int, num_tokens: int) -> list[int]:
        """Extends the sequence's table to cover num_tokens (evicting cached blocks
        if needed); returns the new ids. The caller checks can_grow first."""
        num_new = self.num_new_blocks(seq_id, num_tokens)
        if not num_new:
            return []
        if num_new > self.allocator.num_free:
            self.allocator.free(self.cache.evict(num_new - self.allocator.num_free))
        new_ids = self.allocator.allocate(num_new)
        self._tables[seq_id].block_ids.extend(new_ids)
        return new_ids

    def release(self, seq_id: int) -> None:
        """Drops the sequence: its cached blocks lose a reference, the rest are freed."""
        table = self._tables.pop(seq_id)
        self._drop_live(table)
        if table.copy_source is not None:
            self.cache.release([table.copy_source])
        self.allocator.free(table.block_ids[len(table.path):])
        self.allocator.free([b for n, b in zip(table.path, table.block_ids) if n.block_id != b])
        if table.path:
            self.cache.release(table.path)

    def check_invariants(self) -> None:
        """Asserts that every block is in exactly one place (free, cached, or one table)."""
        cached = self.cache.num_blocks if self.cache else 0
        private = sum(len(t.block_ids) - sum(n.block_id == b for n, b in zip(t.path, t.block_ids))
                      for t in self._tables.values())
        assert self.num_free + cached + private == self.num_blocks, (self.num_free, cached, private)
