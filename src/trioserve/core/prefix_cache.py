"""Prefix caching as the scheduler uses it: where a request starts, which
blocks become cached, and what the cache has served.

The block manager keeps the blocks (hashes, reference counts, eviction);
this decides when to use them:

- A request being admitted (new, or resumed after a preemption) starts from
  its longest prefix of whole blocks found in the cache, but never from all
  of its tokens: at least one is computed, so that the step has logits to
  sample from. So at most ``(num_tokens - 1) // block_size`` blocks hit, and
  it computes (and writes) only blocks after them, which are its own. A
  request that asks for prompt logprobs finds nothing: it needs the logits
  of every prompt position, so it computes them all.
- A block is registered once it is full, its tokens are known, and a step
  that computes it has been made for good: at the end of ``schedule()``,
  once no slice of the step can be taken back, or in ``postprocess()``, when
  a sampled token fills a block that a step in flight computes. Workers run
  steps in order, so a step that reads a hit block runs after the step that
  wrote it; a request admitted in the very step that computes a block does
  not find it.
- Only full blocks are registered and a request writes only positions past
  its computed tokens, so a block held by several tables lies within every
  holder's computed full blocks and is never written again
  (``check_shared_blocks``).
- Hit rate: over first admissions, prompt tokens found in the cache over
  prompt tokens looked up (a resumed request's hits are not counted again).

Invariants: ``num_hits <= num_queries``; a request's ``num_cached_tokens`` is
set once, at its first admission, and is at most its prompt length.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from trioserve.core.block_hash import extend_block_hashes
from trioserve.core.block_manager import BlockManager
from trioserve.core.request import Request, RequestStatus


class PrefixCache:
    """Finds a request's cached prefix, registers its full blocks, counts hits."""

    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self.num_queries = 0  # prompt tokens of first admissions
        self.num_hits = 0  # of those, tokens found in the cache

    @property
    def enabled(self) -> bool:
        return self.block_manager.enable_caching

    def longest_hit(self, req: Request) -> list[int]:
        """The cached blocks that ``req``, about to be admitted, starts with."""
        pooling = req.params.pooling
        if not self.enabled or req.params.prompt_logprobs is not None or (pooling and pooling.reads_every_token):
            return []
        bm = self.block_manager
        max_blocks = (req.num_tokens - 1) // bm.block_size
        tokens = req.all_token_ids
        extend_block_hashes(req.block_hashes, tokens, bm.block_size, max_blocks, req.lora_key)
        return bm.find_cached(req.block_hashes, tokens, max_blocks)

    def admitted(self, req: Request, hit: Sequence[int]) -> None:
        """``req`` was admitted with ``hit``: count it, if this is its first admission."""
        if req.num_cached_tokens >= 0:
            return
        req.num_cached_tokens = min(len(hit) * self.block_manager.block_size, req.num_prompt_tokens)
        self.num_queries += req.num_prompt_tokens
        self.num_hits += req.num_cached_tokens

    def register(self, req: Request) -> None:
        """Register the blocks of ``req``, if running, that are now full, known and computed."""
        if not self.enabled or req.status is not RequestStatus.RUNNING:
            return
        bm = self.block_manager
        num_full = min(req.num_computed_tokens, req.num_tokens) // bm.block_size
        if num_full <= bm.num_registered(req.request_id):
            return
        tokens = req.all_token_ids
        extend_block_hashes(req.block_hashes, tokens, bm.block_size, num_full, req.lora_key)
        bm.register_full_blocks(req.request_id, req.block_hashes, tokens, num_full)

    def reported(self, req: Request) -> int | None:
        """What ``req``'s output reports of its cached prompt tokens: their
        number with its first token (when caching is on), else None."""
        if not self.enabled or req.num_output_tokens != 1:
            return None
        return max(0, req.num_cached_tokens)

    def stats(self) -> dict[str, Any]:
        """The cache's fields of ``EngineStats``."""
        return {
            "prefix_caching": self.enabled,
            "num_cached_blocks": self.block_manager.num_cached_blocks,
            "prefix_cache_queries": self.num_queries,
            "prefix_cache_hits": self.num_hits,
        }


def check_shared_blocks(running: Iterable[Request], block_manager: BlockManager) -> None:
    """Raise ``RuntimeError`` unless every block held by several tables sits at
    the same index in each, inside each holder's computed full blocks, after
    the same tokens: no holder writes it again, and each reads what it would
    have computed itself."""
    bs = block_manager.block_size
    seen: dict[int, tuple[int, Request]] = {}  # block -> (index, first holder)
    for req in running:
        num_full = min(req.num_computed_tokens, req.num_tokens) // bs
        for index, block in enumerate(block_manager.block_table(req.request_id)):
            if block_manager.ref_count(block) < 2:
                continue
            if index >= num_full:
                raise RuntimeError(f"{req!r} may write block {block} (index {index}), which is shared")
            if block in seen:
                first_index, first = seen[block]
                end = (index + 1) * bs
                if first_index != index or first.all_token_ids[:end] != req.all_token_ids[:end]:
                    raise RuntimeError(f"block {block} is shared by {first!r} and {req!r} for different prefixes")
            else:
                seen[block] = (index, req)
