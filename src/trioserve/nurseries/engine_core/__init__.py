"""The engine-core actor: one process that owns the scheduler and KV cache, steps the model through its workers,
and talks to the front-end (and to API servers) over ZeroMQ. ``launch.py`` is the contract between it and whoever
starts it; the front-end imports nothing else of this package."""
