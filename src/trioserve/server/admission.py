"""Admission of TCP connections: the connection cap, and the reserve beyond it.

Every accepted connection gets one ``Slot`` at accept time (before it has
sent a byte) and gives it back when it closes:

- ``SERVE``: one of ``max_connections``. The connection is served:
  ``/health``, an HTTP answer, or a WebSocket.
- ``OVER_CAP``: the cap is full; one of ``OVER_CAP_SLOTS``. The connection
  has ``OVER_CAP_TIMEOUT_S`` to send its request head; ``/health`` is
  answered as usual (it is cheap and bounded, and a health check must not
  fail just because the server is full), anything else gets 503 with
  ``Retry-After: RETRY_AFTER_S``.
- ``DROP``: the reserve is full too (a flood of new connections). A 503 is
  written without reading the request, and the connection is closed at once.

Invariants: ``0 <= num_served <= max_connections`` and ``0 <= num_over_cap
<= over_cap_slots``, so clients hold at most ``max_connections +
over_cap_slots`` sockets for longer than it takes to write a 503.
"""

from __future__ import annotations

import enum

OVER_CAP_SLOTS = 32  # connections over the cap being answered at once (/health, or 503)
OVER_CAP_TIMEOUT_S = 1.0  # for one of them to send its request head and take the answer
RETRY_AFTER_S = 5  # the Retry-After of a 503 for being over the cap


class Slot(enum.Enum):
    SERVE = "serve"
    OVER_CAP = "over_cap"
    DROP = "drop"


class Admission:
    """Counts the connections of each kind of ``Slot``. Plain state, no I/O."""

    def __init__(self, max_connections: int, over_cap_slots: int = OVER_CAP_SLOTS) -> None:
        self.max_connections = max_connections
        self.over_cap_slots = over_cap_slots
        self.num_served = 0
        self.num_over_cap = 0

    @property
    def num_open(self) -> int:
        """Connections holding a slot (dropped ones hold none)."""
        return self.num_served + self.num_over_cap

    def admit(self) -> Slot:
        """The slot a new connection gets; ``release`` it when the connection closes."""
        if self.num_served < self.max_connections:
            self.num_served += 1
            return Slot.SERVE
        if self.num_over_cap < self.over_cap_slots:
            self.num_over_cap += 1
            return Slot.OVER_CAP
        return Slot.DROP

    def release(self, slot: Slot) -> None:
        if slot is Slot.SERVE:
            self.num_served -= 1
        elif slot is Slot.OVER_CAP:
            self.num_over_cap -= 1
