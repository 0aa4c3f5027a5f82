"""The engine-core process's main: the launch contract read back, the handshake, then serve until a failure or a
stop.

Task tree (one ``trio.run``, under ``run_child_main``'s parent watch)::

    engine_core_main
    ├── output socket         outbox (bounded memory channel) -> ZMQ PUSH to the front-end (with API
    │                         servers, each one's share first, through the ROUTER below); outlives the
    │                         rest, so that a death report goes out (sockets.py)
    ├── API-server sockets    with HandshakeInit.frontends: a PULL (-> inbox) and a ROUTER that every API
    │                         server connects to, bound here (over TCP with the ZAP handler); beside the
    │                         output socket, so that a death report reaches them (api_servers.py)
    └── _serve
        ├── executor          Executor.run: worker processes, each supervised (worker monitor), each a
        │                     framed stream (MessageBridge), and the workers' heartbeat watch (executor/)
        ├── front-end watch   over TCP only: FrontEndWatch, the front-end gone silent or leaving (liveness.py)
        ├── input socket      ZMQ PULL -> inbox (bounded memory channel) (sockets.py)
        ├── heartbeats        a Heartbeat every heartbeat_interval_s: suspected hang, load, state
        │                     (liveness.py)
        └── step loop         apply inbox -> control calls that can run (control.py) -> schedule and send
                              step N+1 -> step N-1's outputs to the outbox -> wait for step N ->
                              postprocess (step_loop.py)

While the workers load, ``start_executor`` runs heartbeats on the handshake
socket instead (and, with a front-end on another host, listens there for its
word that it stops) (``startup.py``).

The step loop never awaits a client: it only waits on its inbox (when idle),
the executor, and the outbox. Start-up (``startup.py``): connect to the
front-end's handshake socket, send ``Hello``, receive ``HandshakeInit``,
start the workers, bind the API servers' sockets if there are any, reply
``Ready`` (or ``StartupFailed`` naming the stage, the process and its exit
code).

Any failure after that (a worker that exits, raises, or does not finish a
step within ``step_timeout_s``) is reported to the front-end as
``EngineDead`` with the reason the moment it is known (``death.py``), before
the workers are reaped; then the process exits 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Awaitable, Callable
from typing import Any

import trio
import zmq

from trioserve.core.scheduler import Scheduler
from trioserve.core.waves import EngineWaves
from trioserve.errors import describe, meaningful_leaves, sole_leaf
from trioserve.lora import parse_lora_module, read_adapter_config
from trioserve.messages import EngineRequest, EngineResponse, HandshakeInit
from trioserve.nurseries.engine_core.api_servers import ApiServers
from trioserve.nurseries.engine_core.death import DeathReport, flush
from trioserve.nurseries.engine_core.executor.executor import Executor
from trioserve.nurseries.engine_core.launch import CURVE_KEY_PAIR_ENV, EngineCoreLaunch, ipc_directory
from trioserve.nurseries.engine_core.liveness import FrontEndWatch, heartbeats
from trioserve.nurseries.engine_core.sockets import input_socket_actor, output_socket_actor
from trioserve.nurseries.engine_core.startup import handshake, listen_for_api_servers, ready, start_executor
from trioserve.nurseries.engine_core.step_loop import EngineCore
from trioserve.nurseries.supervision.child_main import ChildExit, ChildFailed, remove_if_parent_dies
from trioserve.pooling import step_budget
from trioserve.transport.zmq_trio import TrioZmqSocket

INBOX_SIZE = 1024  # requests and aborts waiting for the step loop
OUTBOX_SIZE = 64  # output batches waiting for the output socket


async def engine_core_main() -> None:
    launch = EngineCoreLaunch.from_env()
    os.environ.pop(CURVE_KEY_PAIR_ENV, None)  # read: no child of this process is to inherit the secret
    engine_index, handshake_address = launch.engine_index, launch.handshake_address
    if (front_end_dir := ipc_directory(handshake_address)) is not None:
        # The front-end's private directory: if the front-end dies (kill -9), nobody else removes it.
        remove_if_parent_dies(front_end_dir)
    if launch.private_dir is not None:  # the headless process's, likewise
        remove_if_parent_dies(launch.private_dir)
    if launch.api_servers_dir is not None:
        # The API servers' directory, the supervising process's: after its kill -9 before any API server
        # runs (the engines start first), nobody else removes it. Taken before the handshake, which a
        # kill -9 may come before.
        remove_if_parent_dies(launch.api_servers_dir)
    options = launch.socket_options(handshake_address)
    handshake_sock = TrioZmqSocket.connect(zmq.DEALER, handshake_address, linger=1000, **options)
    with handshake_sock:
        init = await handshake(handshake_sock, engine_index, launch.handshake_timeout_s)
        if launch.private_dir is not None and init.config.tensor_parallel_size == 1:
            # Nothing goes there (no ranks to meet): gone now, a kill -9 of the whole tree cannot leave it.
            with contextlib.suppress(OSError):
                os.rmdir(launch.private_dir)
            launch = dataclasses.replace(launch, private_dir=None)
        outbox_send, outbox_receive = trio.open_memory_channel[EngineResponse](OUTBOX_SIZE)
        death = DeathReport(outbox_send)
        api_servers = ApiServers(engine_index, launch) if init.frontends is not None else None
        # A front-end on another host did not stop this engine core itself: it must hear of a stop here
        # (the headless process's, a SIGTERM) at once, not find it silent a heartbeat timeout later. So
        # there the output socket outlives a stop too, until the report is sent.
        remote = init.output_address.startswith("tcp://")
        output_shield = trio.CancelScope(shield=remote)
        async with trio.open_nursery() as outer:
            # The output socket outlives the rest, so that a failure can be reported.
            route = None if api_servers is None else api_servers.route
            output = functools.partial(output_socket_actor, options=launch.socket_options(init.output_address))
            await outer.start(
                _within, output_shield, output, init.output_address, outbox_receive, death.take_unsent, route
            )
            try:
                await _serve(init, launch, handshake_sock, outbox_send, death, (outer, api_servers))
            except BaseException as exc:  # a failure can come beside a stop's Cancelled (a BaseExceptionGroup)
                if sole_leaf(exc, ChildExit) is not None:
                    raise  # the front-end left: nobody to report to
                if not any(isinstance(leaf, Exception) for leaf in meaningful_leaves(exc)):
                    if remote:  # a stop
                        death.report(f"engine-core-{engine_index} (pid {os.getpid()}) was stopped on its host")
                        await flush(outbox_send)
                    raise  # a stop, or KeyboardInterrupt and the like: not a failure to report
                death.report(describe(exc))
                await flush(outbox_send)
                raise ChildFailed(death.reason or "failed") from exc
            finally:
                output_shield.cancel()
                outer.cancel_scope.cancel()


async def _within(
    scope: trio.CancelScope, actor: Callable[..., Awaitable[None]], *args: Any, task_status: trio.TaskStatus[None]
) -> None:
    """Run ``actor(*args)`` (started as by ``nursery.start``) inside ``scope``."""
    with scope:
        await actor(*args, task_status=task_status)


async def _serve(
    init: HandshakeInit,
    launch: EngineCoreLaunch,
    handshake_sock: TrioZmqSocket,
    outbox: trio.MemorySendChannel[EngineResponse],
    death: DeathReport,
    api_servers: tuple[trio.Nursery, ApiServers | None] | None = None,
) -> None:
    """Serve ``init``; the API servers' sockets (if any) run in the nursery
    given with them, so that a death report still reaches them."""
    config = init.config
    if init.data_parallel is not None:
        # The lockstep rendezvous directory is the front-end's, as above.
        remove_if_parent_dies(os.path.dirname(init.data_parallel.rendezvous))
    async with trio.open_nursery() as nursery:
        address = launch.handshake_address
        private_dir = ipc_directory(address) or launch.private_dir
        executor = Executor(
            config,
            on_failure=death.report,
            data_parallel=init.data_parallel,
            engine_index=launch.engine_index,
            local_engine_index=launch.local_engine_index,
            private_dir=private_dir,
        )
        info = await start_executor(nursery, executor, handshake_sock, address.startswith("tcp://"))
        scheduler = Scheduler(
            num_blocks=info.num_kv_blocks,
            block_size=info.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=step_budget(config, info.max_model_len),
            max_model_len=info.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            max_loras=config.max_loras,
        )
        for name, path in map(parse_lora_module, config.lora_modules):  # the workers loaded them
            scheduler.adapters.add(name, path, read_adapter_config(path, config.max_lora_rank).r)
        inbox_send, inbox_receive = trio.open_memory_channel[EngineRequest](INBOX_SIZE)
        watch = FrontEndWatch(config.heartbeat_timeout_s) if address.startswith("tcp://") else None
        if watch is not None:
            nursery.start_soon(watch.run)
        # The supervising process of several API servers aborts a dead one's requests, which its note names.
        note = None if api_servers is None or api_servers[1] is None else api_servers[1].note
        heard, left = (None, None) if watch is None else (watch.heard, watch.left)
        options = launch.socket_options(init.input_address)
        receive = functools.partial(input_socket_actor, options=options)
        await nursery.start(receive, init.input_address, inbox_send, heard, False, note, left)
        bound = None  # where the API servers connect
        if api_servers is not None and api_servers[1] is not None and init.frontends is not None:
            start = functools.partial(api_servers[1].run, init.frontends, info, inbox_send)
            bound = await listen_for_api_servers(api_servers[0], start, handshake_sock, launch.process)
        await ready(handshake_sock, info, bound)
        lockstep = None if init.data_parallel is None else EngineWaves(init.data_parallel.rank)
        core = EngineCore(scheduler, executor, info, lockstep)
        executor.steps_in_flight = core.steps_in_flight  # asked, to name the step a worker was running
        nursery.start_soon(heartbeats, outbox.send, executor, core)
        await core.step_loop(inbox_receive, outbox)
