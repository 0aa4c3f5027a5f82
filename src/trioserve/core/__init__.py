"""The engine core's bookkeeping: requests, KV blocks, scheduling.

Plain synchronous Python: no trio, no torch, no I/O.
"""
