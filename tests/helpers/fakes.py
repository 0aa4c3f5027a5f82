"""The fake runner as the tests see it, and process accounting.

``fake_tokens`` is the fake runner's documented token rule, computed here
independently of ``runners/fake.py``, so that a test of the engine checks
the tokens that come out against what the runner was asked to make.
"""

from __future__ import annotations

from typing import Any

import psutil
import trio

from trioserve import EngineConfig, FakeRunnerConfig
from trioserve.runners.fake import FakeRunner

VOCAB = 259  # the tiny test tokenizer's vocabulary: 256 bytes + 3 specials
EOS = 2  # the fake runner's EOS in the tests


def fake_tokens(prompt: list[int], n: int) -> list[int]:
    """The ``n`` tokens the fake runner produces after ``prompt`` (no EOS)."""
    tokens = list(prompt)
    for _ in range(n):
        t = (tokens[-1] * 31 + 7) % VOCAB
        tokens.append(t + 1 if t == EOS else t)
    return tokens[len(prompt) :]


def make_fake_config(model: str, **options: Any) -> EngineConfig:
    """An engine on the fake runner: ``options`` are ``EngineConfig`` fields
    and ``FakeRunnerConfig`` fields, told apart by name. Defaults suit
    tests: blocks of 4 tokens, a 2.5 s shutdown grace, EOS ``EOS``."""
    engine_fields = EngineConfig.__dataclass_fields__
    engine_options = {k: options.pop(k) for k in list(options) if k in engine_fields}
    engine_options.setdefault("block_size", 4)
    engine_options.setdefault("shutdown_grace_s", 2.5)  # above a child's hard exit (1.5 s) + its reaping (0.5 s)
    options.setdefault("eos_token_id", EOS)
    return EngineConfig(model=model, runner="fake", fake=FakeRunnerConfig(**options), **engine_options)


# Defaults of the fake_config fixture that test modules share (``pytest.mark.fake_config(**SERVING)``).
SERVING = {"num_kv_blocks": 256, "step_delay_s": 0.002}  # a server's tests: many requests at once, 2 ms steps
RESTARTING = {"restart_backoff_s": 0.05, "num_kv_blocks": 64}  # supervision's tests: restarts at once


def children() -> list[psutil.Process]:
    """This process's descendants that are still alive (one that exits
    while they are listed is not one of them)."""
    alive = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            pass
    return alive


async def wait_no_children(timeout: float = 2.0) -> list[psutil.Process]:
    """Wait (at most ``timeout``) until this process has no descendant; those left."""
    with trio.move_on_after(timeout):
        while children():
            await trio.sleep(0.05)
    return children()


class QuietFakeRunner(FakeRunner):
    """The fake runner run in the test process: no SIGUSR1 handler installed there."""

    def _install_fault_signal(self) -> None:
        pass


class Script:
    """A constraint that allows the tokens of ``allowed``, one per position, then is complete."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed
        self.accepted: list[int] = []

    def accept(self, token_id: int) -> bool:
        if len(self.accepted) >= len(self.allowed) or self.allowed[len(self.accepted)] != token_id:
            return False
        self.accepted.append(token_id)
        return True

    def is_complete(self) -> bool:
        return self.accepted == self.allowed
