"""The front-end's memory under a flood of the largest requests it allows (issue 36, item 5).

    PYTHONPATH=src python scripts/bench_held_memory.py [--clients 16] [--rounds 2]

Starts ``trioserve serve`` on the fake runner (no model: tokens cost nothing, so the front-end is what is
measured; it makes up the logprob alternatives a request asks for) over a tiny model's tokenizer and its
2,048-token context, and sends ``--clients`` concurrent non-streamed completions, each as large as
``--max-request-entries`` lets one be: 24 samples of the whole context with 20 logprob alternatives a token
(24 x 2,043 x 21 = 1,029,672 entries, of 1,048,576), ``--rounds`` times over. Polls the serving process's RSS
(it is the front-end, with one API server) every 20 ms, and prints its peak over its idle RSS, with the
answers' statuses: 200, or 503 when the requests in flight already hold ``--max-held-entries`` (the default
lets eight such requests run at once). Then the same flood with the shared bound lifted
(``--max-held-entries`` = clients x one request), to show what it saves.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import psutil

from trioserve.config import EngineConfig
from trioserve.gpu.tiny_models import write_tiny_model

REQUEST = {"model": "m", "prompt": "hello", "n": 24, "max_tokens": 4096, "ignore_eos": True, "logprobs": 20}
MIB = 1024 * 1024


def post(port: int, body: dict) -> int:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as answer:
            answer.read()
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        exc.read()
        return int(exc.code)


def flood(model_dir: str, clients: int, rounds: int, held_entries: int) -> dict:
    argv = [sys.executable, "-m", "trioserve.cli", "serve", "--port", "0", "--model", model_dir, "--runner", "fake"]
    argv += ["--served-model-name", "m", "--max-held-entries", str(held_entries), "--disable-log-requests"]
    argv += ["--fake-options", json.dumps({"logprobs": True})]  # made-up alternatives, as many as asked for
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = ""
        while not line.startswith("trioserve: serving on "):
            line = proc.stdout.readline()
            if not line:
                raise SystemExit(f"serve exited with {proc.wait()}")
        port = int(line.split()[3].rsplit(":", 1)[1])
        server = psutil.Process(proc.pid)
        time.sleep(1.0)
        idle = server.memory_info().rss
        peak = idle
        done = threading.Event()

        def watch() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, server.memory_info().rss)
                time.sleep(0.02)

        watcher = threading.Thread(target=watch)
        watcher.start()
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            statuses = collections.Counter(pool.map(lambda _: post(port, REQUEST), range(clients * rounds)))
        done.set()
        watcher.join()
        return {
            "max_held_entries": held_entries,
            "idle_rss_mib": idle / MIB,
            "peak_rss_mib": peak / MIB,
            "growth_mib": (peak - idle) / MIB,
            "statuses": dict(statuses),
            "seconds": time.monotonic() - started,
        }
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    defaults = EngineConfig(model=".")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_tiny_model(tmp, "llama"))
        for held in (defaults.max_held_entries, args.clients * defaults.max_request_entries):
            result = flood(model_dir, args.clients, args.rounds, held)
            print(json.dumps(result))


if __name__ == "__main__":
    main()
