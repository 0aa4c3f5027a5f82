"""The Ray actor an engine core runs under (``--data-parallel-backend ray``).

The front-end places each life of engine core ``i`` in a placement group of
its own and creates one ``EngineCoreActor`` there (``frontend/engines/ray_backend.py``).
Its ``run`` takes the launch as msgpack bytes (``RayLaunch``: nothing of ours
is pickled across Ray) and runs, in its own ``trio.run``, what a headless
host runs for one rank (``nurseries/headless/main.py``, without reconnecting):
it asks the head whether it may join, starts the engine core as its child
(leading a process group with its workers, watching this process through
its parent-watch pipe) and returns, naming why, when that engine core ends.
The head is reached over TCP with CURVE: the keys come in the launch and
stay in memory (the engine core gets them in its environment, which it
clears at once: ``nurseries/engine_core/launch.py``), never on disk.

So the tree on a Ray node is: Ray's worker process (this actor) -> engine
core -> workers. When Ray kills the actor (the front-end's ``ray.kill`` at
the end of a life, or Ray ending a dead driver's actors), the engine core
sees its parent gone and goes with its workers.
"""

from __future__ import annotations

import os

import msgspec

from trioserve.transport.curve import CurveKeys


class RayLaunch(msgspec.Struct, frozen=True, kw_only=True):
    """What an engine core's actor is told: which rank, where the head is, the keys."""

    engine_index: int
    address: str  # the head's data_parallel_address
    rpc_port: int
    public_key: bytes | None = None  # Z85, 40 bytes; None with insecure_tcp
    secret_key: bytes | None = None
    insecure_tcp: bool = False
    handshake_timeout_s: float = 30.0
    shutdown_grace_s: float = 5.0


encode_launch = msgspec.msgpack.Encoder().encode
decode_launch = msgspec.msgpack.Decoder(RayLaunch).decode


class EngineCoreActor:
    """One life of an engine core, in a Ray actor (see the module docstring)."""

    def pid(self) -> int:
        """This actor's process id (its engine core's parent)."""
        return os.getpid()

    def run(self, launch_bytes: bytes) -> str:
        """Run the engine core of ``launch_bytes`` until it ends; why it ended, in one line."""
        import trio

        from trioserve.errors import describe
        from trioserve.nurseries.headless.main import HeadlessConfig, run_headless
        from trioserve.stdio import configure_logging

        configure_logging("INFO", "text", f"ray-engine-{os.getpid()}")
        launch = decode_launch(launch_bytes)
        keys = None
        if launch.public_key is not None and launch.secret_key is not None:
            keys = CurveKeys(launch.public_key, launch.secret_key)
        config = HeadlessConfig(
            start_rank=launch.engine_index,
            num_engines=1,
            address=launch.address,
            rpc_port=launch.rpc_port,
            curve_keys=keys,
            insecure_tcp=launch.insecure_tcp,
            reconnect=False,
            handshake_timeout_s=launch.handshake_timeout_s,
            shutdown_grace_s=launch.shutdown_grace_s,
        )
        try:
            trio.run(run_headless, config)
        except Exception as exc:  # the engine core's end (EngineDeadError), or a failed join
            return describe(exc)
        return f"engine-core-{launch.engine_index} ended"
