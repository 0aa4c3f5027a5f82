"""An engine core's handshake with its client, and the start-up error that names how far it got.

The engine core says ``Hello`` (with its engine index) on the handshake
socket; the client answers ``HandshakeInit`` (the config, where to connect
its input and output sockets, its place among data-parallel engines, where
to listen for API servers). The engine core then loads its workers, sending
heartbeats meanwhile, and answers ``Ready`` (its ``EngineInfo``) or
``StartupFailed`` (the stage and process that failed). A local engine core
(``local.py``) and one that joins from another host (``remote.py``) both
go through it; an API server of several attaches instead (``attached.py``).

Bounds: ``startup_timeout_s`` for the ``Hello``; ``heartbeat_timeout_s`` of
silence while the workers load (then the engine core is declared hung);
``model_load_timeout_s + startup_timeout_s`` in all for the answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec
import trio

from trioserve.errors import EngineStartupError, StartupStage
from trioserve.frontend.engines.client import EngineCoreClient
from trioserve.messages import EngineInfo, HandshakeInit, HandshakeMessage, Heartbeat, Hello, Ready, StartupFailed
from trioserve.nurseries.supervision.process import ProcessExited
from trioserve.transport.silence import Silence

_encode = msgspec.msgpack.Encoder().encode
_decode: Callable[[bytes], HandshakeMessage] = msgspec.msgpack.Decoder(HandshakeMessage).decode


class HandshakeSocket(Protocol):
    """What the handshake needs of its socket: a ROUTER's frames (identity, message)."""

    async def recv_multipart(self) -> list[bytes]: ...

    async def send_multipart(self, frames: Sequence[bytes]) -> None: ...


class Handshake:
    """One life's handshake (see the module docstring). ``own_process``: the
    engine core is this process's child, whose exit after a ``StartupFailed``
    arrives as ``ProcessExited`` (it is waited for, up to the shutdown grace,
    so that the error names its exit)."""

    def __init__(self, client: EngineCoreClient, *, own_process: bool) -> None:
        self.client = client
        self.own_process = own_process
        self.stage: StartupStage = "spawn"  # how far the start got
        self.failed: StartupFailed | None = None  # what the engine core reported, if it did

    async def run(self, sock: HandshakeSocket, input_address: str, output_address: str) -> EngineInfo:
        """The handshake on ``sock``, telling the engine core to connect to
        ``input_address`` and ``output_address``; its info once ready.
        Raises ``EngineStartupError`` naming the stage. If cancelled, the
        engine core is left to its own deadline (its process, if local, is
        stopped by its supervision)."""
        client, config = self.client, self.client.config
        self.stage = "handshake"
        with trio.move_on_after(config.startup_timeout_s) as waited:
            identity, raw = await sock.recv_multipart()
            hello = _decode(raw)
            if not isinstance(hello, Hello) or hello.engine_index != client.engine_index:
                raise EngineStartupError(
                    f"unexpected handshake message {hello!r}", stage="handshake", process=client.name
                )
            init = HandshakeInit(
                data_parallel=client.data_parallel,
                frontends=client.frontends,
                config=config,
                input_address=input_address,
                output_address=output_address,
            )
            client.handshake_init = init
            await sock.send_multipart([identity, _encode(init)])
        if waited.cancelled_caught:
            raise EngineStartupError(
                f"{client.name} did not say hello within startup_timeout_s={config.startup_timeout_s}s",
                stage="handshake",
                process=client.name,
            )
        self.stage = "model-load"
        reply = await self._wait_ready(sock)
        if isinstance(reply, StartupFailed):
            self.failed = reply
            self.stage = reply.stage
            if self.own_process:  # its exit arrives as ProcessExited
                with trio.move_on_after(config.shutdown_grace_s):
                    await trio.sleep_forever()
            raise self.error(None)
        if not isinstance(reply, Ready):
            raise EngineStartupError(f"unexpected handshake message {reply!r}", stage="handshake", process=client.name)
        client.frontends_bound = reply.frontends
        return reply.info

    async def _wait_ready(self, sock: HandshakeSocket) -> HandshakeMessage:
        """The engine core's answer once its workers are loaded (``Ready`` or
        ``StartupFailed``), reading past its heartbeats. An engine core that
        sends nothing for ``heartbeat_timeout_s`` is declared hung; the
        overall bound (the engine core's own deadline for its workers comes
        first, with a more precise error) guards against one that beats but
        never answers."""
        client, config = self.client, self.client.config
        deadline = trio.current_time() + config.model_load_timeout_s + config.startup_timeout_s
        silence = Silence()
        with trio.move_on_at(deadline):
            async with silence.watched(config.heartbeat_timeout_s):
                while True:
                    _, raw = await sock.recv_multipart()
                    silence.heard()
                    reply = _decode(raw)
                    if not isinstance(reply, Heartbeat):
                        return reply
        client.declare_hung()
        hung = f"sent nothing for {config.heartbeat_timeout_s}s: hung (stopped, or stuck), killed"
        slow = "was not ready within model_load_timeout_s + startup_timeout_s"
        raise EngineStartupError(
            f"{client.name} {hung if silence.expired else slow}",
            stage="model-load",
            process=client.name,
        )

    def error(self, exited: ProcessExited | None) -> EngineStartupError:
        """The start failed (the engine core's process ``exited``, or it
        reported a failure): the error names the stage reached and the
        process that failed: the one the engine core reported (itself or a
        worker), else the engine core as it exited."""
        name = self.client.name
        parts = [f"{name} failed to start during {self.stage}"]
        if self.failed is not None:
            parts.append(self.failed.message)
        if exited is not None:
            parts.append(str(exited))
        process, exit_code = name, None
        if exited is not None:
            process, exit_code = exited.name, exited.exit_code
        if self.failed is not None and self.failed.process:
            process, exit_code = self.failed.process, self.failed.exit_code
        return EngineStartupError(": ".join(parts), stage=self.stage, process=process, exit_code=exit_code)
