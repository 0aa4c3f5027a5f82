"""The ordered outbox (``transport/outbox.py``) and the front-end's queue to
its engine core built on it: an abort never reaches the engine core ahead
of the request it aborts, however full the queue is."""

from __future__ import annotations

import msgspec
import trio
import trio.lowlevel
import trio.testing
from helpers.fakes import make_fake_config

from trioserve.frontend.engines.client import TO_ENGINE_SIZE, EngineCoreClient
from trioserve.frontend.engines.local import LocalProcessStrategy
from trioserve.messages import AbortRequests, AddRequest, EngineInfo, EngineRequest, ModelInfo
from trioserve.sampling_params import SamplingParams
from trioserve.transport.outbox import Outbox


async def test_messages_come_out_in_the_order_they_went_in_past_the_capacity_too() -> None:
    box: Outbox[int] = Outbox(2)
    await box.put(1)
    box.put_nowait(2)
    box.put_nowait(3)  # past the capacity: never waits
    assert len(box) == 3
    assert [await box.get() for _ in range(3)] == [1, 2, 3]


async def test_put_waits_while_full_and_a_cancelled_put_queues_nothing(autojump_clock: trio.abc.Clock) -> None:
    box: Outbox[str] = Outbox(1)
    await box.put("first")
    with trio.move_on_after(5) as waited:
        await box.put("never")  # full: waits until cancelled
    assert waited.cancelled_caught and len(box) == 1
    box.put_nowait("abort")
    put_at: list[float] = []

    async def put_later() -> None:
        await box.put("second")
        put_at.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(put_later)
        await trio.sleep(3)
        assert not put_at  # two queued, the capacity is one
        assert await box.get() == "first"
        await trio.sleep(1)
        assert not put_at  # still one queued ("abort")
        assert await box.get() == "abort"
    assert put_at == [9.0]  # 5 s cancelled, 3 + 1 s waiting: it went in when the queue emptied
    assert await box.get() == "second"
    with trio.move_on_after(1):
        await box.get()  # empty: waits
        raise AssertionError("got a message from an empty outbox")


class Recording:
    """The input socket: keeps what the front-end sends its engine core."""

    def __init__(self) -> None:
        self.sent: list[EngineRequest] = []
        self._decode = msgspec.msgpack.Decoder(EngineRequest).decode

    async def send(self, payload: bytes) -> None:
        self.sent.append(self._decode(payload))
        await trio.lowlevel.checkpoint()

    def __enter__(self) -> Recording:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class Submitted:
    """What ``EngineCoreClient.submit`` asks of a request's state."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.client: object = None  # the client it was sent through, once sent
        self.aborted = False  # its consumer left it

    def add_request(self, wave: int = 0) -> AddRequest:
        return AddRequest(request_id=self.request_id, prompt_token_ids=[5, 6], params=SamplingParams(max_tokens=8))


async def test_an_abort_while_the_queue_is_full_goes_after_the_request_it_aborts(tiny_model_dir) -> None:
    """An engine core that lags lets the queue fill; a client leaves while its
    request is still queued. The abort must follow the request's AddRequest
    (the engine core ignores an abort of a request it does not know, and the
    request would then run to its end with nobody to read it)."""
    config = make_fake_config(str(tiny_model_dir("llama")), max_waiting_requests=2 * TO_ENGINE_SIZE)
    client = EngineCoreClient(config, 0, LocalProcessStrategy())
    client.info = EngineInfo(ModelInfo(259, 64, [2]), 64, 4, 64, 1, [2])  # as if started
    with trio.fail_after(10):
        for i in range(TO_ENGINE_SIZE):
            await client.submit(Submitted(f"r{i}"))
        client.abort("r1")  # r1's client leaves: the queue is full
        client.abort("r1000")
        socket = Recording()

        def sent() -> tuple[dict[str, int], dict[str, int]]:
            adds = {m.request_id: i for i, m in enumerate(socket.sent) if isinstance(m, AddRequest)}
            aborts = {r: i for i, m in enumerate(socket.sent) if isinstance(m, AbortRequests) for r in m.request_ids}
            return adds, aborts

        async with trio.open_nursery() as nursery:  # the sender runs until everything queued is sent (a loaded host)
            nursery.start_soon(client._input_sender, socket)
            while len(sent()[0]) < TO_ENGINE_SIZE or len(sent()[1]) < 2:
                await trio.sleep(0.01)
            await trio.sleep(0.1)  # nothing more comes
            nursery.cancel_scope.cancel()
    adds, aborts = sent()
    assert len(adds) == TO_ENGINE_SIZE and set(aborts) == {"r1", "r1000"}
    assert aborts["r1"] > adds["r1"] and aborts["r1000"] > adds["r1000"], "an abort went ahead of its request"
    assert "r1" not in client.requests and "r1000" not in client.requests
