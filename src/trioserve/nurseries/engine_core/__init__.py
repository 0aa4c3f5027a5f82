"""The engine-core actor: one process that owns the scheduler and KV cache, steps the model through its workers,
and talks to the front-end (and to API servers) over ZeroMQ. ``launch.py`` is the contract between it and whoever
starts it; the front-end imports nothing else of this package.

``main.py`` is the process's main (its task tree is there); ``startup.py`` its handshake with the front-end;
``step_loop.py`` the step loop (``EngineCore``); ``control.py`` the control calls; ``sockets.py`` the front-end's
socket actors and ``api_servers.py`` the API servers'; ``liveness.py`` its heartbeats and its watch on a front-end
on another host; ``death.py`` the death report; ``executor/`` its side of the workers."""
