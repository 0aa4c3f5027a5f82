"""The engine core's side of several API servers (``nurseries/engine_core/api_servers.py``),
in this process over real ``ipc://`` sockets: the requests of an API server
that is gone are aborted, and nobody else's."""

from __future__ import annotations

import msgspec
import pytest
import trio
import zmq

from trioserve import SamplingParams
from trioserve.messages import (
    AbortRequests,
    AddRequest,
    Attach,
    Attached,
    EngineInfo,
    EngineRequest,
    EngineResponse,
    FrontEndsInit,
    ModelInfo,
)
from trioserve.nurseries.engine_core.api_servers import ApiServers
from trioserve.nurseries.engine_core.sockets import input_socket_actor
from trioserve.transport.zmq_trio import TrioZmqSocket, private_ipc_dir

INFO = EngineInfo(ModelInfo(259, 64, [2]), 64, 4, 64, 1, [2])
PARAMS = SamplingParams(max_tokens=4)
encode = msgspec.msgpack.Encoder().encode
decode = msgspec.msgpack.Decoder(EngineResponse).decode


class ApiServerLife:
    """One life of API server ``frontend`` (process ``pid``): its PUSH and DEALER."""

    def __init__(self, bound: FrontEndsInit, frontend: int, pid: int, life: int) -> None:
        self.attach = Attach(frontend=frontend, engine=0, pid=pid, life=life)
        self.frontend = frontend
        self.push = TrioZmqSocket.connect(zmq.PUSH, bound.input_address, linger=0)
        self.dealer = TrioZmqSocket.connect(zmq.DEALER, bound.output_address, linger=0)

    async def attached(self) -> None:
        await self.dealer.send(encode(self.attach))
        while not isinstance(decode(await self.dealer.recv()), Attached):
            pass

    async def add(self, request_id: str) -> None:
        msg = AddRequest(request_id, [5, 6], PARAMS, frontend=self.frontend)
        await self.push.send(encode(msg))

    def close(self) -> None:
        self.push.close()
        self.dealer.close()


async def next_message(inbox: trio.MemoryReceiveChannel[EngineRequest]) -> EngineRequest:
    with trio.fail_after(5):
        return await inbox.receive()


@pytest.fixture
async def engine_side(nursery):
    """ApiServers running for engine 0 in a private directory, and the step loop's inbox."""
    with private_ipc_dir("trioserve-test-") as directory:
        api = ApiServers(0)
        inbox_send, inbox_receive = trio.open_memory_channel[EngineRequest](64)
        init = FrontEndsInit(f"ipc://{directory}/in", f"ipc://{directory}/out")
        bound = await nursery.start(api.run, init, INFO, inbox_send)
        yield api, bound, inbox_receive
        nursery.cancel_scope.cancel()


async def test_a_new_life_of_an_api_server_aborts_what_its_earlier_life_sent_and_nothing_else(engine_side):
    _, bound, inbox = engine_side
    with trio.fail_after(10):
        first, other = ApiServerLife(bound, 0, 100, life=1), ApiServerLife(bound, 1, 200, life=7)
        try:
            await first.attached()
            await other.attached()
            for request_id in ("a", "b"):
                await first.add(request_id)
                assert (await next_message(inbox)).request_id == request_id  # type: ignore[union-attr]
            await other.add("c")
            assert (await next_message(inbox)).request_id == "c"  # type: ignore[union-attr]
            await first.attached()  # the same life saying Attach again (a retry): nothing aborted
            await other.attached()
            # A new life of API server 0 (its process restarted): its requests are orphans.
            second = ApiServerLife(bound, 0, 101, life=2)
            try:
                await second.attached()
                aborted = await next_message(inbox)
                assert isinstance(aborted, AbortRequests) and sorted(aborted.request_ids) == ["a", "b"]
                await second.add("d")
                assert (await next_message(inbox)).request_id == "d"  # type: ignore[union-attr]
            finally:
                second.close()
            assert inbox.statistics().current_buffer_used == 0  # API server 1's request untouched
        finally:
            first.close()
            other.close()


async def test_the_supervisors_abort_of_a_dead_api_server_names_that_processs_requests_only(engine_side, nursery):
    api, bound, inbox = engine_side
    with trio.fail_after(10), private_ipc_dir("trioserve-test-") as directory:
        # The supervising process's own connection, with the ApiServers' note as the engine core has it.
        supervisor_address = f"ipc://{directory}/supervisor"
        supervisor_inbox_send, supervisor_inbox = trio.open_memory_channel[EngineRequest](64)
        with TrioZmqSocket.connect(zmq.PUSH, supervisor_address, linger=0) as supervisor:
            await nursery.start(input_socket_actor, supervisor_address, supervisor_inbox_send, None, True, api.note)
            dead, restarted = ApiServerLife(bound, 0, 100, life=1), ApiServerLife(bound, 0, 101, life=2)
            survivor = ApiServerLife(bound, 1, 200, life=3)
            try:
                await dead.attached()
                await survivor.attached()
                await dead.add("a")
                await survivor.add("s")
                for _ in range(2):
                    await next_message(inbox)
                await supervisor.send(encode(AbortRequests(request_ids=[], frontend=0, frontend_pid=100)))
                aborted = await next_message(supervisor_inbox)
                assert isinstance(aborted, AbortRequests) and aborted.request_ids == ["a"]
                # Said again (or late, after the restarted process sent its own): nothing of another process.
                await restarted.attached()
                await restarted.add("r")
                assert (await next_message(inbox)).request_id == "r"  # type: ignore[union-attr]
                await supervisor.send(encode(AbortRequests(request_ids=[], frontend=0, frontend_pid=100)))
                again = await next_message(supervisor_inbox)
                assert isinstance(again, AbortRequests) and again.request_ids == []
                await supervisor.send(encode(AbortRequests(request_ids=[], frontend=0, frontend_pid=101)))
                restarted_dead = await next_message(supervisor_inbox)
                assert isinstance(restarted_dead, AbortRequests) and restarted_dead.request_ids == ["r"]
            finally:
                for life in (dead, restarted, survivor):
                    life.close()
