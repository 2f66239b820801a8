"""BlockAllocator: block ids of one rank's KV pool and the per-sequence tables."""

import pytest

from gateway.kv_accounting import BlockAllocator


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


def test_block_table_grows_with_the_sequence():
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    assert allocator.grow(7, 5) == allocator.block_table(7) and len(allocator.block_table(7)) == 2
    assert allocator.num_new_blocks(7, 8) == 0 and allocator.grow(7, 8) == []
    added = allocator.grow(7, 9)
    assert len(added) == 1 and allocator.block_table(7)[-1] == added[0]
    other = allocator.grow(8, 4)
    assert not set(other) & set(allocator.block_table(7))
    assert allocator.num_free == 8 - 4


def test_can_grow_counts_only_missing_blocks():
    allocator = BlockAllocator(num_blocks=3, block_size=4)
    allocator.grow(1, 8)
    assert allocator.can_grow(1, 12) and not allocator.can_grow(1, 13)
    assert allocator.can_grow(2, 4) and not allocator.can_grow(2, 5)


def test_release_frees_the_whole_table():
    allocator = BlockAllocator(num_blocks=4, block_size=4)
    allocator.grow(1, 10)
    assert allocator.release(1) == 3
    assert allocator.num_free == 4 and not allocator.has_sequence(1)
    with pytest.raises(KeyError):
        allocator.release(1)


@pytest.mark.parametrize("num_blocks,block_size", [(0, 16), (4, 0), (-1, 16)])
def test_bad_sizes_are_rejected(num_blocks, block_size):
    with pytest.raises(ValueError, match=str(min(num_blocks, block_size))):
        BlockAllocator(num_blocks, block_size)
