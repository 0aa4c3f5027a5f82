"""The front-end's engine actors: the client of one engine core and the strategies by which it reaches one (a local
process, with the handshake: ``local.py``, ``handshake.py``; engines on other hosts: ``remote.py``; the engine cores of
an API-server process's supervisor: ``attached.py``), its supervisor, the data-parallel group and its coordinator."""
