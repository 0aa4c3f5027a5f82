"""The load picture: which engine gets the next request (frontend/engines/coordinator.py)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trioserve.frontend.engines.coordinator import Coordinator, LoadPicture
from trioserve.messages import LoadReport


def test_equal_engines_take_turns():
    picture = LoadPicture(3, max_running=8)
    assert [picture.choose([0, 1, 2]) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_with_one_front_end_its_own_count_decides_not_a_stale_report():
    picture = LoadPicture(2, max_running=4)
    picture.report(0, LoadReport(num_waiting=0, num_running=4))  # stale: three have finished since
    picture.report(1, LoadReport(num_waiting=0, num_running=0))
    assert picture.choose([0, 1], in_flight=[1, 3]) == 0  # engine 0 holds one request now, engine 1 three


def test_a_request_that_would_wait_costs_four_running_ones():
    picture = LoadPicture(2, max_running=4)
    # At its cap of 4 running, one more request would wait: it counts four times.
    assert picture.score(0, in_flight=4) == 4
    assert picture.score(0, in_flight=5) == 4 + 4 * 1
    assert picture.choose([0, 1], in_flight=[4, 7]) == 0  # 4 + 4*0 = 4 vs 4 + 4*3 = 16


def test_engines_waiting_for_kv_blocks_count_as_waiting_even_below_the_sequence_cap():
    picture = LoadPicture(2, max_running=32)
    picture.report(0, LoadReport(num_waiting=2, num_running=2))  # its blocks are full
    assert picture.score(0, in_flight=4) == 4 * 2 + 2
    assert picture.choose([0, 1], in_flight=[4, 6]) == 1


def test_with_several_front_ends_the_reports_count_what_the_others_sent():
    picture = LoadPicture(2, max_running=8, shared=True)
    picture.report(0, LoadReport(num_waiting=0, num_running=6))  # 6 from other front-ends
    assert picture.choose([0, 1], in_flight=[0, 2]) == 1
    assert picture.choose([0, 1], in_flight=[0, 3]) == 1  # 3 (+1 sent since) vs 6
    picture.report(1, LoadReport(num_waiting=0, num_running=7))
    assert picture.choose([0, 1], in_flight=[0, 3]) == 0


def test_only_candidates_are_chosen_and_a_restart_forgets_the_load():
    picture = LoadPicture(3, max_running=8, shared=True)
    picture.report(1, LoadReport(num_waiting=9, num_running=8))
    assert picture.choose([1]) == 1
    picture.forget(1)
    assert picture.score(1) == 0
    with pytest.raises(ValueError, match="at least one candidate"):
        picture.choose([])


async def test_the_coordinator_applies_reports_in_order_and_drops_none_while_it_keeps_up():
    coordinator = Coordinator(2, max_running=8)
    async with trio.open_nursery() as nursery:
        await nursery.start(coordinator.run)
        coordinator.report_nowait(0, LoadReport(num_waiting=1, num_running=8))
        coordinator.report_nowait(0, LoadReport(num_waiting=0, num_running=2))
        coordinator.report_nowait(1, None)
        await trio.testing.wait_all_tasks_blocked()
        assert coordinator.picture.score(0, in_flight=2) == 2 and coordinator.num_dropped == 0
        nursery.cancel_scope.cancel()


def test_a_grown_picture_starts_new_engines_from_no_load_and_a_shrunk_one_forgets_the_removed():
    picture = LoadPicture(2, max_running=8, shared=True)
    picture.report(0, LoadReport(num_waiting=0, num_running=3))
    picture.report(1, LoadReport(num_waiting=0, num_running=5))
    assert picture.choose([0, 1]) == 0
    picture.resize(3)
    assert (picture.num_engines, picture.score(2)) == (3, 0)
    assert picture.choose([0, 1, 2]) == 2  # the new engine, with no load, first
    picture.resize(1)
    assert picture.num_engines == 1 and picture.choose([0]) == 0
    picture.resize(2)
    assert picture.score(1) == 0  # engine 1 again: its old load is not its
