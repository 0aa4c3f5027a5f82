"""Fairness across clients: the per-client waiting queues and the fair running order."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from helpers.scheduling import make_request

from trioserve.core.fairness import ClientQueues, RunningOrder
from trioserve.core.request import Request, RequestStatus


def client_request(req_id: str) -> Request:
    """A request of the client named by the id's first letter."""
    return make_request(req_id, client_id=req_id[0])


def running(*req_ids: str) -> tuple[RunningOrder, dict[str, Request]]:
    order, reqs = RunningOrder(), {}
    for req_id in req_ids:
        reqs[req_id] = client_request(req_id)
        reqs[req_id].status = RequestStatus.RUNNING
        order.add(reqs[req_id])
    return order, reqs


def ids(requests: Iterable[Request | None]) -> list[str]:
    return [r.request_id if r is not None else "-" for r in requests]


# --- ClientQueues ----------------------------------------------------------------


def test_next_is_the_head_of_the_client_with_the_fewest_running_requests() -> None:
    queues = ClientQueues()
    for req_id in ("a1", "a2", "b1"):
        queues.add(client_request(req_id))
    counts = {"a": 0, "b": 3}
    assert ids([queues.next(counts.__getitem__)]) == ["a1"]
    counts = {"a": 2, "b": 1}
    assert ids([queues.next(counts.__getitem__)]) == ["b1"]


def test_equal_clients_take_turns_and_a_client_without_a_turn_goes_first() -> None:
    queues = ClientQueues()
    for req_id in ("a1", "a2", "b1", "b2"):
        queues.add(client_request(req_id))
    taken = []
    for _ in range(3):
        req = queues.next(lambda _: 0)
        assert req is not None
        queues.take(req)
        taken.append(req.request_id)
    assert taken == ["a1", "b1", "a2"]
    queues.add(client_request("c1"))  # queued last, but has had no turn yet
    assert ids([queues.next(lambda _: 0)]) == ["c1"]
    queues.check_invariants()


def test_a_preempted_request_resumes_before_its_clients_newer_ones() -> None:
    queues = ClientQueues()
    queues.add(client_request("a2"))
    queues.push_front(client_request("a1"))
    assert ids(queues) == ["a1", "a2"] and len(queues) == 2
    queues.check_invariants()


def test_take_refuses_a_request_that_is_not_at_the_head() -> None:
    queues = ClientQueues()
    queues.add(client_request("a1"))
    second = client_request("a2")
    queues.add(second)
    with pytest.raises(ValueError, match="head"):
        queues.take(second)
    queues.remove(second)
    assert ids(queues) == ["a1"]
    queues.check_invariants()


def test_queue_invariants_catch_a_request_that_is_not_waiting() -> None:
    queues = ClientQueues()
    req = client_request("a1")
    queues.add(req)
    req.status = RequestStatus.RUNNING
    with pytest.raises(RuntimeError, match="not WAITING"):
        queues.check_invariants()


# --- RunningOrder ------------------------------------------------------------------


def test_running_order_interleaves_clients_by_rank() -> None:
    order, _ = running("a1", "a2", "a3", "b1", "b2", "c1")
    assert ids(order) == ["a1", "b1", "c1", "a2", "b2", "a3"]
    order.check_invariants()


def test_pop_takes_the_newest_request_of_a_client_holding_the_most() -> None:
    order, _ = running("a1", "b1", "b2", "a2", "b3")
    assert order.pop().request_id == "b3"  # b holds the most
    assert order.pop().request_id == "a2"  # a and b hold two each: the later admitted of their rank 1
    assert (order.num_running("a"), order.num_running("b")) == (1, 2)
    order.check_invariants()


def test_removing_a_clients_oldest_moves_its_others_up_a_rank() -> None:
    order, reqs = running("a1", "a2", "b1", "b2")
    assert ids(order) == ["a1", "b1", "a2", "b2"]
    order.remove([reqs["a1"]])
    assert ids(order) == ["a2", "b1", "b2"]  # a2 is now a's oldest, and was admitted before b1
    order.check_invariants()


def test_a_newcomer_outranks_only_requests_of_a_higher_rank_than_its_own() -> None:
    order, reqs = running("a1", "a2", "a3", "b1")
    newcomer = client_request("b2")  # b holds 1: it would have rank 1
    assert [order.outranks(newcomer, reqs[r]) for r in ("a1", "a2", "a3", "b1")] == [False, False, True, False]


def test_num_to_preempt_for_counts_the_fewest_outranked_requests_that_make_room() -> None:
    order, _ = running("a1", "a2", "a3", "a4")
    newcomer = client_request("b1")

    def blocks(_: Request) -> int:
        return 2

    assert order.num_to_preempt_for(newcomer, num_seqs=1, num_blocks=0, blocks_of=blocks) == 1
    assert order.num_to_preempt_for(newcomer, num_seqs=0, num_blocks=5, blocks_of=blocks) == 3
    assert order.num_to_preempt_for(newcomer, num_seqs=0, num_blocks=7, blocks_of=blocks) is None  # a1 has rank 0
    assert order.num_to_preempt_for(newcomer, num_seqs=0, num_blocks=0, blocks_of=blocks) == 0
