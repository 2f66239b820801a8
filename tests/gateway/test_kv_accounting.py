"""BlockAllocator and RankKV: free list, per-sequence tables, prefix sharing, eviction."""

import pytest

from gateway.kv_accounting import BlockAllocator, RankKV


def test_blocks_needed_rounds_up():
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    assert [allocator.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_and_free_return_every_block_once():
    allocator = BlockAllocator(num_blocks=4, block_size=16)
    first = allocator.allocate(3)
    assert len(set(first)) == 3 and allocator.num_free == 1
    rest = allocator.allocate(1)
    assert set(first + rest) == {0, 1, 2, 3} and allocator.num_free == 0
    allocator.free(first)
    assert allocator.num_free == 3
    again = allocator.allocate(3)
    assert sorted(again) == sorted(first)


def test_double_free_is_a_bug():
    allocator = BlockAllocator(num_blocks=4, block_size=16)
    ids = allocator.allocate(2)
    allocator.free(ids)
    with pytest.raises(AssertionError, match="double free"):
        allocator.free(ids[:1])
    with pytest.raises(AssertionError, match="double free"):
        allocator.free([3])  # never allocated


def test_overallocation_is_a_bug():
    allocator = BlockAllocator(num_blocks=2, block_size=16)
    with pytest.raises(AssertionError):
        allocator.allocate(3)


def open_seq(kv: RankKV, seq_id: int, token_ids: list[int], hashes=None) -> tuple[list[int], int]:
    """Starts a sequence on its cached prefix: (block ids, cached tokens)."""
    match = kv.match(token_ids, [] if hashes is None else hashes)
    return kv.open(seq_id, match), match.num_cached_tokens


def test_block_table_grows_with_the_sequence():
    kv = RankKV(num_blocks=8, block_size=4)
    open_seq(kv, 7, [1] * 5)
    assert kv.grow(7, 5) == kv.block_table(7) and len(kv.block_table(7)) == 2
    assert kv.num_new_blocks(7, 8) == 0 and kv.grow(7, 8) == []
    added = kv.grow(7, 9)
    assert len(added) == 1 and kv.block_table(7)[-1] == added[0]
    open_seq(kv, 8, [2] * 4)
    other = kv.grow(8, 4)
    assert not set(other) & set(kv.block_table(7))
    assert kv.num_free == 8 - 4
    kv.check_invariants()


def test_can_grow_counts_only_missing_blocks():
    kv = RankKV(num_blocks=3, block_size=4)
    open_seq(kv, 1, [1] * 8)
    kv.grow(1, 8)
    open_seq(kv, 2, [2] * 4)
    assert kv.can_grow(1, 12) and not kv.can_grow(1, 13)
    assert kv.can_grow(2, 4) and not kv.can_grow(2, 5)
    assert kv.capacity(1) == 12 and kv.capacity(1, reserve=1) == 8


def test_release_frees_the_private_blocks_and_keeps_the_published_ones_cached():
    kv = RankKV(num_blocks=4, block_size=4)
    tokens = list(range(10))
    open_seq(kv, 1, tokens)
    kv.grow(1, 10)
    kv.publish(1, tokens, [], 10)           # blocks 0 and 1 are full: cached
    kv.release(1)
    assert kv.num_free == 2 and kv.cache.num_blocks == 2 and kv.num_available == 4
    assert not kv.has_sequence(1)
    kv.check_invariants()
    with pytest.raises(KeyError):
        kv.release(1)


def test_a_later_sequence_reuses_the_cached_blocks_of_its_prefix():
    kv = RankKV(num_blocks=8, block_size=4)
    first = list(range(12)) + [99]
    open_seq(kv, 1, first)
    table = kv.grow(1, 13)
    kv.publish(1, first, [], 13)
    second = list(range(10)) + [50, 51, 52]
    block_ids, num_cached = open_seq(kv, 2, second)
    # Blocks 0 and 1 (tokens 0..7) are shared; block 2 differs at token 10, so its first two
    # tokens are copied into the second sequence's own block 2.
    assert num_cached == 10 and block_ids == table[:2]
    assert kv.grow(2, 13) and kv.block_table(2)[:2] == table[:2]
    assert kv.pop_copy(2) == (table[2], kv.block_table(2)[2]) and kv.pop_copy(2) is None
    assert kv.cache.root.children and kv.num_available == 8 - 4 - 2
    kv.release(1)
    kv.release(2)
    assert kv.num_available == 8
    kv.check_invariants()


def test_full_blocks_are_shared_and_a_whole_prompt_match_leaves_a_token_to_compute():
    kv = RankKV(num_blocks=8, block_size=4)
    tokens = list(range(8))
    open_seq(kv, 1, tokens)
    kv.grow(1, 8)
    kv.publish(1, tokens, [], 7)            # the 8th token's KV not computed yet: one full block
    assert kv.cache.num_blocks == 1
    kv.publish(1, tokens, [], 8)
    assert kv.cache.num_blocks == 2
    # 8 cached, but one token must be computed: block 0 shared, 3 tokens of block 1 copied.
    assert open_seq(kv, 2, tokens)[1] == 7 and kv.match(tokens, []).tail.block_id == kv.block_table(1)[1]
    assert open_seq(kv, 3, tokens + [8])[1] == 8


def test_without_the_prefix_cache_nothing_is_shared():
    kv = RankKV(num_blocks=8, block_size=4, enable_prefix_cache=False)
    tokens = list(range(9))
    open_seq(kv, 1, tokens)
    kv.grow(1, 9)
    kv.publish(1, tokens, [], 9)
    assert open_seq(kv, 2, tokens) == ([], 0)
    kv.release(1)
    assert kv.num_free == 8


def test_a_block_computed_twice_is_cached_once_and_the_copy_freed():
    kv = RankKV(num_blocks=8, block_size=4)
    tokens = list(range(9))
    for seq_id in (1, 2):                   # both start before either published
        open_seq(kv, seq_id, tokens)
        kv.grow(seq_id, 9)
    kv.publish(1, tokens, [], 9)
    kv.publish(2, tokens, [], 9)
    assert kv.cache.num_blocks == 2 and kv.num_free == 8 - 6
    kv.check_invariants()
    kv.release(2)                           # its two duplicate blocks and its tail go back
    assert kv.num_free == 8 - 3
    kv.release(1)
    assert kv.num_available == 8
    kv.check_invariants()


def test_growing_evicts_unreferenced_cached_blocks_least_recently_used_first():
    kv = RankKV(num_blocks=4, block_size=2)
    for seq_id, tokens in ((1, [1, 2, 3]), (2, [5, 6, 7])):
        open_seq(kv, seq_id, tokens)
        kv.grow(seq_id, 3)
        kv.publish(seq_id, tokens, [], 3)
        kv.release(seq_id)
    assert kv.num_free == 2 and kv.cache.num_blocks == 2
    open_seq(kv, 3, [9] * 6)
    kv.grow(3, 6)                           # needs 3: the free 2 and the older cached block
    assert kv.match([1, 2, 3], []).num_cached_tokens == 0
    assert kv.match([5, 6, 7], []).num_cached_tokens == 2
    assert not kv.can_grow(3, 9)
    kv.check_invariants()


@pytest.mark.parametrize("num_blocks,block_size", [(0, 16), (4, 0), (-1, 16)])
def test_bad_sizes_are_rejected(num_blocks, block_size):
    with pytest.raises(ValueError, match=str(min(num_blocks, block_size))):
        BlockAllocator(num_blocks, block_size)


def computed(kv: RankKV, seq_id: int, token_ids: list[int], num_computed: int | None = None) -> list[int]:
    """Starts a sequence on its cached prefix, grows it to its tokens and publishes the first num_computed
    (all by default) as computed; returns its block table."""
    open_seq(kv, seq_id, token_ids)
    kv.grow(seq_id, len(token_ids))
    kv.publish(seq_id, token_ids, [], len(token_ids) if num_computed is None else num_computed)
    return kv.block_table(seq_id)


def ended(kv: RankKV, seq_id: int, token_ids: list[int], num_computed: int | None = None) -> list[int]:
    """computed(), then ends the sequence as the batcher does (its partly filled block kept as a tail)."""
    table = computed(kv, seq_id, token_ids, num_computed)
    kv.keep_tail(seq_id, token_ids, len(token_ids) if num_computed is None else num_computed)
    kv.release(seq_id)
    return table


def test_an_ended_sequences_last_partly_filled_block_is_copied_by_the_next_with_that_prefix():
    kv = RankKV(num_blocks=8, block_size=4)
    tokens = list(range(10))                # blocks [0..3], [4..7], and [8, 9] partly filled
    table = ended(kv, 1, tokens)
    assert kv.cache.num_blocks == 3 and kv.num_free == 5
    kv.check_invariants()
    # Two later sequences: each shares the full blocks and copies the tail into a block of its own.
    for seq_id, prompt, num_shared in ((2, tokens + [50, 51], 10), (3, tokens[:9] + [60, 61], 9)):
        block_ids, num_cached = open_seq(kv, seq_id, prompt)
        assert num_cached == num_shared and block_ids == table[:2]
        kv.grow(seq_id, len(prompt))
        assert kv.pop_copy(seq_id) == (table[2], kv.block_table(seq_id)[2])
    assert kv.num_free == 3 and kv.num_available == 3 + 1   # the tail is unreferenced again: evictable
    kv.check_invariants()
    for seq_id in (2, 3):
        kv.release(seq_id)
    kv.check_invariants()
    assert kv.num_available == 8


def test_a_matched_tail_is_held_until_its_copy_is_planned():
    kv = RankKV(num_blocks=3, block_size=2)
    ended(kv, 1, [1, 2, 3])                 # cached: [1, 2] and the tail [3]; one block free
    match = kv.match([1, 2, 3, 4, 5, 6], [])
    assert match.num_cached_tokens == 3 and match.num_unreferenced == 2
    kv.open(2, match)
    assert kv.num_available == 1            # both nodes held: only the free block
    kv.grow(2, 4)
    assert kv.pop_copy(2)[0] == match.tail.block_id and kv.num_available == 1   # now the tail may go
    kv.check_invariants()
    kv.release(2)
    open_seq(kv, 3, [1, 2, 3, 9])           # a sequence released before its copy was planned
    kv.release(3)
    kv.check_invariants()
    assert kv.num_available == 3


def test_no_tail_is_kept_without_computed_tokens_past_the_full_blocks():
    kv = RankKV(num_blocks=8, block_size=4)
    tokens = list(range(8))
    ended(kv, 1, tokens)                    # two full blocks, nothing partly filled
    assert kv.cache.num_blocks == 2 and kv.num_free == 6
    ended(kv, 2, tokens + [8, 9], 9)        # the 10th token not computed: the tail holds [8]
    assert kv.match(tokens + [8, 7], []).num_cached_tokens == 9
    kv.check_invariants()


def test_a_running_sequences_partly_filled_block_is_copied_until_it_fills_or_ends():
    kv = RankKV(num_blocks=12, block_size=4)
    prompt = list(range(10))
    computed(kv, 1, prompt)
    kv.share_tail(1, prompt, 10)              # blocks [0..3], [4..7] cached; [8, 9] live
    kv.check_invariants()
    assert kv.cache.num_blocks == 2 and kv.num_free == 12 - 3
    block_ids, num_cached = open_seq(kv, 2, prompt + [70])
    kv.grow(2, 11)
    assert num_cached == 10 and kv.pop_copy(2) == (kv.block_table(1)[2], kv.block_table(2)[2])
    kv.check_invariants()
    # Sequence 1 decodes: its third block fills, is cached, and stops being live.
    tokens = prompt + [20, 21]
    kv.publish(1, tokens, [], 12)
    assert kv.cache.num_blocks == 3 and kv.match(prompt + [20, 30], []).tail.block_id == kv.block_table(1)[2]
    kv.grow(1, 13)
    kv.share_tail(1, tokens + [22], 13)
    assert kv.match(tokens + [22, 5], []).num_cached_tokens == 13
    kv.release(1)                              # the live node goes with it: nothing to copy from
    assert kv.match(tokens + [22, 5], []).num_cached_tokens == 12
    kv.release(2)
    kv.check_invariants()
    assert kv.num_available == 12
