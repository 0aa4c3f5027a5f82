"""The KV block manager: allocation, growth, freeing, prefix caching, and its invariants."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from trioserve.core.block_hash import ROOT_HASH, BlockHash, extend_block_hashes, hash_block
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


# --- prefix caching ------------------------------------------------------------


def cached_manager(num_blocks: int = 8, block_size: int = 2) -> BlockManager:
    return BlockManager(num_blocks=num_blocks, block_size=block_size, enable_caching=True)


def hashes_of(tokens: list[int], block_size: int = 2) -> list[BlockHash]:
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, tokens, block_size, len(tokens) // block_size)
    return hashes


def run_and_register(bm: BlockManager, req_id: str, tokens: list[int]) -> list[int]:
    """Allocate ``req_id`` from its longest cached prefix, then register its full blocks."""
    hashes = hashes_of(tokens, bm.block_size)
    hit = bm.find_cached(hashes, tokens, (len(tokens) - 1) // bm.block_size)
    bm.allocate(req_id, len(tokens), hit)
    bm.register_full_blocks(req_id, hashes, tokens, len(tokens) // bm.block_size)
    return hit


def test_hash_chains_the_whole_prefix() -> None:
    assert hashes_of([1, 2, 3, 4])[1] != hashes_of([9, 9, 3, 4])[1]  # same block, other prefix
    assert hashes_of([1, 2, 3, 4]) == hashes_of([1, 2, 3, 4, 5])
    assert len(hashes_of([1, 2, 3, 4, 5])) == 2  # only full blocks
    assert hash_block(ROOT_HASH, [1, 2]) != hash_block(ROOT_HASH, [1, 2], extra_key=b"adapter")
    assert hash_block(ROOT_HASH, [1, 256]) != hash_block(ROOT_HASH, [256, 1])


def test_a_second_request_shares_the_first_ones_full_blocks() -> None:
    bm = cached_manager()
    assert run_and_register(bm, "a", [1, 2, 3, 4, 5]) == []
    hit = run_and_register(bm, "b", [1, 2, 3, 4, 9, 9])
    assert hit == bm.block_table("a")[:2]
    assert bm.block_table("b")[:2] == hit and bm.block_table("b")[2] not in bm.block_table("a")
    assert [bm.ref_count(b) for b in hit] == [2, 2]
    assert bm.num_used_blocks == 4  # 3 of a's, 1 of b's own
    bm.check_invariants()


def test_a_hit_never_covers_every_token() -> None:
    bm = cached_manager()
    run_and_register(bm, "a", [1, 2, 3, 4])
    assert run_and_register(bm, "b", [1, 2, 3, 4]) == bm.block_table("a")[:1]


def test_a_hit_is_confirmed_by_tokens_not_by_the_hash_alone() -> None:
    bm = cached_manager()
    run_and_register(bm, "a", [1, 2, 3, 4, 5])
    forged = hashes_of([1, 2, 3, 4])  # a's hashes, but other tokens: as if SHA-256 collided
    assert bm.find_cached(forged, [7, 7, 3, 4, 5], 2) == []
    assert bm.find_cached(forged, [1, 2, 7, 7, 5], 2) == bm.block_table("a")[:1]
    assert bm.find_cached(hashes_of([1, 2, 3, 4]), [1, 2, 3, 4, 5], 2) == bm.block_table("a")[:2]


def test_freed_cached_blocks_stay_cached_until_a_new_block_is_needed() -> None:
    bm = cached_manager(num_blocks=4)
    run_and_register(bm, "a", [1, 2, 3, 4, 5])
    a_blocks = bm.block_table("a")
    bm.free("a")
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    assert run_and_register(bm, "b", [1, 2, 3, 4, 6]) == a_blocks[:2]
    bm.free("b")
    bm.allocate("c", 2)  # an empty block is left: nothing is evicted
    assert bm.num_cached_blocks == 2
    bm.check_invariants()


def test_eviction_takes_the_least_recently_freed_and_a_requests_tail_first() -> None:
    bm = cached_manager(num_blocks=4)
    run_and_register(bm, "a", [1, 2, 3, 4])  # two full blocks
    run_and_register(bm, "b", [5, 6, 7, 8])
    a_blocks, b_blocks = bm.block_table("a"), bm.block_table("b")
    bm.free("a")
    bm.free("b")
    # Freed in this order: a's tail, a's head, b's tail, b's head.
    assert bm.allocate("c", 2) == [a_blocks[1]]
    assert bm.find_cached(hashes_of([1, 2, 3, 4]), [1, 2, 3, 4, 0], 2) == a_blocks[:1]
    assert bm.allocate("c", 6) == [a_blocks[0], b_blocks[1]]
    assert bm.num_cached_blocks == 1
    bm.check_invariants()


def test_a_hit_on_an_evictable_block_counts_as_taking_a_free_block() -> None:
    bm = cached_manager(num_blocks=3)
    run_and_register(bm, "a", [1, 2, 3, 4])
    bm.free("a")
    hit = bm.find_cached(hashes_of([1, 2, 3, 4]), [1, 2, 3, 4, 5, 6], 2)
    assert len(hit) == 2
    assert bm.blocks_to_take("b", 6, hit) == 3 and bm.can_allocate("b", 6, hit)
    assert not bm.can_allocate("b", 8, hit)
    with pytest.raises(OutOfBlocksError):
        bm.allocate("b", 8, hit)
    assert bm.allocate("b", 6, hit) != []
    bm.check_invariants()


def test_a_block_whose_hash_is_taken_stays_private() -> None:
    bm = cached_manager()
    bm.allocate("a", 4)
    bm.allocate("b", 4)  # the same tokens, computed side by side
    hashes = hashes_of([1, 2, 3, 4])
    bm.register_full_blocks("a", hashes, [1, 2, 3, 4], 2)
    bm.register_full_blocks("b", hashes, [1, 2, 3, 4], 2)
    assert bm.num_cached_blocks == 2
    bm.free("b")
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 6
    bm.check_invariants()


def test_reset_forgets_every_cached_block_and_keeps_tables() -> None:
    bm = cached_manager()
    run_and_register(bm, "a", [1, 2, 3, 4, 5])
    run_and_register(bm, "b", [9, 9, 9])
    bm.free("b")
    assert bm.reset_prefix_cache() == 3
    assert bm.num_cached_blocks == 0 and len(bm.block_table("a")) == 3
    assert run_and_register(bm, "c", [1, 2, 3, 4, 5]) == []
    bm.free("a")
    bm.check_invariants()


def test_caching_off_finds_and_registers_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    assert run_and_register(bm, "a", [1, 2, 3, 4]) == []
    assert run_and_register(bm, "b", [1, 2, 3, 4]) == []
    assert bm.num_cached_blocks == 0


class BlockManagerMachine(RuleBasedStateMachine):
    """The block manager against a model of it: which blocks are empty, which
    cached and free (in the order they were freed), which held and how often.
    Token lists come from a two-letter alphabet so that prefixes repeat."""

    @initialize(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 2, 3]))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.bm = cached_manager(num_blocks, block_size)
        self.tokens: dict[str, list[int]] = {}  # request -> its tokens (the table holds them all)
        self.evictable: list[int] = []  # the model's LRU order: least recently freed first
        self.cached: dict[int, tuple[int, ...]] = {}  # block -> the whole prefix it ends
        self.next_id = 0

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=12))
    def admit(self, tokens: list[int]) -> None:
        bm, req_id = self.bm, f"r{self.next_id}"
        self.next_id += 1
        hashes = hashes_of(tokens, bm.block_size)
        hit = bm.find_cached(hashes, tokens, (len(tokens) - 1) // bm.block_size)
        assert hit == self._model_hit(tokens), "not the longest cached prefix"
        num_empty = bm.num_free_blocks - len(self.evictable)
        fits = bm.blocks_to_take(req_id, len(tokens), hit) <= bm.num_free_blocks
        assert bm.can_allocate(req_id, len(tokens), hit) == fits
        if not fits:
            return
        for block in hit:
            if block in self.evictable:
                self.evictable.remove(block)
        new = bm.allocate(req_id, len(tokens), hit)
        num_evicted = max(0, len(new) - num_empty)
        evicted, self.evictable = self.evictable[:num_evicted], self.evictable[num_evicted:]
        assert new[len(new) - num_evicted :] == evicted, "eviction is not least recently freed first"
        for block in evicted:
            del self.cached[block]
        self.tokens[req_id] = tokens
        bm.register_full_blocks(req_id, hashes, tokens, len(tokens) // bm.block_size)
        self._model_register(req_id)

    @rule(pick=st.integers(0, 100))
    def free(self, pick: int) -> None:
        if not self.tokens:
            return
        req_id = sorted(self.tokens)[pick % len(self.tokens)]
        table = self.bm.block_table(req_id)
        self.bm.free(req_id)
        del self.tokens[req_id]
        for block in reversed(table):
            if self._holders(block) == 0 and block in self.cached:
                self.evictable.append(block)

    @rule()
    def reset(self) -> None:
        assert self.bm.reset_prefix_cache() == len(self.cached)
        self.cached.clear()
        self.evictable.clear()

    @invariant()
    def matches_the_model(self) -> None:
        bm = self.bm
        bm.check_invariants()
        for block in range(bm.num_blocks):
            assert bm.ref_count(block) == self._holders(block), "count != tables holding the block"
        in_use = sum(self._holders(b) > 0 for b in range(bm.num_blocks))
        assert bm.num_free_blocks + in_use == bm.num_blocks, "blocks not conserved"
        assert bm.num_cached_blocks == len(self.cached)
        assert all(self._holders(b) == 0 for b in self.evictable), "a held block is evictable"

    def _holders(self, block: int) -> int:
        return sum(block in self.bm.block_table(r) for r in self.tokens)

    def _model_hit(self, tokens: list[int]) -> list[int]:
        by_prefix = {prefix: block for block, prefix in self.cached.items()}
        hit, bs = [], self.bm.block_size
        for end in range(bs, len(tokens), bs):  # whole blocks, never every token
            block = by_prefix.get(tuple(tokens[:end]))
            if block is None:
                break
            hit.append(block)
        return hit

    def _model_register(self, req_id: str) -> None:
        tokens, bs = self.tokens[req_id], self.bm.block_size
        prefixes = set(self.cached.values())
        for index, block in enumerate(self.bm.block_table(req_id)[: len(tokens) // bs]):
            prefix = tuple(tokens[: (index + 1) * bs])
            if block not in self.cached and prefix not in prefixes:
                self.cached[block] = prefix
                prefixes.add(prefix)


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
