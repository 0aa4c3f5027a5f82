"""What a benchmark sends: requests (prompt token ids, output length) and when.

A workload is a pure function of its ``WorkloadSpec``: the same spec gives
the same prompts, lengths and arrival times, in every process (the drivers
and the baselines build it from the spec, not from each other).

Prompts are random token ids in ``[FIRST_PROMPT_ID, vocab_size)``: below
that are the tiny tokenizers' special tokens (pad, BOS, EOS). Every request
asks for exactly its output length (``ignore_eos``), so that runs compare.
With ``shared_prefix_len``, every prompt starts with the same random prefix
of that many tokens (one long system prompt, say), then its own random
suffix of ``prompt_len`` tokens: the workload of prefix caching.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

FIRST_PROMPT_ID = 3
MAX_NUM_REQUESTS = 1_000_000
MAX_PROMPT_TOKENS = 50_000_000  # all prompts are built up front, about 40 bytes a token: 2 GB
MAX_ARRIVAL_SPAN_S = 86_400.0  # with a request rate, the requests' expected arrival span: a day


def parse_range(text: str, option: str = "length range") -> tuple[int, int]:
    """``"64"`` -> (64, 64); ``"32-256"`` -> (32, 256). Raises ``ValueError`` naming ``option``."""
    low, _, high = text.partition("-")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        lo = hi = 0
    if not 1 <= lo <= hi:
        raise ValueError(f"{option}: {text!r:.40} is not N or LO-HI with 1 <= LO <= HI")
    return lo, hi


@dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    """A benchmark's requests. Lengths are drawn uniformly in ``[lo, hi]``."""

    num_requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    vocab_size: int
    seed: int = 0
    concurrency: int | None = None  # most requests in flight (None: no limit)
    request_rate: float | None = None  # Poisson arrivals per second (None: all at once)
    shared_prefix_len: int = 0  # tokens every prompt starts with, before its own prompt_len

    def __post_init__(self) -> None:
        if not 1 <= self.num_requests <= MAX_NUM_REQUESTS:
            raise ValueError(f"num_requests: must be in [1, {MAX_NUM_REQUESTS}] (got {self.num_requests})")
        for name in ("prompt_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}: want 1 <= lo <= hi (got {lo}-{hi})")
        if self.vocab_size <= FIRST_PROMPT_ID:
            raise ValueError(f"vocab_size: must be > {FIRST_PROMPT_ID}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency: must be >= 1")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError("request_rate: must be > 0")
        if self.shared_prefix_len < 0:
            raise ValueError("shared_prefix_len: must be >= 0")

    @property
    def max_prompt_len(self) -> int:
        return self.shared_prefix_len + self.prompt_len[1]

    @property
    def max_request_len(self) -> int:
        """The most tokens a request holds at its end, prompt and output."""
        return self.max_prompt_len + self.output_len[1]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkloadSpec:
        data = dict(data)
        data["prompt_len"] = tuple(data["prompt_len"])
        data["output_len"] = tuple(data["output_len"])
        return cls(**data)


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float  # offset from the start of the run (0 without a request rate)


def build_requests(spec: WorkloadSpec) -> list[BenchRequest]:
    """The spec's requests, in arrival order."""
    rng = random.Random(spec.seed)
    prefix_rng = random.Random(f"shared prefix {spec.seed}")  # the other lengths leave it as it is
    prefix = [prefix_rng.randrange(FIRST_PROMPT_ID, spec.vocab_size) for _ in range(spec.shared_prefix_len)]
    requests, clock = [], 0.0
    for i in range(spec.num_requests):
        n_prompt = rng.randint(*spec.prompt_len)
        prompt = prefix + [rng.randrange(FIRST_PROMPT_ID, spec.vocab_size) for _ in range(n_prompt)]
        if spec.request_rate is not None and i > 0:
            clock += rng.expovariate(spec.request_rate)
        requests.append(BenchRequest(i, prompt, rng.randint(*spec.output_len), clock))
    return requests


def warmup_spec(vocab_size: int) -> WorkloadSpec:
    """Two short requests run before every measurement, and not counted:
    the first model calls pay one-off costs (allocation, kernel selection)."""
    return WorkloadSpec(num_requests=2, prompt_len=(16, 16), output_len=(4, 4), vocab_size=vocab_size, seed=99)
