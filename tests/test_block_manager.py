"""The KV block manager: allocation, growth, freeing, and its invariants."""

from __future__ import annotations

import pytest

from trioserve.core.block_manager import BlockManager, OutOfBlocksError


def test_new_manager_has_every_block_free() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert (bm.num_blocks, bm.block_size, bm.num_free_blocks) == (8, 4, 8)
    bm.check_invariants()


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0)])
def test_rejects_non_positive_sizes(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError, match="num_blocks" if num_blocks == 0 else "block_size"):
        BlockManager(num_blocks=num_blocks, block_size=block_size)


def test_blocks_needed_rounds_up_to_whole_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert [bm.blocks_needed("a", n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_blocks_needed_counts_only_blocks_not_yet_held() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", 5)
    assert bm.blocks_needed("a", 8) == 0
    assert bm.blocks_needed("a", 9) == 1
    assert bm.blocks_needed("a", 3) == 0


def test_allocate_returns_only_the_new_blocks_and_grows_the_table() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    first = bm.allocate("a", 5)
    assert len(first) == 2
    assert bm.allocate("a", 8) == []
    more = bm.allocate("a", 13)
    assert len(more) == 2
    assert bm.block_table("a") == first + more
    assert bm.num_free_blocks == 4
    bm.check_invariants()


def test_block_table_is_a_copy() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 2)
    bm.block_table("a").append(99)
    assert len(bm.block_table("a")) == 1


def test_requests_never_share_a_block() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.allocate("a", 5)
    bm.allocate("b", 6)
    assert not set(bm.block_table("a")) & set(bm.block_table("b"))
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_allocate_beyond_free_blocks_raises_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.allocate("a", 4)
    assert not bm.can_allocate("b", 3)
    with pytest.raises(OutOfBlocksError, match="'b'"):
        bm.allocate("b", 3)
    assert bm.num_free_blocks == 1
    assert bm.block_table("b") == []
    bm.check_invariants()


def test_can_allocate_exactly_the_free_blocks() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    assert bm.can_allocate("a", 6)
    assert not bm.can_allocate("a", 7)


def test_free_returns_all_blocks_and_is_idempotent() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 7)
    bm.free("a")
    bm.free("a")
    bm.free("never-seen")
    assert bm.num_free_blocks == 4
    assert bm.block_table("a") == []
    bm.check_invariants()


def test_freed_blocks_are_reused() -> None:
    bm = BlockManager(num_blocks=2, block_size=1)
    blocks = bm.allocate("a", 2)
    bm.free("a")
    assert sorted(bm.allocate("b", 2)) == sorted(blocks)


def test_allocate_zero_tokens_creates_no_table() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    assert bm.allocate("a", 0) == []
    assert bm.block_table("a") == []
    bm.check_invariants()


def test_allocate_rejects_negative_token_count() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    with pytest.raises(ValueError, match="num_tokens"):
        bm.allocate("a", -1)


def test_check_invariants_names_a_lost_block() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 3)
    bm._free.pop()  # simulate a leak
    with pytest.raises(RuntimeError, match="conserved"):
        bm.check_invariants()


def test_check_invariants_names_a_block_in_two_tables_without_its_count() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 2)
    bm.allocate("b", 2)
    bm._free.append(bm._tables["b"][0])
    bm._tables["b"][0] = bm._tables["a"][0]
    with pytest.raises(RuntimeError, match="reference count"):
        bm.check_invariants()


def test_check_invariants_names_an_oversized_table() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 2)
    bm._tables["a"].append(bm._free.popleft())
    with pytest.raises(RuntimeError, match="'a'"):
        bm.check_invariants()
