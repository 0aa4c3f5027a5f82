"""The actors of the process tree and their supervision: trio, no torch. ``supervision/`` is the base every
process uses; ``engine_core/`` (with its ``executor/``), ``worker/`` and ``headless/`` are the actors, one folder
each."""
