"""``trioserve serve`` end to end: a real tiny transformers model, the command
in a subprocess (signals, exit codes, the process tree), and the README's
commands with the example client."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio
from helpers.server import Received, collect, generate, generate_into, open_ws, serving, stream_requests
from helpers.serving import REPO, serve_argv, spawned, wait_for_url, wait_gone
from helpers.waiting import in_thread
from websockets.exceptions import ConnectionClosed

from trioserve import EngineConfig

EXAMPLE = REPO / "examples" / "stream_client.py"


# --- acceptance 1 on a real model ---------------------------------------------------


@pytest.mark.model
async def test_real_model_greedy_streams_equal_generate_on_one_and_on_16_connections(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir("llama")), dtype="float32", block_size=4, shutdown_grace_s=3.0)
    prompts = [f"Prompt {i}: the quick brown fox" + " jumps" * (i % 4) for i in range(16)]
    params = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with trio.fail_after(240):
        async with serving(config) as server:
            expected: dict[int, Any] = {}
            for i, prompt in enumerate(prompts):  # one at a time: nothing else in the batch
                await generate_into(expected, server, i, prompt, params)
            one = await in_thread(stream_requests, server.url, [(f"r{i}", p, params) for i, p in enumerate(prompts)])
            many: dict[int, dict[str, Received]] = {}

            async def connection(i: int) -> None:
                many[i] = await in_thread(stream_requests, server.url, [("only", prompts[i], params)])

            async with trio.open_nursery() as nursery:
                for i in range(16):
                    nursery.start_soon(connection, i)
    for i in range(16):
        assert one[f"r{i}"].text == expected[i].text, i
        assert one[f"r{i}"].token_ids == expected[i].token_ids, i
        assert many[i]["only"].text == expected[i].text, i
        assert one[f"r{i}"].terminal["usage"]["completion_tokens"] == 24  # type: ignore[index]


# --- the command in a subprocess ---------------------------------------------------------


def stream_until_closed(url: str, started: Any, n: int) -> tuple[dict[str, Received], int | None]:
    """Send ``n`` long requests; return each one's messages (all of them, up to
    its terminal message) and the close code that follows."""
    ids = {f"r{i}" for i in range(n)}
    with open_ws(url) as ws:
        for request_id in sorted(ids):
            ws.send(generate(request_id, f"in flight {request_id}", max_tokens=2000, ignore_eos=True))
        assert json.loads(ws.recv(timeout=30))["type"] == "delta"
        started()
        received, others = collect(ws, ids)
        assert not others, others
        with pytest.raises(ConnectionClosed) as info:
            ws.recv(timeout=10)
    return received, info.value.rcvd.code if info.value.rcvd else None


@pytest.mark.parametrize(
    ("signum", "stderr_gone"),
    [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGHUP, False), (signal.SIGINT, True)],
    ids=["SIGINT", "SIGTERM", "SIGHUP", "SIGINT-stderr-reader-gone"],
)
async def test_a_signal_with_streams_in_flight_ends_every_stream_and_exits_0(tiny_model_dir, signum, stderr_gone):
    """SIGHUP: the terminal ``serve`` ran in was closed (found: that killed it
    at once, cutting every stream short, exit 129). ``stderr_gone``: the
    reader of its standard error has ended (``serve 2>&1 | tee log``, where
    Ctrl-C ends tee too). Found: saying "shutting down" raised
    BrokenPipeError, which cut the graceful shutdown short (exit 1)."""
    grace = 1.0
    argv = serve_argv("--model", str(tiny_model_dir("llama")), "--runner", "fake", "--shutdown-grace", str(grace))
    with trio.fail_after(60), spawned(argv) as proc:
        url = await in_thread(wait_for_url, proc, 30)
        if stderr_gone:
            assert proc.stderr is not None
            proc.stderr.close()
            proc.stderr = None  # what spawned reads on its way out
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert len(tree) >= 2  # the engine core and its worker
        streaming = trio.Semaphore(0)
        results: list[tuple[dict[str, Received], int | None]] = []

        async def client() -> None:
            def started() -> None:
                trio.from_thread.run_sync(streaming.release)

            results.append(await in_thread(stream_until_closed, url, started, 4))

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(client)
            for _ in range(4):
                await streaming.acquire()
            signalled = time.monotonic()
            proc.send_signal(signum)
            exit_code = await in_thread(proc.wait, grace + 10)
        gone_after = await in_thread(wait_gone, [proc.pid, *(p.pid for p in tree)], signalled, grace + 10)
        assert exit_code == 0, proc.stderr.read() if proc.stderr else ""
        # A hang would take grace + 10 s; processes' own teardown took up to 3.1 s on a loaded 2-core machine.
        assert gone_after <= grace + 4, f"the process tree took {gone_after:.2f}s to go"
    assert len(results) == 4
    for received, close_code in results:
        assert close_code == 1001
        assert len(received) == 4
        for r in received.values():
            assert r.terminal is not None
            assert r.terminal["type"] == "done" or r.terminal["code"] == "shutdown", r.terminal


async def test_serve_started_under_nohup_serves_on_after_a_sighup(tiny_model_dir):
    """SIGHUP stops ``serve`` gracefully (its terminal closed), but not one
    started with SIGHUP ignored (``nohup``): that is what ``nohup`` asks.
    Trio's signal receiver would take the signal over; ``stop_signals``
    leaves SIGHUP out then."""
    argv = serve_argv("--model", str(tiny_model_dir("llama")), "--runner", "fake")
    argv = ["bash", "-c", 'trap "" HUP; exec "$@"', "bash", *argv]  # an ignored signal stays ignored across exec
    with trio.fail_after(60), spawned(argv) as proc:
        url = await in_thread(wait_for_url, proc, 30)
        proc.send_signal(signal.SIGHUP)
        await trio.sleep(0.5)  # time for the SIGHUP to act: it must not
        assert proc.poll() is None
        health = url.replace("ws://", "http://") + "/health"

        def status() -> int:
            with urllib.request.urlopen(health, timeout=10) as reply:
                return int(reply.status)

        assert await in_thread(status) == 200
        proc.send_signal(signal.SIGTERM)
        assert await in_thread(proc.wait, 20) == 0


async def test_serve_whose_stdout_reader_is_gone_serves_and_says_its_url_on_stderr(tiny_model_dir):
    """Found: ``serve | true`` (the reader of its standard output gone before
    it served) exited 1 without a word. A server's log pipe may end or
    restart; serving goes on, and the URL line goes to standard error."""
    argv = serve_argv("--model", str(tiny_model_dir("llama")), "--runner", "fake")
    with trio.fail_after(60), spawned(argv) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        proc.stdout = None  # what spawned reads on its way out

        def url_on_stderr() -> str:
            assert proc.stderr is not None
            for line in proc.stderr:
                if line.startswith("trioserve: serving on "):
                    return line.split()[3]
            raise AssertionError(f"exited with {proc.wait()} before serving")

        url = await in_thread(url_on_stderr)
        with open_ws(url) as ws:
            ws.send(generate("a", "hi", max_tokens=3))
            assert collect(ws, {"a"})[0]["a"].terminal["type"] == "done"  # type: ignore[index]
        proc.send_signal(signal.SIGTERM)
        assert await in_thread(proc.wait, 30) == 0


def readme_block(containing: str) -> str:
    """The README's first ``bash`` block that holds ``containing``."""
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    return next(block for block in blocks if containing in block)


async def test_the_readme_commands_serve_the_default_model_which_knows_the_capital_of_france(tmp_path):
    # A fresh machine: no model yet. Our C++ kernels are built where every
    # other test finds them (they would be built in the new cache otherwise,
    # unless a test before this one in this process set the variable).
    from trioserve.gpu.compiled import inductor_cache_dir

    kernels = str(inductor_cache_dir())
    env = {**os.environ, "TRIOSERVE_CACHE_DIR": str(tmp_path / "cache"), "TORCHINDUCTOR_CACHE_DIR": kernels}
    script = Path(sys.executable).parent / "trioserve"
    argv = [str(script), "serve", "--port", "0"] if script.exists() else serve_argv()
    assert "trioserve serve" in readme_block("scripts/setup.sh")
    curl = readme_block("/v1/chat/completions")
    assert shutil.which("curl") and "What is the capital of France?" in curl
    with trio.fail_after(600), spawned(argv, env) as proc:
        url = await in_thread(wait_for_url, proc, 540)  # the first start converts the model
        port = url.rsplit(":", 1)[1]
        answer = await trio.run_process(
            ["bash", "-c", curl.replace("127.0.0.1:8000", f"127.0.0.1:{port}")], capture_stdout=True, check=True
        )
        content = json.loads(answer.stdout)["choices"][0]["message"]["content"]
        assert "Paris" in content, content
        client = await trio.run_process(
            [sys.executable, str(EXAMPLE), "--url", url, "Once upon a time"],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        assert client.returncode == 0, client.stderr.decode()
        assert "finish reason: " in client.stderr.decode()
        assert client.stdout
        proc.send_signal(signal.SIGTERM)
        assert await in_thread(proc.wait, 30) == 0
        assert proc.stderr is not None
        assert "it/s]" not in proc.stderr.read()  # (found: the converter's progress bars, 14 lines of them)
    # Nothing half-built is left beside the model.
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["SmolLM2-135M-Instruct-f32-v1"]
    # The same model named as vLLM's users name one: its .gguf file, given as MODEL (the converted one serves).
    from trioserve.default_model import gguf_path

    with trio.fail_after(120), spawned([*argv, str(gguf_path()), "--runner", "fake"], env) as proc:
        url = await in_thread(wait_for_url, proc, 90)
        port = int(url.rsplit(":", 1)[1])
        models = await in_thread(
            lambda: json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models").read())
        )
        assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct.Q4_1"]
        proc.send_signal(signal.SIGTERM)
        assert await in_thread(proc.wait, 30) == 0
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["SmolLM2-135M-Instruct-f32-v1"]
