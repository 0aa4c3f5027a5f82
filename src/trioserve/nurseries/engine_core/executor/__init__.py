"""The executor: the engine core's side of its workers. ``executor.py`` (``Executor``) is what the engine core
asks of them: start-up, steps, control calls, and when a hang is suspected; it has a ``group.py``
(``WorkerGroup``): the worker processes, spawned and supervised as one group, messages to and from all of them,
and their failures, each named; ``handles.py`` is one worker as the group sees it (``WorkerHandle``) and the
errors a worker fails with. The worker process itself is ``nurseries/worker/``."""
