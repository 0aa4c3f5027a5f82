"""The executor: the engine core's side of its workers (their processes, streams, heartbeats and steps)."""
