"""Content hashes of full KV blocks, chained so that a hash names a whole prefix.

Block ``i`` of a sequence (its tokens ``[i * block_size, (i + 1) * block_size)``)
is named by ``SHA-256(parent || extra_key || token ids)``, where ``parent`` is
the hash of block ``i - 1`` (``ROOT_HASH`` for block 0). Two blocks share a hash
only if they hold the same tokens *after the same whole prefix*, at the same
positions: exactly when their keys and values are the same (for one model, in
one engine: the cache never outlives the engine core).

``extra_key`` holds anything else that changes the keys and values of a
block: the request's LoRA adapter's key (``core/lora.py``), empty for the
base model.

SHA-256, not Python's ``hash``: prompts come from clients, and a client that
could make two different prefixes collide could read another client's
cached values or poison them. A hit is still confirmed by comparing token ids
(``BlockManager.find_cached``), so a collision would have to match those too.

Invariants: a hash is a 32-byte digest; ``block_hashes`` only ever appends
(a request's known tokens never change, so neither do its blocks' hashes).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes

ROOT_HASH: BlockHash = hashlib.sha256(b"trioserve prefix cache v1").digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_key: bytes = b"") -> BlockHash:
    """The hash of one full block holding ``token_ids``, after the prefix named by ``parent``."""
    h = hashlib.sha256(parent)
    h.update(len(extra_key).to_bytes(4, "little"))
    h.update(extra_key)
    h.update(array("Q", token_ids).tobytes())  # fixed width: no two token lists encode alike
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, num_blocks: int, extra_key: bytes = b""
) -> None:
    """Append to ``hashes`` (those of the first blocks of ``token_ids``) the
    hashes of the further blocks that ``token_ids`` fills, up to ``num_blocks`` in all."""
    parent = hashes[-1] if hashes else ROOT_HASH
    end = min(num_blocks, len(token_ids) // block_size) * block_size
    for start in range(len(hashes) * block_size, end, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra_key)
        hashes.append(parent)
