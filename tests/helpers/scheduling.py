"""Schedulers and requests for the tests of ``trioserve.core``: small sizes,
so that a test reaches a limit (blocks, batch, sequences) in a few requests."""

from __future__ import annotations

from trioserve.core.request import Request
from trioserve.core.scheduler import Scheduler
from trioserve.sampling_params import SamplingParams

EOS = 2  # every test request's EOS token


def make_scheduler(**overrides: int | bool) -> Scheduler:
    """A scheduler of 16 blocks of 4 tokens, 4 sequences, 64 tokens a step
    and 64 a request; ``overrides`` are ``Scheduler`` arguments."""
    options: dict[str, int | bool] = dict(
        num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64
    )
    options.update(overrides)
    return Scheduler(**options)  # type: ignore[arg-type]


def make_request(
    req_id: str, prompt_len: int = 4, client_id: str = "", *, prompt: list[int] | None = None, **params: object
) -> Request:
    """A request of ``prompt`` (by default the ``prompt_len`` tokens 10, 11,
    ...), stopped by ``EOS``; ``params`` are ``SamplingParams`` fields."""
    tokens = [10 + i for i in range(prompt_len)] if prompt is None else prompt
    return Request(req_id, tokens, SamplingParams(**params), eos_token_ids=[EOS], client_id=client_id)
