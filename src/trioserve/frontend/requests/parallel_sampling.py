"""``n`` samples of one prompt: a parent request fanned out into ``n`` children.

Each child is an ordinary request in the engine (its own id, KV blocks and
place in the batch); the parent exists only in the front-end. Child ``i``
is named ``{parent}-{i}`` and, when the parent has a seed, samples with
``seed + i`` (mod 2**63): n different samples that are each reproducible.
Without a seed, the children share the parent's parameters.
"""

from __future__ import annotations

import msgspec

from trioserve.errors import InvalidRequestError
from trioserve.sampling_params import SamplingParams

MAX_N = 128  # samples of one prompt
_SEED_RANGE = 2**63


def check_n(n: object) -> int:
    """``n``, checked: an integer in [1, MAX_N]. Raises ``InvalidRequestError`` naming ``n``."""
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise InvalidRequestError("n", f"must be an integer in [1, {MAX_N}] (got {n!r:.40})")
    return n


def check_batch(num_prompts: int, n: int, capacity: int) -> None:
    """Refuse (naming ``n``) ``n`` samples of ``num_prompts`` prompts beyond
    what one engine takes at once: no retry could ever run them."""
    if n * num_prompts > capacity:
        samples = f"{n} samples" if num_prompts == 1 else f"{num_prompts} prompts x {n} samples"
        raise InvalidRequestError(
            "n",
            f"{samples} go to one engine, which takes at most {capacity} requests at once "
            "(max_num_seqs + max_waiting_requests)",
        )


def child_request_id(parent_id: str, index: int) -> str:
    return f"{parent_id}-{index}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Child ``index``'s parameters: the parent's, with ``seed + index`` when seeded."""
    if params.seed is None or index == 0:
        return params
    return msgspec.structs.replace(params, seed=(params.seed + index) % _SEED_RANGE)
