"""The radix tree of KV blocks: lookup, references, LRU eviction, hash collisions, tails and live nodes."""

import random

import pytest

from gateway.prefix_cache import PrefixCache, extend_block_hashes


def hashes_of(token_ids, block_size=2):
    hashes = []
    extend_block_hashes(hashes, token_ids, block_size, len(token_ids) // block_size)
    return hashes


def insert_path(cache: PrefixCache, token_ids, block_ids):
    """Inserts the blocks of token_ids (referenced once each), returns the nodes."""
    bs = cache.block_size
    hashes = hashes_of(token_ids, bs)
    nodes, parent = [], cache.root
    for i, block_id in enumerate(block_ids):
        parent = cache.insert(parent, hashes[i], tuple(token_ids[i * bs:(i + 1) * bs]), block_id)
        nodes.append(parent)
    return nodes


def test_block_hashes_chain_over_the_whole_prefix():
    assert hashes_of([1, 2, 3, 4])[1] != hashes_of([9, 9, 3, 4])[1]   # same block, other prefix
    assert hashes_of([1, 2, 3, 4]) == hashes_of([1, 2, 3, 4, 5])
    partial = hashes_of([1, 2])
    extend_block_hashes(partial, [1, 2, 3, 4], 2, 2)
    assert partial == hashes_of([1, 2, 3, 4])


def test_match_finds_the_longest_cached_prefix_of_full_blocks():
    cache = PrefixCache(2)
    insert_path(cache, [1, 2, 3, 4, 5, 6], [10, 11, 12])
    tokens = [1, 2, 3, 4, 7, 8, 9]
    assert [n.block_id for n in cache.match(tokens, hashes_of(tokens), 9)] == [10, 11]
    assert [n.block_id for n in cache.match(tokens, hashes_of(tokens), 1)] == [10]
    assert cache.match([2, 1, 3, 4], hashes_of([2, 1, 3, 4]), 9) == []
    assert cache.num_blocks == 3 and cache.num_unreferenced == 0


def test_referenced_blocks_are_never_evicted():
    cache = PrefixCache(2)
    nodes = insert_path(cache, [1, 2, 3, 4], [10, 11])
    assert cache.evict(5) == []
    cache.release(nodes)
    assert cache.num_unreferenced == 2
    cache.acquire(nodes[:1])
    assert cache.evict(5) == [11]          # the leaf only; its parent is held
    cache.release(nodes[:1])
    assert cache.evict(5) == [10] and cache.num_blocks == 0


def test_eviction_takes_the_least_recently_used_leaf_and_then_its_parent():
    cache = PrefixCache(2)
    a = insert_path(cache, [1, 2, 3, 4], [10, 11])
    b = insert_path(cache, [1, 2, 5, 6], [10, 12])       # shares block 10 with a
    assert b[0] is a[0] and a[0].ref_count == 2
    cache.release(a)
    cache.release(b)
    assert cache.evict(1) == [11]          # a's leaf was released first
    assert cache.evict(1) == [12]
    assert cache.evict(1) == [10]          # now a leaf itself


def test_a_used_block_moves_to_the_back_of_the_eviction_order():
    cache = PrefixCache(2)
    a = insert_path(cache, [1, 2], [10])
    b = insert_path(cache, [3, 4], [11])
    cache.release(a)
    cache.release(b)
    cache.acquire(a)                       # a is used again, after b
    cache.release(a)
    assert cache.evict(1) == [11]


def test_an_existing_block_is_returned_and_a_hash_collision_is_not_cached():
    cache = PrefixCache(2)
    (node,) = insert_path(cache, [1, 2], [10])
    again = cache.insert(cache.root, node.key, (1, 2), 99)
    assert again is node and node.block_id == 10 and node.ref_count == 2
    assert cache.insert(cache.root, node.key, (7, 7), 98) is None
    assert cache.match([7, 7, 0], [node.key], 1) == []     # same hash, other tokens: a miss


def test_bad_block_size_is_rejected():
    with pytest.raises(ValueError, match="0"):
        PrefixCache(0)


def test_match_tail_finds_the_child_that_begins_with_the_most_of_the_next_tokens():
    cache = PrefixCache(4)
    (first,) = insert_path(cache, [1, 2, 3, 4], [10])
    insert_path(cache, [1, 2, 7, 8], [11])
    assert cache.match_tail(cache.root, [1, 2, 3, 9], 9) == (first, 3)
    assert cache.match_tail(cache.root, [1, 2, 3, 4, 5], 9) == (first, 3)   # never a whole block
    assert cache.match_tail(cache.root, [1, 2, 3, 9], 2)[1] == 2            # at most max_tokens
    assert cache.match_tail(cache.root, [2, 2], 9) == (None, 0)
    assert cache.match_tail(first, [5], 9) == (None, 0)
    assert cache.match_tail(cache.root, [1, 2], 0) == (None, 0)


def test_a_tail_is_an_evictable_leaf_and_not_cached_twice():
    cache = PrefixCache(4)
    (parent,) = insert_path(cache, [1, 2, 3, 4], [10])
    tail = cache.insert_tail(parent, (5, 6), 11)
    assert tail is not None and not tail.ref_count and (cache.num_blocks, cache.num_unreferenced) == (2, 1)
    assert cache.match_tail(parent, [5, 6, 7], 9) == (tail, 2)
    assert cache.match_tail(parent, [5, 9], 9) == (tail, 1)
    assert cache.insert_tail(parent, (5,), 12) is None                     # a child begins with it already
    assert cache.insert_tail(parent, (5, 6), 12) is None
    longer = cache.insert_tail(parent, (5, 6, 7), 12)
    assert cache.match_tail(parent, [5, 6, 7, 8], 9) == (longer, 3)
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8], hashes_of([1, 2, 3, 4, 5, 6, 7, 8], 4), 9) == [parent]
    assert cache.evict(1) == [11]                                          # the older tail first
    assert cache.match_tail(parent, [5, 6], 9) == (longer, 2)
    cache.release([parent])
    assert cache.evict(5) == [12, 10] and cache.num_blocks == 0
    assert cache.match_tail(cache.root, [1], 9) == (None, 0) and not cache.root.by_tokens


def test_match_tail_finds_the_best_child_among_many_that_share_a_first_token():
    cache = PrefixCache(8)
    for i in range(200):                   # e.g. short chat prompts: every one starts with the same token
        cache.insert_tail(cache.root, (1, 2 + i % 7, 3 + i, 4), 1000 + i)
    assert cache.num_blocks == 200
    node, k = cache.match_tail(cache.root, [1, 2 + 150 % 7, 3 + 150, 9], 9)
    assert (node.block_id, k) == (1150, 3)
    node, k = cache.match_tail(cache.root, [1, 2 + 3 % 7, 0], 9)
    assert k == 2 and node.token_ids[:2] == (1, 2 + 3 % 7)
    assert cache.evict(200) and not cache.root.by_tokens


def test_a_live_node_is_found_like_a_tail_but_stays_its_sequences():
    cache = PrefixCache(4)
    (parent,) = insert_path(cache, [1, 2, 3, 4], [10])
    live = cache.insert_live(parent, (5, 6), 11)
    assert live.is_live and live.ref_count == 1 and (cache.num_blocks, cache.num_unreferenced) == (1, 0)
    assert cache.match_tail(parent, [5, 6, 7], 9) == (live, 2)
    tail = cache.insert_tail(parent, (5, 6), 12)      # a live node does not stand in for a cached tail
    assert tail is not None and cache.num_blocks == 2
    cache.release([parent])
    assert cache.evict(9) == [12]                      # the tail only: the live node holds its parent
    cache.remove_live(live)
    assert cache.match_tail(parent, [5, 6], 9) == (None, 0) and cache.evict(9) == [10]
    assert cache.num_blocks == 0


@pytest.mark.parametrize("seed", range(20))
def test_match_tail_agrees_with_a_search_of_every_child_as_children_come_and_go(seed):
    """Random full blocks, tails and live nodes under one parent over 3 token values (so that many
    share prefixes), some removed or evicted between lookups: the sorted children stay those of
    the tree, and match_tail's answer has the longest common prefix of any child."""
    rng = random.Random(seed)
    cache = PrefixCache(6)
    (parent,) = insert_path(cache, [9] * 6, [0])
    lives, next_block = [], 1

    def tokens(n):
        return tuple(rng.randrange(3) for _ in range(n))

    for _ in range(60):
        kind = rng.random()
        if kind < 0.3:
            full = tokens(6)
            node = cache.insert(parent, hash(full), full, next_block)
            if node is not None:
                cache.release([node])
        elif kind < 0.6:
            cache.insert_tail(parent, tokens(rng.randrange(1, 6)), next_block)
        elif kind < 0.75:
            node = cache.insert_live(parent, tokens(rng.randrange(1, 6)), next_block)
            lives += [node] if node is not None else []
        elif kind < 0.85 and lives:
            cache.remove_live(lives.pop(rng.randrange(len(lives))))
        else:
            cache.evict(rng.randrange(1, 4))
        next_block += 1
        children = list(parent.children.values())
        assert sorted(id(c) for c in parent.by_tokens) == sorted(id(c) for c in children)
        assert [c.token_ids for c in parent.by_tokens] == sorted(c.token_ids for c in children)
        for _ in range(5):
            query, cap = list(tokens(rng.randrange(1, 8))), rng.randrange(1, 9)
            node, k = cache.match_tail(parent, query, cap)
            limit = min(cap, len(query), 5)

            def common(child):
                n = 0
                while n < min(limit, len(child.token_ids)) and child.token_ids[n] == query[n]:
                    n += 1
                return n

            best = max((common(c) for c in children), default=0)
            assert k == best, (query, cap, k, best)
            assert (node is None) == (best == 0) and (node is None or common(node) == k)
