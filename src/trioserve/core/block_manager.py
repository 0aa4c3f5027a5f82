"""The paged KV cache's bookkeeping: which requests hold which blocks, and
which blocks hold a cached prefix (prefix caching).

A request's block table lists, in order, the blocks holding its tokens:
token ``i`` lives in block ``table[i // block_size]`` at offset
``i % block_size``.

With caching on, a full block whose tokens are known and computed is
*registered* under its chained hash (``core/block_hash.py``): the hash names
the block's tokens and the whole prefix before them. A new request's table
may then start with registered blocks (``find_cached``, then ``allocate``
with them as ``hit``): blocks are shared, and each has a reference count.
A block whose count drops to 0 keeps its content and its hash
(*evictable*) until a new block is needed and no empty one is left; then the
least recently freed evictable block is taken and its hash forgotten. A
request frees its blocks last first, so its tail is evicted before its head.

Each block is in exactly one state:
- *empty*: count 0, no hash, in the free queue;
- *evictable*: count 0, registered, in the evictable queue (least recently used first);
- *in use*: count >= 1, registered or not, in that many tables.

Invariants (``check_invariants`` raises ``RuntimeError`` naming the one broken):
- empty + evictable + in use == ``num_blocks``; every block is in one state;
- a block's count equals the number of tables holding it; no table holds a
  block twice;
- the hash -> block map and each block's hash agree; a hash names one block;
- a table holds exactly ``ceil(n / block_size)`` blocks, ``n`` being the most
  tokens ``allocate`` was asked to hold for that request;
- tables only grow; ``free`` gives back all of a request's blocks at once.
The scheduler keeps the rest: only full, computed blocks are registered, so
a block in more than one table is never written again (``Scheduler.check_invariants``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from trioserve.core.block_hash import ROOT_HASH, BlockHash


class OutOfBlocksError(RuntimeError):
    """``allocate`` was asked for more blocks than are free."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class CachedBlock:
    """What a registered block holds: its hash, its parent's, its own tokens."""

    block_hash: BlockHash
    parent_hash: BlockHash
    token_ids: tuple[int, ...]


class BlockManager:
    """Hands out fixed-size KV-cache blocks to requests, shares cached ones, takes them back."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1 (got {num_blocks!r})")
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1 (got {block_size!r})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: deque[int] = deque(range(num_blocks))  # empty blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self._ref = [0] * num_blocks
        self._cached: dict[int, CachedBlock] = {}  # registered blocks
        self._by_hash: dict[BlockHash, int] = {}
        self._tables: dict[str, list[int]] = {}
        self._num_tokens: dict[str, int] = {}  # the most tokens each table was sized for
        self._num_registered: dict[str, int] = {}  # leading blocks of each table already offered to the map

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take: empty ones, then evictable ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one table."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks, in use or evictable."""
        return len(self._cached)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def num_registered(self, req_id: str) -> int:
        """Leading blocks of ``req_id``'s table already offered to the cache."""
        return self._num_registered.get(req_id, 0)

    def blocks_needed(self, req_id: str, num_tokens: int, hit: Sequence[int] = ()) -> int:
        """How many more blocks ``req_id`` needs to hold ``num_tokens`` tokens in
        all, its table starting with the cached blocks ``hit`` (for a request
        that holds no table yet)."""
        held = len(self._tables.get(req_id, ())) + len(hit)
        return max(0, cdiv(num_tokens, self.block_size) - held)

    def blocks_to_take(self, req_id: str, num_tokens: int, hit: Sequence[int] = ()) -> int:
        """Free blocks the allocation would use up: the new ones, and the hits
        that are evictable now (taking one makes it in use)."""
        return self.blocks_needed(req_id, num_tokens, hit) + sum(self._ref[b] == 0 for b in hit)

    def can_allocate(self, req_id: str, num_tokens: int, hit: Sequence[int] = ()) -> bool:
        return self.blocks_to_take(req_id, num_tokens, hit) <= self.num_free_blocks

    def allocate(self, req_id: str, num_tokens: int, hit: Sequence[int] = ()) -> list[int]:
        """Grow ``req_id``'s table to hold ``num_tokens`` tokens; return the new
        (empty or evicted) block ids. ``hit``: registered blocks that a request
        holding no table yet starts with (``find_cached``).

        Raises ``OutOfBlocksError`` (and changes nothing) if too few blocks are free.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens: must be >= 0 (got {num_tokens!r})")
        if hit and (req_id in self._tables or len(hit) * self.block_size > num_tokens):
            raise ValueError(f"hit: {len(hit)} cached blocks for {req_id!r} that holds a table or too few tokens")
        taking = self.blocks_to_take(req_id, num_tokens, hit)
        if taking > self.num_free_blocks:
            raise OutOfBlocksError(
                f"request {req_id!r} needs {taking} more KV blocks, only {self.num_free_blocks} are free"
            )
        if num_tokens == 0 and req_id not in self._tables:
            return []
        table = self._tables.setdefault(req_id, [])
        for block in hit:
            self._evictable.pop(block, None)
            self._ref[block] += 1
            table.append(block)
        new_blocks = [self._take_free_block() for _ in range(self.blocks_needed(req_id, num_tokens))]
        for block in new_blocks:
            self._ref[block] = 1
        table.extend(new_blocks)
        self._num_tokens[req_id] = max(num_tokens, self._num_tokens.get(req_id, 0))
        self._num_registered.setdefault(req_id, len(hit))
        return new_blocks

    def free(self, req_id: str) -> None:
        """Give back every block of ``req_id``, last first: a block no table
        holds any more stays cached (evictable) if registered, else is empty.
        Freeing an unknown request does nothing."""
        for block in reversed(self._tables.pop(req_id, ())):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if block in self._cached:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        self._num_tokens.pop(req_id, None)
        self._num_registered.pop(req_id, None)

    def block_table(self, req_id: str) -> list[int]:
        """A copy of ``req_id``'s block table (empty if it holds no blocks)."""
        return list(self._tables.get(req_id, ()))

    def num_blocks_freed_by(self, req_id: str, keep: Collection[int] = ()) -> int:
        """Blocks that freeing ``req_id`` alone would make free, ``keep`` aside."""
        return sum(self._ref[b] == 1 and b not in keep for b in self._tables.get(req_id, ()))

    # --- prefix caching --------------------------------------------------------

    def find_cached(self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int], max_blocks: int) -> list[int]:
        """The registered blocks holding the longest prefix of ``token_ids``,
        at most ``max_blocks`` of them: block ``i`` must be registered under
        ``block_hashes[i]`` *and* hold the same tokens after the same parent."""
        if not self.enable_caching:
            return []
        hit: list[int] = []
        bs = self.block_size
        parent = ROOT_HASH
        for i, block_hash in enumerate(block_hashes[:max_blocks]):
            block = self._by_hash.get(block_hash)
            if block is None:
                break
            cached = self._cached[block]
            if cached.parent_hash != parent or cached.token_ids != tuple(token_ids[i * bs : (i + 1) * bs]):
                break  # a hash alone is never trusted: the tokens and the parent must match too
            hit.append(block)
            parent = block_hash
        return hit

    def register_full_blocks(
        self, req_id: str, block_hashes: Sequence[BlockHash], token_ids: Sequence[int], num_full: int
    ) -> None:
        """Register the first ``num_full`` blocks of ``req_id``'s table (full,
        their tokens known and computed, or planned in a step already made)
        under ``block_hashes``. A block whose hash names another block already
        stays unregistered: it is freed as empty."""
        if not self.enable_caching:
            return
        table, bs = self._tables[req_id], self.block_size
        for i in range(self._num_registered.get(req_id, 0), num_full):
            block, block_hash = table[i], block_hashes[i]
            if block in self._cached or block_hash in self._by_hash:
                continue
            parent = block_hashes[i - 1] if i else ROOT_HASH
            self._cached[block] = CachedBlock(block_hash, parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            self._by_hash[block_hash] = block
        self._num_registered[req_id] = max(num_full, self._num_registered.get(req_id, 0))

    def reset_prefix_cache(self) -> int:
        """Forget every registered block; evictable ones become empty. Blocks in
        use keep their content for the tables that hold them. Returns how many
        blocks were forgotten."""
        num_forgotten = len(self._cached)
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._cached.clear()
        self._by_hash.clear()
        return num_forgotten

    def _take_free_block(self) -> int:
        """An empty block, else the least recently freed evictable one, forgotten."""
        if self._free:
            return self._free.popleft()
        block, _ = self._evictable.popitem(last=False)
        del self._by_hash[self._cached.pop(block).block_hash]
        return block

    # --- checks ----------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` naming the first broken invariant."""
        holders = [0] * self.num_blocks
        for req_id, table in self._tables.items():
            _check(len(set(table)) == len(table), f"table of {req_id!r} holds a block twice")
            for block in table:
                _check(0 <= block < self.num_blocks, "a block id is out of range")
                holders[block] += 1
            want = cdiv(self._num_tokens.get(req_id, 0), self.block_size)
            _check(len(table) == want, f"table of {req_id!r} has {len(table)} blocks, its tokens need {want}")
        _check(holders == self._ref, "a reference count differs from the number of tables holding the block")
        in_use = sum(count > 0 for count in self._ref)
        total = len(self._free) + len(self._evictable) + in_use
        _check(
            total == self.num_blocks,
            f"blocks not conserved: {len(self._free)} empty + {len(self._evictable)} evictable "
            f"+ {in_use} in use != {self.num_blocks} total",
        )
        everything = list(self._free) + list(self._evictable) + [b for b in range(self.num_blocks) if self._ref[b]]
        _check(set(everything) == set(range(self.num_blocks)), "a block is owned twice (or free and owned at once)")
        _check(all(b not in self._cached for b in self._free), "an empty block is registered")
        _check(all(b in self._cached for b in self._evictable), "an evictable block is not registered")
        _check(
            {c.block_hash: b for b, c in self._cached.items()} == self._by_hash,
            "the hash map and the blocks' hashes differ",
        )


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)
