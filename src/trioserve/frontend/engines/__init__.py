"""The front-end's engine actors: the client of one engine core, its supervisor, the data-parallel group and its
coordinator, engines on other hosts (remote) and the engine client of an API-server process (attached)."""
