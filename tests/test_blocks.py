"""BlockAllocator bookkeeping, without torch: tables, ref counts, prefix reuse
by chained hash, least-recently-used eviction of cached free blocks."""

from __future__ import annotations

import subprocess
import sys

from workers.scheduler.blocks import BlockAllocator, Copy

SIZE = 4


def tokens(n: int, offset: int = 0) -> list[int]:
    return list(range(offset, offset + n))


def computed(allocator: BlockAllocator, request_id: str, token_ids: list[int]) -> None:
    allocator.cache_full_blocks(request_id, token_ids, len(token_ids))


def test_allocation_covers_every_token_and_free_returns_the_blocks():
    allocator = BlockAllocator(8, SIZE)
    assert allocator.allocate("a", tokens(9)) == 0
    assert len(allocator.block_table("a")) == 3
    assert allocator.num_free_blocks == 5
    allocator.free("a")
    assert allocator.num_free_blocks == 8


def test_can_allocate_refuses_what_does_not_fit():
    allocator = BlockAllocator(3, SIZE)
    assert allocator.can_allocate(tokens(12))
    assert not allocator.can_allocate(tokens(13))


def test_append_adds_a_block_only_when_the_last_is_full():
    allocator = BlockAllocator(4, SIZE)
    allocator.allocate("a", tokens(4))
    allocator.append("a", 4)
    assert len(allocator.block_table("a")) == 1
    assert allocator.may_append("a", 5)
    allocator.append("a", 5)
    assert len(allocator.block_table("a")) == 2


def test_may_append_is_false_when_no_block_is_free():
    allocator = BlockAllocator(2, SIZE)
    allocator.allocate("a", tokens(8))
    assert not allocator.may_append("a", 9)
    assert allocator.may_append("a", 8)


def test_a_shared_prefix_reuses_full_blocks_but_never_the_last_token():
    allocator = BlockAllocator(10, SIZE)
    prompt = tokens(10)
    allocator.allocate("a", prompt)
    computed(allocator, "a", prompt)
    assert allocator.allocate("b", prompt + [99, 98]) == 8
    assert allocator.block_table("b")[:2] == allocator.block_table("a")[:2]
    # all 8 tokens in full blocks, but the 8th must be computed for its logits:
    # the first block is shared, 3 of the second copied
    assert allocator.allocate("c", tokens(8)) == 7
    assert allocator.take_copies() == [Copy(allocator.block_table("a")[1],
                                            allocator.block_table("c")[1], 3)]


def test_part_of_a_cached_block_is_copied_into_the_requests_own():
    allocator = BlockAllocator(10, SIZE)
    prompt = tokens(10)
    allocator.allocate("a", prompt)
    computed(allocator, "a", prompt)
    assert allocator.take_copies() == []
    assert allocator.allocate("b", tokens(6) + [50, 51, 52]) == 6
    a, b = allocator.block_table("a"), allocator.block_table("b")
    assert b[0] == a[0] and b[1] not in a  # shared whole, then a block of its own
    assert allocator.take_copies() == [Copy(a[1], b[1], 2)]
    assert allocator.take_copies() == []  # each copy is handed over once
    # a first block can be reused in part too
    assert allocator.allocate("c", [0, 1, 70, 71]) == 2
    assert allocator.take_copies() == [Copy(a[0], allocator.block_table("c")[0], 2)]
    # a block's tokens count only after the same prefix: not after a block not cached
    assert allocator.allocate("d", [9, 9, 9, 9, 4, 5, 6]) == 0
    assert allocator.take_copies() == []


def test_an_evicted_block_is_no_longer_reused_in_part():
    allocator = BlockAllocator(3, SIZE)
    allocator.allocate("a", tokens(5))
    computed(allocator, "a", tokens(5))
    allocator.free("a")
    allocator.allocate("filler", tokens(12, 100))  # takes every block: evicts a's
    allocator.free("filler")
    assert allocator.allocate("b", tokens(3) + [9]) == 0
    assert allocator.take_copies() == []


def test_shared_blocks_are_ref_counted():
    allocator = BlockAllocator(6, SIZE)
    allocator.allocate("a", tokens(9))
    computed(allocator, "a", tokens(9))
    allocator.allocate("b", tokens(9))
    assert allocator.num_free_blocks == 6 - 3 - 1
    allocator.free("a")
    assert allocator.block_table("b")[0] not in allocator.blank
    allocator.free("b")
    assert allocator.num_free_blocks == 6


def test_the_hash_chain_distinguishes_equal_blocks_after_different_prefixes():
    allocator = BlockAllocator(10, SIZE)
    first = [1, 1, 1, 1, 7, 7, 7, 7, 0]
    allocator.allocate("a", first)
    computed(allocator, "a", first)
    assert allocator.allocate("b", [2, 2, 2, 2, 7, 7, 7, 7, 0]) == 0


def test_freed_prefix_blocks_stay_reusable_until_evicted_least_recently_used_first():
    allocator = BlockAllocator(4, SIZE)
    old, new = tokens(5, 100), tokens(5, 200)
    for request_id, prompt in (("old", old), ("new", new)):
        allocator.allocate(request_id, prompt)
        computed(allocator, request_id, prompt)
        allocator.free(request_id)
    assert allocator.num_free_blocks == 4
    allocator.allocate("filler", tokens(12))  # 2 blank + 1 evicted: the oldest cached block
    allocator.free("filler")
    assert allocator.allocate("again-new", new) == 4
    allocator.free("again-new")
    assert allocator.allocate("again-old", old) == 0


def test_the_allocator_and_batcher_import_no_torch():
    code = ("import sys, workers.scheduler.blocks, workers.scheduler.batcher; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
