"""Model runners: what a worker process steps. ``Runner`` is the contract;
``runners.fake.FakeRunner`` (no torch) and ``gpu.model_runner.ModelRunner``
(transformers) satisfy it; the worker process (``nurseries.worker.main``) picks
one. ``runners.steplog`` is the step timing log a runner may write."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable

    from trioserve.messages import GrammarBitmask, RunnerOutput, SchedulerOutput, WorkerLoaded
    from trioserve.rpc import ShardInfo


class Runner(Protocol):
    """One model (or one shard of it) over a paged KV cache, in one worker.

    Called in this order, from one thread: ``load()`` once, then
    ``init_kv_cache(n)`` once, then ``execute(step)`` once per scheduler step,
    and between steps the control calls (``describe``, ``sleep``, ``wake_up``,
    ``load_adapter``, ``drop_adapter``, ``pin_adapter``, ``start_profile``,
    ``stop_profile``).
    A runner keeps each request's token list and appends every token it
    samples, so a step can be planned before the previous one's tokens are
    back in the engine core. Errors raise; the worker reports them.
    """

    def load(self) -> WorkerLoaded:
        """Load the model; report what it is and how many KV blocks fit."""
        ...

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV blocks (the smallest any rank can hold)."""
        ...

    def execute(self, step: SchedulerOutput, bitmask: Callable[[], GrammarBitmask] | None = None) -> RunnerOutput:
        """Run one step and return the tokens it sampled. A step that
        ``awaits_bitmask`` samples only once ``bitmask()`` (which blocks until
        the engine core sends it) gives the allowed tokens of its constrained
        rows; call it once, after the model's forward pass."""
        ...

    def describe(self) -> ShardInfo:
        """This rank's share of the model and of the KV cache, and its memory."""
        ...

    def sleep(self, level: int) -> None:
        """Free the KV cache (level 1), and the weights too (level 2)."""
        ...

    def wake_up(self) -> None:
        """Restore what ``sleep`` freed; a no-op when awake."""
        ...

    def load_adapter(self, name: str, path: str) -> int:
        """Read and check the LoRA adapter at ``path`` as ``name``; its rank
        (``trioserve.lora.AdapterError`` naming the file and the problem)."""
        ...

    def drop_adapter(self, name: str) -> None:
        """Forget adapter ``name``."""
        ...

    def pin_adapter(self, name: str) -> None:
        """Keep adapter ``name`` in memory (``ValueError`` if unknown)."""
        ...

    def start_profile(self) -> None:
        """Record a profile of the steps from now on (``RuntimeError`` if one is being recorded)."""
        ...

    def stop_profile(self, path: str) -> None:
        """Stop recording, and write the profile to ``path`` as a Chrome trace (JSON; ``""``: drop it)."""
        ...
