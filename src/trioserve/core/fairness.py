"""Fairness across clients: each client's waiting requests, and the order of the running ones.

Every request belongs to a client (``Request.client_id``: one WebSocket
connection, or whatever an embedder passes; ``""`` for everyone else). These
two structures keep one client's flood from holding another client's requests
behind it; the scheduler decides when to use them.

``ClientQueues`` holds the waiting requests, one FIFO queue per client. The
next request to admit is the head of the queue of the client with the fewest
running requests; among clients with as many, the one whose last turn is the
oldest, a client that has had none since it queued first (so equal clients
are served one request per turn, in rotation). A preempted request goes back
to the front of its client's queue: it resumes before its client's newer
requests.

``RunningOrder`` keeps the running requests in fair order. A request's *rank*
is the number of running requests of its client admitted before it; the order
is by rank, then by admission. So the first request is the earliest admitted of
all (rank 0), and the last is the newest request of a client that holds the
most running requests: the one to preempt first. A waiting request of a client
holding ``r`` running requests would get rank ``r``: it would sit after every
request of rank ``r`` or lower and before those of a higher rank, which it
*outranks*. So a newcomer never outranks a rank-0 request, and never one of its
own client.

The scheduler lets a newcomer that lacks a sequence slot or KV blocks preempt
requests it outranks (a fairness preemption). So a client with waiting
requests takes a slot from any client holding at least two more running
requests than it, and the running slots tend to an even split, within one,
among the clients that want them, however many requests one flooded in. This
cannot go back and forth: a newcomer of a client holding ``r`` running
requests preempts only requests of rank above ``r``, of clients holding at
least ``r + 2``; afterwards its client holds ``r + 1`` and those at least
``r + 1``, so neither outranks the other's newest (and the sum over clients of
their running requests squared has dropped by at least 2). Within one step,
the fewest running requests of a client with waiting requests never drops (a
fairness victim's client keeps at least ``r + 1``; a preemption for blocks
ends admission), and each level admits finitely many, so admission ends. A
request preempted for fairness keeps its tokens and resumes first among its
client's.

Invariants (``check_invariants`` raises ``RuntimeError`` naming the one broken):
- ``ClientQueues``: every queue is non-empty and holds only WAITING requests of
  its client, each request in one queue once; the clients with a queue are
  those with a last turn (-1: none yet);
- ``RunningOrder``: within each client, ranks are 0, 1, 2, ... in admission
  order; requests are sorted by (rank, admission number), so ranks never
  decrease along the order, and taking away the last request changes no
  other rank.
"""

from __future__ import annotations

import bisect
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterator

from trioserve.core.request import Request, RequestStatus


class ClientQueues:
    """The waiting requests: one FIFO queue per client, clients in rotation."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[Request]] = {}  # by client, in the order they queued
        self._last_turn: dict[str, int] = {}  # by client: the number of its last turn, -1 for none
        self._num_turns = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, client by client."""
        for queue in self._queues.values():
            yield from queue

    def add(self, req: Request) -> None:
        """Queue a new request behind its client's others."""
        self._queue_of(req.client_id).append(req)
        self._size += 1

    def push_front(self, req: Request) -> None:
        """Queue a preempted request before its client's others."""
        self._queue_of(req.client_id).appendleft(req)
        self._size += 1

    def next(self, num_running: Callable[[str], int]) -> Request | None:
        """The request whose turn it is: the head of the queue of the client
        with the fewest running requests and, among equals, the oldest last turn."""
        if not self._queues:
            return None
        client_id = min(self._queues, key=lambda c: (num_running(c), self._last_turn[c]))
        return self._queues[client_id][0]

    def take(self, req: Request) -> None:
        """Dequeue ``req``, which ``next`` returned, to admit it: its client's turn."""
        queue = self._queues[req.client_id]
        if queue[0] is not req:
            raise ValueError(f"{req!r} is not at the head of its client's queue")
        self._last_turn[req.client_id] = self._num_turns
        self._num_turns += 1
        queue.popleft()
        self._taken_from(req.client_id)

    def remove(self, req: Request) -> None:
        """Take ``req`` out wherever it is (aborted, or finished while preempted)."""
        self._queues[req.client_id].remove(req)
        self._taken_from(req.client_id)

    def _queue_of(self, client_id: str) -> deque[Request]:
        if client_id not in self._queues:
            self._queues[client_id] = deque()
            self._last_turn[client_id] = -1
        return self._queues[client_id]

    def _taken_from(self, client_id: str) -> None:
        self._size -= 1
        if not self._queues[client_id]:
            del self._queues[client_id], self._last_turn[client_id]

    def check_invariants(self) -> None:
        seen: set[str] = set()
        for client_id, queue in self._queues.items():
            _check(bool(queue), f"client {client_id!r} has an empty queue")
            for req in queue:
                _check(req.client_id == client_id, f"{req!r} is queued under client {client_id!r}")
                _check(req.status is RequestStatus.WAITING, f"{req!r} is queued but not WAITING")
                _check(req.request_id not in seen, f"{req!r} is queued twice")
                seen.add(req.request_id)
        _check(len(seen) == self._size, "the count of waiting requests drifted")
        _check(self._last_turn.keys() == self._queues.keys(), "last turns kept for clients without a queue")


class RunningOrder:
    """The running requests in fair order: by rank within their client, then by admission."""

    def __init__(self) -> None:
        self._order: list[Request] = []
        self._rank: dict[str, int] = {}  # by request id
        self._admitted: dict[str, int] = {}  # by request id: admission number, increasing
        self._num_running: Counter[str] = Counter()  # by client id
        self._num_admissions = 0

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._order))  # a snapshot: callers preempt while they iterate

    def __getitem__(self, index: int) -> Request:
        return self._order[index]

    def num_running(self, client_id: str) -> int:
        return self._num_running[client_id]

    def outranks(self, req: Request, other: Request) -> bool:
        """Waiting ``req``, once admitted, would sit before running ``other``."""
        return self._num_running[req.client_id] < self._rank[other.request_id]

    def num_to_preempt_for(
        self, req: Request, num_seqs: int, num_blocks: int, blocks_of: Callable[[Request], int]
    ) -> int | None:
        """How many of the last requests, all outranked by waiting ``req``, free
        at least ``num_seqs`` slots and ``num_blocks`` blocks (``blocks_of``
        each holds); None if all those it outranks are not enough."""
        count = 0
        for victim in reversed(self._order):
            if num_seqs <= 0 and num_blocks <= 0:
                break
            if not self.outranks(req, victim):
                return None
            num_seqs, num_blocks, count = num_seqs - 1, num_blocks - blocks_of(victim), count + 1
        return count if num_seqs <= 0 and num_blocks <= 0 else None

    def add(self, req: Request) -> None:
        """Admit ``req`` at its place in the order."""
        rank = self._num_running[req.client_id]
        index = bisect.bisect_right(self._order, rank, key=lambda r: self._rank[r.request_id])
        self._order.insert(index, req)
        self._rank[req.request_id] = rank
        self._admitted[req.request_id] = self._num_admissions
        self._num_admissions += 1
        self._num_running[req.client_id] += 1

    def pop(self) -> Request:
        """Take away the last request, the one to preempt first."""
        req = self._order.pop()
        self._forget(req)
        return req

    def remove(self, reqs: Collection[Request]) -> None:
        """Take away these requests (finished or aborted); the later requests
        of their clients move up a rank."""
        if not reqs:
            return
        for req in reqs:
            self._forget(req)
        gone = {req.request_id for req in reqs}
        self._order = [r for r in self._order if r.request_id not in gone]
        self._rank = _ranks(self._order, self._admitted)
        self._order.sort(key=self._key)

    def check_invariants(self) -> None:
        ids = {r.request_id for r in self._order}
        _check(len(ids) == len(self._order), "a request is running twice")
        _check(set(self._admitted) == ids, "admission numbers kept for requests not running")
        _check(self._rank == _ranks(self._order, self._admitted), "ranks are not admission order per client")
        _check(self._order == sorted(self._order, key=self._key), "running requests are not in fair order")
        counts = Counter(r.client_id for r in self._order)
        _check(+self._num_running == counts, "running counts per client drifted")
        _check(len(set(self._admitted.values())) == len(self._admitted), "two admissions share a number")

    def _key(self, req: Request) -> tuple[int, int]:
        return self._rank[req.request_id], self._admitted[req.request_id]

    def _forget(self, req: Request) -> None:
        del self._rank[req.request_id], self._admitted[req.request_id]
        self._num_running[req.client_id] -= 1
        if not self._num_running[req.client_id]:
            del self._num_running[req.client_id]


def _ranks(running: list[Request], admitted: dict[str, int]) -> dict[str, int]:
    """Each request's rank: how many requests of its client were admitted before it."""
    seen: Counter[str] = Counter()
    ranks = {}
    for req in sorted(running, key=lambda r: admitted[r.request_id]):
        ranks[req.request_id] = seen[req.client_id]
        seen[req.client_id] += 1
    return ranks


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)
