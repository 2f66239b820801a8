"""The prefix cache of one rank: a radix tree over token ids whose nodes are KV blocks.

A path from the root spells a cached prefix, one node per full block: the
node's edge label is the block's `block_size` token ids and its value is the
id of the KV block holding their keys and values. A block's KV depends on
every token before it, so a node is valid only under its own parent; that is
why the tree is keyed by paths and not by single blocks. Full blocks are
shared in place. A block is only ever shared whole: the rank appends to a
sequence's last block in place, so a prefix that ends inside a block is
reused by copying (kv_accounting.RankKV): `match_tail` finds the child whose
tokens begin with the most of a sequence's next ones, full or a *tail*: the
partly filled last block a finished sequence left (`insert_tail`), a leaf
with fewer than block_size tokens that never gets children. A running
sequence's partly filled block may be a child too, a *live* one
(`insert_live`): found like a tail, but its block stays the sequence's (not
counted in num_blocks, never evicted) until `remove_live` takes it out.

Children are found by a chained hash of the block's tokens and its parent's
hash (`extend_block_hashes`, computed once per sequence); a hit also compares
the tokens themselves, so a hash collision is a miss, never a wrong block.

Reference counts: a running sequence holds one reference on every node of the
path it uses, so a referenced node's ancestors are referenced too. Nodes without
references stay cached until `evict` frees them, least recently used leaf
first; a parent whose last child goes becomes a leaf in turn.

No gRPC and no block allocation here: kv_accounting.RankKV owns the free
list and the per-sequence block tables, and drives this tree.
"""

import bisect
import heapq
import itertools
from collections.abc import Sequence

ROOT_HASH = 0x6D6F656D657368  # any constant: the chain's starting value (the root's key)


def extend_block_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int, num_blocks: int) -> None:
    """Appends the chained hashes of blocks len(hashes)..num_blocks-1 of token_ids (in place)."""
    assert num_blocks * block_size <= len(token_ids), (num_blocks, block_size, len(token_ids))
    parent = hashes[-1] if hashes else ROOT_HASH
    for i in range(len(hashes), num_blocks):
        parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        hashes.append(parent)


class Node:
    """One block of a cached prefix: full, or a tail (fewer than block_size tokens, a leaf)."""

    __slots__ = ("parent", "children", "by_tokens", "key", "token_ids", "block_id", "ref_count", "last_used",
                 "is_live")

    def __init__(self, parent: "Node | None", key: int, token_ids: tuple[int, ...], block_id: int) -> None:
        self.parent = parent
        self.children: dict[int, Node] = {}
        # The children (full and tails) sorted by their token ids, for match_tail: the child that
        # begins with the most of some tokens is next to them in this order.
        self.by_tokens: list[Node] = []
        self.key = key
        self.token_ids = token_ids
        self.block_id = block_id
        self.ref_count = 0
        self.last_used = 0
        # A running sequence's block, not the cache's (insert_live).
        self.is_live = False


class PrefixCache:
    """Cached prefixes of one rank's KV pool: match, reference, insert, evict."""

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.root = Node(None, ROOT_HASH, (), -1)
        self.root.ref_count = 1  # never evicted
        self.num_blocks = 0  # nodes in the tree, the root excluded
        self.num_unreferenced = 0  # of those, the ones no sequence uses: evictable
        self._clock = itertools.count(1)
        # Candidate leaves for eviction: (last_used, tie-break, node); stale entries are skipped.
        self._lru: list[tuple[int, int, Node]] = []
        self._tie = itertools.count()

    def match(self, token_ids: Sequence[int], hashes: Sequence[int], max_blocks: int, *,
              is_verified: bool = True) -> list[Node]:
        """The nodes of the longest cached prefix of token_ids, at most max_blocks.

        A lookup only: no reference is taken and no LRU time changes. With
        is_verified false the tokens are not compared (twice as fast): only
        for estimates, where a hash collision would do no harm.
        """
        bs = self.block_size
        nodes: list[Node] = []
        node = self.root
        for i in range(min(max_blocks, len(hashes))):
            child = node.children.get(hashes[i])
            if child is None or (is_verified and child.token_ids != tuple(token_ids[i * bs:(i + 1) * bs])):
                break
            nodes.append(child)
            node = child
        return nodes

    def acquire(self, nodes: Sequence[Node]) -> None:
        """Takes one reference on each node (a path from the root, in order)."""
        now = next(self._clock)
        for node in nodes:
            if node.ref_count == 0:
                self.num_unreferenced -= 1
            node.ref_count += 1
            node.last_used = now

    def release(self, nodes: Sequence[Node]) -> None:
        """Drops one reference from each node; unreferenced ones become evictable."""
        now = next(self._clock)
        for node in reversed(nodes):
            assert node.ref_count > 0, "released a node more often than acquired"
            node.ref_count -= 1
            node.last_used = now
            if node.ref_count == 0:
                self.num_unreferenced += 1
                if not node.children:
                    self._push_lru(node)

    def insert(self, parent: Node, key: int, token_ids: tuple[int, ...], block_id: int) -> Node | None:
        """The child of parent for this block, referenced once more by the caller.

        If the block is already cached (another sequence computed the same
        tokens), the existing node is returned and block_id stays the
        caller's; otherwise a new node takes block_id over. None if the key
        belongs to other tokens (a hash collision): the block stays uncached.
        """
        assert len(token_ids) == self.block_size, len(token_ids)
        assert parent is self.root or parent.ref_count > 0, "insert under an unreferenced node"
        child = parent.children.get(key)
        if child is not None and child.token_ids != token_ids:
            return None
        if child is None:
            child = self._add_child(parent, key, token_ids, block_id)
            self.num_unreferenced += 1  # acquire() takes it back
        self.acquire([child])
        return child

    def match_tail(self, parent: Node, token_ids: Sequence[int], max_tokens: int) -> tuple[Node | None, int]:
        """(child, k): the child of parent whose tokens begin with the most of token_ids, k of
        them (1 <= k <= max_tokens, below block_size), or (None, 0). Reading k tokens' KV from
        the child's block needs a copy: the caller's sequence writes on after them. In the
        children's sorted order the longest common prefix is with a neighbour of token_ids,
        so two comparisons find it, however many children there are."""
        max_tokens = min(max_tokens, len(token_ids), self.block_size - 1)
        if max_tokens <= 0:
            return None, 0
        query = tuple(token_ids[:max_tokens])
        children = parent.by_tokens
        i = bisect.bisect_left(children, query, key=_tokens)
        best, best_len = None, 0
        for child in children[max(0, i - 1):i + 1]:
            n = 0
            for a, b in zip(child.token_ids, query):
                if a != b:
                    break
                n += 1
            if n > best_len:
                best, best_len = child, n
        return best, best_len

    def insert_tail(self, parent: Node, token_ids: tuple[int, ...], block_id: int) -> Node | None:
        """Caches block_id as a tail: a finished sequence's partly filled last block under its last
        full one (parent, referenced by the caller), whose KV holds token_ids (fewer than
        block_size). None if a child of parent already begins with those tokens: then the
        block stays the caller's. The new tail is unreferenced (evictable at once)."""
        assert 0 < len(token_ids) < self.block_size, len(token_ids)
        assert parent is self.root or parent.ref_count > 0, "insert under an unreferenced node"
        covering, num_shared = self.match_tail(parent, token_ids, len(token_ids))
        if num_shared == len(token_ids) and not covering.is_live:
            return None
        key = hash((parent.key, "tail", token_ids))
        if key in parent.children:
            return None  # a hash collision with another child: not cached
        node = self._add_child(parent, key, token_ids, block_id)
        node.last_used = next(self._clock)
        self.num_unreferenced += 1
        self._push_lru(node)
        return node

    def insert_live(self, parent: Node, token_ids: tuple[int, ...], block_id: int) -> Node | None:
        """A running sequence's partly filled block (KV of token_ids, fewer than block_size) as a
        child of its last full one (parent), for later sequences to copy from: match_tail finds
        it like a tail, but the block stays the sequence's: not counted in num_blocks, and held
        by the one reference it starts with, so never evicted. The sequence takes it out with
        remove_live before its block goes anywhere. None on a key collision (not shared)."""
        assert 0 < len(token_ids) < self.block_size, len(token_ids)
        assert parent is self.root or parent.ref_count > 0, "insert under an unreferenced node"
        key = hash((parent.key, "live", block_id))
        if key in parent.children:
            return None
        node = self._attach(parent, key, token_ids, block_id)
        node.is_live, node.ref_count = True, 1
        return node

    def remove_live(self, node: Node) -> None:
        """Takes a live node out of the tree (its sequence's block moves on or goes)."""
        assert node.is_live and node.ref_count == 1, (node.is_live, node.ref_count)
        parent = self._detach(node)
        if parent is not self.root and parent.ref_count == 0 and not parent.children:
            self._push_lru(parent)

    def _detach(self, node: Node) -> Node:
        """Takes node out of its parent's children; returns the parent."""
        parent = node.parent
        del parent.children[node.key]
        siblings = parent.by_tokens
        i = bisect.bisect_left(siblings, node.token_ids, key=_tokens)
        while siblings[i] is not node:  # equal tokens (a live node beside a tail) sit side by side
            i += 1
        del siblings[i]
        node.parent = None
        return parent

    def _add_child(self, parent: Node, key: int, token_ids: tuple[int, ...], block_id: int) -> Node:
        """A new cached block under parent (counted in num_blocks)."""
        self.num_blocks += 1
        return self._attach(parent, key, token_ids, block_id)

    @staticmethod
    def _attach(parent: Node, key: int, token_ids: tuple[int, ...], block_id: int) -> Node:
        """A new node under parent, in its children and their sorted order (_detach's reverse)."""
        child = Node(parent, key, token_ids, block_id)
        parent.children[key] = child
        bisect.insort(parent.by_tokens, child, key=_tokens)
        return child

    def evict(self, num_blocks: int) -> list[int]:
        """Frees up to num_blocks unreferenced blocks, least recently used first; returns their ids."""
        freed: list[int] = []
        while len(freed) < num_blocks and self._lru:
            last_used, _, node = heapq.heappop(self._lru)
            if node.ref_count or node.children or node.last_used != last_used or node.parent is None:
                continue  # stale: used, grown or evicted since it was pushed
            parent = self._detach(node)
            self.num_blocks -= 1
            self.num_unreferenced -= 1
            freed.append(node.block_id)
            if parent is not self.root and parent.ref_count == 0 and not parent.children:
                self._push_lru(parent)
        return freed

    def _push_lru(self, node: Node) -> None:
        heapq.heappush(self._lru, (node.last_used, next(self._tie), node))


def _tokens(node: Node) -> tuple[int, ...]:
    return node.token_ids
