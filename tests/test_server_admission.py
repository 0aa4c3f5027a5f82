"""Admission (``server/admission.py`` and its use in ``server/server.py``):
the connection cap (503 beyond it, ``/health`` still answered), the reserve
over it, the idle timeout (``server/connection.py``) and the handshake
timeout. The idle timer runs over in-memory streams with the autojump
clock; the rest runs a real server (the fake runner) on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import time
from contextlib import ExitStack
from typing import Any, cast

import pytest
import trio
import trio.testing
from helpers.fakes import SERVING
from helpers.server import collect, generate, http_get, open_ws, serving, stream_one, terminal_of
from helpers.waiting import in_thread
from trio_websocket import ConnectionClosed, wrap_client_stream, wrap_server_stream
from websockets.exceptions import ConnectionClosed as WsClosed
from websockets.exceptions import InvalidStatus

from trioserve.api import Engine
from trioserve.server import Server, ServerConfig, http
from trioserve.server.admission import OVER_CAP_SLOTS, OVER_CAP_TIMEOUT_S, RETRY_AFTER_S, Admission, Slot
from trioserve.server.connection import IDLE_CLOSE_CODE, Connection
from trioserve.server.state import ServerState

pytestmark = pytest.mark.fake_config(**SERVING)

# --- plain functions -------------------------------------------------------------------


def test_admission_serves_up_to_the_cap_then_fills_the_reserve_then_drops():
    admission = Admission(max_connections=2, over_cap_slots=1)
    assert [admission.admit() for _ in range(4)] == [Slot.SERVE, Slot.SERVE, Slot.OVER_CAP, Slot.DROP]
    assert (admission.num_served, admission.num_over_cap, admission.num_open) == (2, 1, 3)
    admission.release(Slot.DROP)
    admission.release(Slot.OVER_CAP)
    assert admission.admit() is Slot.OVER_CAP
    admission.release(Slot.SERVE)
    assert admission.admit() is Slot.SERVE
    assert admission.admit() is Slot.DROP


def test_over_the_cap_health_is_answered_as_usual_and_anything_else_gets_503_naming_the_limit():
    def head(method: str, path: str, *extra: str) -> http.RequestHead:
        return http.parse_request_head(f"{method} {path} HTTP/1.1\r\nHost: x\r\n{''.join(extra)}\r\n".encode())

    assert http.route_over_capacity(head("GET", "/health"), health="ready", max_connections=7) == http.Reply(
        200, {"status": "ready"}
    )
    assert http.route_over_capacity(head("GET", "/health"), health="restarting", max_connections=7).status == 503
    assert http.route_over_capacity(head("POST", "/health"), health="ready", max_connections=7).status == 405
    upgrade = head("GET", "/", "Upgrade: websocket\r\n", "Sec-WebSocket-Key: k\r\n", "Sec-WebSocket-Version: 13\r\n")
    for request in (upgrade, head("GET", "/")):
        reply = http.route_over_capacity(request, health="ready", max_connections=7)
        assert reply.status == 503
        assert reply.body["max_connections"] == 7 and "limit of 7" in str(reply.body["error"])
        assert reply.headers == (("Retry-After", str(RETRY_AFTER_S)),)


@pytest.mark.parametrize("field", ["max_connections", "idle_timeout_s", "handshake_timeout_s"])
def test_server_config_rejects_a_limit_that_is_not_positive_naming_the_field(field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        ServerConfig(**{field: 0})
    assert ServerConfig(idle_timeout_s=float("inf")).idle_timeout_s == float("inf")


# --- the idle timer, over in-memory streams ---------------------------------------------


async def test_an_idle_websocket_is_closed_with_4408_idle_timeout_after_its_last_message(autojump_clock):
    config = ServerConfig(idle_timeout_s=0.5)
    server_stream, client_stream = trio.testing.memory_stream_pair()
    cancel = json.dumps({"type": "cancel", "id": "nothing"})  # a message that gets no answer
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:

            async def serve() -> None:
                request = await wrap_server_stream(nursery, server_stream)
                ws = await request.accept()
                await Connection(ws, cast(Engine, object()), ServerState(), config).run()

            nursery.start_soon(serve)
            ws = await wrap_client_stream(nursery, cast(trio.SocketStream, client_stream), "test", "/")
            start = trio.current_time()
            for _ in range(3):  # each message puts the close off
                await trio.sleep(0.4)
                await ws.send_message(cancel)
            with pytest.raises(ConnectionClosed) as info:
                await ws.get_message()
            assert trio.current_time() - start == pytest.approx(1.2 + 0.5)
            assert info.value.reason.code == IDLE_CLOSE_CODE
            assert info.value.reason.reason == "idle for 0.5s"


# --- a real server --------------------------------------------------------------------------


async def test_connections_beyond_the_cap_get_503_naming_the_limit_while_existing_ones_keep_streaming(fake_config):
    with trio.fail_after(60):
        async with serving(fake_config(step_delay_s=0.01), max_connections=2) as server:
            first_deltas = trio.Semaphore(0)

            def streaming(name: str) -> dict:
                with open_ws(server.url) as ws:
                    ws.send(generate(name, name, max_tokens=150, ignore_eos=True))
                    assert json.loads(ws.recv(timeout=10))["type"] == "delta"
                    trio.from_thread.run_sync(first_deltas.release)
                    received, others = collect(ws, {name})
                    assert not others
                    return terminal_of(received[name])

            results: dict[str, dict] = {}

            async def run(name: str) -> None:
                results[name] = await in_thread(streaming, name)

            async with trio.open_nursery() as nursery:
                for name in ("a", "b"):
                    nursery.start_soon(run, name)
                for _ in range(2):
                    await first_deltas.acquire()
                with pytest.raises(InvalidStatus) as info:
                    await in_thread(open_ws, server.url)
                response = info.value.response
                assert response.status_code == 503
                assert response.headers["Retry-After"] == str(RETRY_AFTER_S)
                body = json.loads(response.body)
                assert body["max_connections"] == 2 and "limit of 2" in body["error"]["message"]
                assert server.num_connections == 2
            for name in ("a", "b"):
                assert results[name]["type"] == "done" and results[name]["usage"]["completion_tokens"] == 150
            await wait_for_connections(server, 0)
            assert await in_thread(stream_one, server.url) == "done"  # the slots came back


async def test_health_answers_200_while_the_cap_is_full_of_idle_websockets(fake_config):
    with trio.fail_after(60):
        async with serving(fake_config(), max_connections=3) as server:
            idle = ExitStack()
            try:
                for _ in range(3):
                    idle.enter_context(await in_thread(open_ws, server.url))
                with pytest.raises(InvalidStatus) as info:
                    await in_thread(open_ws, server.url)
                assert info.value.response.status_code == 503
                for _ in range(OVER_CAP_SLOTS + 8):  # more than the reserve: its slots come back
                    assert await in_thread(http_get, server.health_url) == (200, {"status": "ready"})
                assert server.num_connections == 3
            finally:
                await in_thread(idle.close)  # not on the server's thread: closing waits for its answer


async def test_over_the_cap_a_silent_client_is_dropped_after_1_s_and_beyond_the_reserve_503_comes_at_once(fake_config):
    with trio.fail_after(30):
        async with serving(fake_config(), max_connections=1) as server:

            def flood() -> tuple[bytes, float, list[tuple[bytes, float]]]:
                with open_ws(server.url), ExitStack() as sockets:
                    silent = [sockets.enter_context(connect_tcp(server)) for _ in range(OVER_CAP_SLOTS)]
                    deadline = time.monotonic() + 5
                    while server.admission.num_over_cap < OVER_CAP_SLOTS:
                        assert time.monotonic() < deadline
                        time.sleep(0.01)
                    with connect_tcp(server) as extra:  # beyond the reserve
                        start = time.monotonic()
                        answer = read_to_end(extra)
                        answered_in = time.monotonic() - start
                    return answer, answered_in, [(read_to_end(sock), time.monotonic() - start) for sock in silent]

            answer, answered_in, dropped = await in_thread(flood)
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503 ") and f"Retry-After: {RETRY_AFTER_S}".encode() in head
            assert json.loads(body)["max_connections"] == 1
            assert answered_in < 0.5
            assert all(data == b"" and after < OVER_CAP_TIMEOUT_S + 1 for data, after in dropped), dropped
            await wait_for_connections(server, 0)
            assert server.admission.num_open == 0


def connect_tcp(server: Server) -> socket.socket:
    assert server.port is not None
    return socket.create_connection(("127.0.0.1", server.port), timeout=5)


def read_to_end(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


async def test_an_idle_websocket_is_closed_with_4408_and_a_busy_one_is_not(fake_config):
    idle_s = 0.5
    with trio.fail_after(60):
        async with serving(fake_config(step_delay_s=0.01), idle_timeout_s=idle_s) as server:

            def idle_client() -> tuple[float, int, str]:
                with open_ws(server.url) as ws:
                    start = time.monotonic()
                    with pytest.raises(WsClosed) as info:
                        ws.recv(timeout=10)
                    assert info.value.rcvd is not None
                    return time.monotonic() - start, info.value.rcvd.code, info.value.rcvd.reason

            def busy_client() -> tuple[float, dict, float, int]:
                with open_ws(server.url) as ws:
                    start = time.monotonic()
                    ws.send(generate("long", "long", max_tokens=200, ignore_eos=True))  # and nothing more
                    received, _ = collect(ws, {"long"})
                    streamed = time.monotonic() - start
                    with pytest.raises(WsClosed) as info:
                        ws.recv(timeout=10)
                    assert info.value.rcvd is not None
                    closed_after = time.monotonic() - start - streamed
                    return streamed, terminal_of(received["long"]), closed_after, info.value.rcvd.code

            results: dict[str, Any] = {}

            async def run(name: str, client: Any) -> None:
                results[name] = await in_thread(client)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "idle", idle_client)
                nursery.start_soon(run, "busy", busy_client)
            waited, code, reason = results["idle"]
            assert code == IDLE_CLOSE_CODE and reason == "idle for 0.5s"
            assert idle_s * 0.8 <= waited < idle_s + 1.5  # the server's clock starts a little before the client's
            streamed, terminal, closed_after, busy_code = results["busy"]
            assert streamed > 3 * idle_s  # busy far longer than the idle timeout, without a client message
            assert terminal["type"] == "done" and terminal["usage"]["completion_tokens"] == 200
            assert busy_code == IDLE_CLOSE_CODE and closed_after < idle_s + 1.5


@pytest.mark.parametrize("sent", [b"", b"GET / HTTP/1.1\r\nHost: x\r\n"], ids=["nothing", "half a head"])
async def test_a_connection_that_never_finishes_its_head_is_dropped_after_the_handshake_timeout(fake_config, sent):
    timeout_s = 0.5
    with trio.fail_after(30):
        async with serving(fake_config(), handshake_timeout_s=timeout_s) as server:

            def half_open() -> tuple[float, bytes]:
                with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                    sock.sendall(sent)
                    start = time.monotonic()
                    try:
                        data = sock.recv(1024)
                    except ConnectionResetError:
                        data = b""
                    return time.monotonic() - start, data

            waited, data = await in_thread(half_open)
            if sent:  # a request begun and not finished in time: told so
                assert data.startswith(b"HTTP/1.1 408 ")
            else:
                assert data == b""  # closed without a word
            assert timeout_s * 0.8 <= waited < timeout_s + 1.5  # the server's clock starts at the accept
            await wait_for_connections(server, 0)


async def wait_for_connections(server: Server, n: int, timeout: float = 5) -> None:
    with trio.fail_after(timeout):
        while server.num_connections != n:
            await trio.sleep(0.02)
