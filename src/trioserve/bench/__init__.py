"""``trioserve bench``: serving benchmarks with baselines measured in the same run.

Modules: ``workload`` (requests and arrivals), ``stats`` (per-request timings
to figures), ``drivers`` (in-process engine and WebSocket clients),
``memory`` (peak RSS per process), ``report`` (table, JSON, plot),
``models`` (named benchmark models), ``baselines`` (torch, run as a
subprocess), ``cli`` (the ``bench`` subcommand). Nothing here imports torch
in the front-end process.
"""
