"""The engine core's structured outputs: grammars compiled off the Trio
thread, a bounded cache of them, and the bitmask each step's constrained
rows sample under.

Invariants:
- a constraint compiles at most once at a time: requests that need one being
  compiled wait for that compile; a compiled one stays in a cache of
  ``GRAMMAR_CACHE_SIZE`` (least recently used out) and each request gets a
  copy of it, so a cache hit costs a copy (about 20 microseconds);
- compiles run in worker threads (at most ``COMPILE_THREADS`` at once), each
  bounded by ``COMPILE_TIMEOUT_S``; past it, or when the constraint does not
  compile, its requests end with an error naming the problem. A compile that
  times out is abandoned: its thread ends by llguidance's own limits;
- results are taken by the step loop (``take_results``) between steps, so
  the scheduler is never touched from a thread;
- a step's bitmask is filled once every step before it is postprocessed, from
  matchers that have accepted every token sampled so far.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import trio

from trioserve.core.request import Request
from trioserve.messages import GrammarBitmask
from trioserve.nurseries.engine_core.grammar import (
    BitmaskFiller,
    ConstraintError,
    GrammarMatcher,
    Tokenizer,
    compile_matcher,
)
from trioserve.structured import constraint_key

if TYPE_CHECKING:
    import llguidance  # imported by grammar.py's functions, on the first constrained request

GRAMMAR_CACHE_SIZE = 256  # compiled constraints kept
COMPILE_TIMEOUT_S = 10.0  # the longest one constraint may take to compile
COMPILE_THREADS = 2  # compiles at once
# llguidance's threads for a step's bitmask: they run while the workers' forward pass does, so a few at most.
FILL_THREADS = max(1, min(4, os.cpu_count() or 1))

Result = GrammarMatcher | str  # a request's matcher, or why it has none


class StructuredOutputs:
    """Compiles, caches and applies the constraints of one engine core's requests."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        *,
        cache_size: int = GRAMMAR_CACHE_SIZE,
        compile_timeout_s: float = COMPILE_TIMEOUT_S,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._cache_size = cache_size
        self._compile_timeout_s = compile_timeout_s
        self._cache: OrderedDict[bytes, llguidance.LLMatcher] = OrderedDict()
        self._compiling: dict[bytes, list[Request]] = {}  # constraint -> the requests waiting for it
        self._results: list[tuple[Request, Result]] = []
        self._have_results = trio.Event()
        self._limiter = trio.CapacityLimiter(COMPILE_THREADS)
        self._filler: BitmaskFiller | None = None  # its thread pool starts with the first constrained step
        self.num_compiles = 0  # since start
        self.num_cache_hits = 0

    @property
    def compiling(self) -> bool:
        return bool(self._compiling)

    @property
    def has_results(self) -> bool:
        """A compile has ended whose result is not yet taken."""
        return bool(self._results)

    def prepare(self, request: Request, nursery: trio.Nursery) -> GrammarMatcher | None:
        """``request``'s matcher now, from the cache; else None, and its
        compile is started (or joined) in ``nursery``: its result comes
        from ``take_results``."""
        constraint = request.params.structured
        if constraint is None:
            raise ValueError(f"request {request.request_id!r} has no constraint")
        key = constraint_key(constraint)
        template = self._cache.get(key)
        if template is not None:
            self._cache.move_to_end(key)
            self.num_cache_hits += 1
            return GrammarMatcher(template.deep_copy())
        waiting = self._compiling.get(key)
        if waiting is not None:
            waiting.append(request)
        else:
            self._compiling[key] = [request]
            nursery.start_soon(self._compile, key, request)
        return None

    async def _compile(self, key: bytes, request: Request) -> None:
        constraint = request.params.structured
        assert constraint is not None
        error = f"compiling the constraint took longer than {self._compile_timeout_s:g}s"
        template = None
        with trio.move_on_after(self._compile_timeout_s):
            try:
                template = await trio.to_thread.run_sync(
                    compile_matcher, self._tokenizer, constraint, limiter=self._limiter, abandon_on_cancel=True
                )
            except ConstraintError as exc:
                error = str(exc)
        self.num_compiles += 1
        if template is not None:
            self._cache[key] = template
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        for waiting in self._compiling.pop(key):
            result: Result = error if template is None else GrammarMatcher(template.deep_copy())
            self._results.append((waiting, result))
        self._have_results.set()

    def take_results(self) -> list[tuple[Request, Result]]:
        """The compiles ended since the last call: each waiting request with its matcher or its error."""
        results, self._results = self._results, []
        if self._have_results.is_set():
            self._have_results = trio.Event()
        return results

    async def wait_results(self) -> None:
        """Return once a compile has ended whose result is not yet taken."""
        await self._have_results.wait()

    def bitmask(self, samplers: Iterable[Request], live: Callable[[Request], bool]) -> GrammarBitmask:
        """The allowed tokens of each constrained request of ``samplers`` that
        is ``live`` (not finished since its step was planned)."""
        rows = [r for r in samplers if isinstance(r.constraint, GrammarMatcher) and live(r)]
        if self._filler is None:
            self._filler = BitmaskFiller(self._vocab_size, FILL_THREADS)
        matchers = [r.constraint for r in rows if isinstance(r.constraint, GrammarMatcher)]
        data = self._filler.fill(matchers)
        return GrammarBitmask(req_ids=[r.request_id for r in rows], words=self._filler.words, bitmask=data)
