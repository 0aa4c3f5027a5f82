"""The paged KV cache's bookkeeping: which request owns which block.

A request's block table lists, in order, the blocks holding its tokens:
token ``i`` lives in block ``table[i // block_size]`` at offset
``i % block_size``.

Invariants (``check_invariants`` raises ``RuntimeError`` naming the one broken):
- every block id in ``range(num_blocks)`` is free or in exactly one table,
  so ``num_free_blocks + num_used_blocks == num_blocks``;
- a table holds exactly ``ceil(n / block_size)`` blocks, ``n`` being the most
  tokens ``allocate`` was asked to hold for that request;
- tables only grow; ``free`` gives back all of a request's blocks at once.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocksError(RuntimeError):
    """``allocate`` was asked for more blocks than are free."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Hands out fixed-size KV-cache blocks to requests and takes them back."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1 (got {num_blocks!r})")
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1 (got {block_size!r})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}
        self._num_tokens: dict[str, int] = {}  # the most tokens each table was sized for

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return sum(len(table) for table in self._tables.values())

    def blocks_needed(self, req_id: str, num_tokens: int) -> int:
        """How many more blocks ``req_id`` needs to hold ``num_tokens`` tokens in all."""
        held = len(self._tables.get(req_id, ()))
        return max(0, cdiv(num_tokens, self.block_size) - held)

    def can_allocate(self, req_id: str, num_tokens: int) -> bool:
        return self.blocks_needed(req_id, num_tokens) <= len(self._free)

    def allocate(self, req_id: str, num_tokens: int) -> list[int]:
        """Grow ``req_id``'s table to hold ``num_tokens`` tokens; return the new block ids.

        Raises ``OutOfBlocksError`` (and changes nothing) if too few blocks are free.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens: must be >= 0 (got {num_tokens!r})")
        needed = self.blocks_needed(req_id, num_tokens)
        if needed > len(self._free):
            raise OutOfBlocksError(f"request {req_id!r} needs {needed} more KV blocks, only {len(self._free)} are free")
        if num_tokens == 0 and req_id not in self._tables:
            return []
        new_blocks = [self._free.popleft() for _ in range(needed)]
        self._tables.setdefault(req_id, []).extend(new_blocks)
        self._num_tokens[req_id] = max(num_tokens, self._num_tokens.get(req_id, 0))
        return new_blocks

    def free(self, req_id: str) -> None:
        """Give back every block of ``req_id``. Freeing an unknown request does nothing."""
        self._free.extend(self._tables.pop(req_id, ()))
        self._num_tokens.pop(req_id, None)

    def block_table(self, req_id: str) -> list[int]:
        """A copy of ``req_id``'s block table (empty if it holds no blocks)."""
        return list(self._tables.get(req_id, ()))

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` naming the first broken invariant."""
        used = [block for table in self._tables.values() for block in table]
        if len(self._free) + len(used) != self.num_blocks:
            raise RuntimeError(
                f"blocks not conserved: {len(self._free)} free + {len(used)} used != {self.num_blocks} total"
            )
        everything = list(self._free) + used
        if len(set(everything)) != len(everything):
            raise RuntimeError("a block is owned twice (or free and owned at once)")
        if set(everything) != set(range(self.num_blocks)):
            raise RuntimeError("a block id is out of range")
        for req_id, table in self._tables.items():
            want = cdiv(self._num_tokens.get(req_id, 0), self.block_size)
            if len(table) != want:
                raise RuntimeError(f"table of {req_id!r} has {len(table)} blocks, its tokens need {want}")
