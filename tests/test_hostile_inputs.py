"""What a hostile client found, each as it was reproduced, and what it gets
now: a clear error naming what was wrong, and nothing else lost. (Hangs,
orphans and kill -9 of the front-end are in test_hangs.py; connection caps,
idle timeouts and fd exhaustion in test_server_admission.py and
test_server_listener.py.)"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path

import psutil
import pytest
import trio
from helpers.fakes import make_fake_config
from helpers.hosted import HostedServer, held
from helpers.server import Received, collect, expect_error, generate, open_ws, serving, wait_blocks_free
from helpers.serving import REPO, running, serve_argv, spawned, tree_of, wait_for_url
from helpers.waiting import in_thread
from websockets.exceptions import InvalidStatus

from trioserve import SamplingParams
from trioserve.errors import InvalidRequestError, PromptTooLongError
from trioserve.frontend.text.prompt import PromptChecker
from trioserve.frontend.text.tokenizer import Tokenizer
from trioserve.messages import EngineInfo, ModelInfo
from trioserve.server import Server

HUGE = 18446744073709551616  # 2**64: msgpack cannot carry it


@pytest.fixture(scope="class")
def shared_server(tiny_model_dir):
    """One server (5 ms steps) for the tests of a class: gone before the tests after it count processes."""
    yield from held(HostedServer(make_fake_config(str(tiny_model_dir("llama")), step_delay_s=0.005)))


class TestOnOneServer:
    """Hostile frames and values on one server, which must serve on after each."""

    @pytest.mark.parametrize(
        ("params", "field"),
        [({"max_tokens": HUGE}, "params.max_tokens"), ({"stop_token_ids": [HUGE]}, "params.stop_token_ids"),
         ({"top_k": 10**20}, "params.top_k"), ({"seed": HUGE}, "params.seed")],
    )  # fmt: skip
    async def test_integers_the_wire_cannot_carry_are_an_error_and_the_server_serves_on(
        self, shared_server, params, field
    ):
        async def scenario(server: Server) -> None:
            def client() -> dict[str, Received]:
                with open_ws(server.url) as ws:
                    running = {"beside": Received()}
                    ws.send(generate("beside", "carry on", max_tokens=40))
                    ws.send(json.dumps({"type": "generate", "id": "a", "prompt": "Hi", "params": params}))
                    assert expect_error(ws, "invalid_field", "a", running)["field"] == field
                    ws.send(generate("after", "and after", max_tokens=5))
                    return collect(ws, {"beside", "after"}, received=running)[0]

            received = await in_thread(client)
            assert received["beside"].terminal["type"] == received["after"].terminal["type"] == "done"  # type: ignore[index]

        await shared_server.run_fresh(scenario, bound_s=30)

    async def test_integers_the_wire_cannot_carry_raise_value_error_when_embedded(self, shared_server):
        async def scenario(server: Server) -> None:
            engine = server.engine
            assert engine is not None
            with pytest.raises(ValueError, match=r"^max_tokens: must be an integer in \[1, 2147483647\]"):
                await engine.generate("x", SamplingParams(max_tokens=HUGE))
            with pytest.raises(ValueError, match=r"^prompt: token ids must be integers in \[0, 259\)"):
                await engine.generate([1, HUGE])
            assert len((await engine.generate("x", SamplingParams(max_tokens=3))).token_ids) == 3

        await shared_server.run_fresh(scenario, bound_s=30)

    async def test_a_frame_of_arrays_nested_past_any_recursion_limit_is_invalid_json_and_the_connection_carries_on(
        self, shared_server
    ):
        async def scenario(server: Server) -> None:
            def client() -> dict[str, Received]:
                with open_ws(server.url) as ws:
                    running = {"beside": Received()}
                    ws.send(generate("beside", "carry on", max_tokens=40))
                    # Past any recursion limit: torch's compiler, run in-process by other tests, raises it to 2000.
                    ws.send("[" * 100_000 + "]" * 100_000)
                    assert expect_error(ws, "invalid_json", None, running)["message"].startswith("malformed JSON")
                    ws.send(json.dumps({"type": "generate", "id": "n", "prompt": "x", "junk": [[[[[[[[1]]]]]]]]}))
                    assert expect_error(ws, "invalid_field", "n", running)["field"] == "junk"
                    ws.send(generate("after", "and after", max_tokens=5))
                    return collect(ws, {"beside", "after"}, received=running)[0]

            received = await in_thread(client)
            assert received["beside"].terminal["type"] == received["after"].terminal["type"] == "done"  # type: ignore[index]

        await shared_server.run_fresh(scenario, bound_s=30)

    async def test_thousands_of_stop_strings_are_refused_and_stall_nobody(self, shared_server):
        async def scenario(server: Server) -> None:
            def client() -> dict[str, Received]:
                with open_ws(server.url) as ws:
                    running = {"beside": Received()}
                    ws.send(generate("beside", "carry on", max_tokens=60))
                    for i in range(16):
                        ws.send(generate(f"s{i}", "x", stop=[f"stop{j}" for j in range(30_000)]))
                    for i in range(16):
                        error = expect_error(ws, "invalid_field", f"s{i}", running)
                        assert error["field"] == "params.stop" and "at most 64 stop strings" in error["message"]
                    return collect(ws, {"beside"}, received=running)[0]

            started = time.monotonic()
            received = await in_thread(client)
            assert received["beside"].terminal["type"] == "done"  # type: ignore[index]
            assert time.monotonic() - started < 10  # it took 29 s of the front-end's CPU before
            await wait_blocks_free(server)

        await shared_server.run_fresh(scenario, bound_s=60)


def checker(max_model_len: int = 2048) -> PromptChecker:
    from trioserve.frontend.text.tokenizer import Tokenizer

    class CountingTokenizer(Tokenizer):
        def __init__(self) -> None:
            self.max_token_chars = 16
            self.vocab_size = 259
            self.chars_encoded = 0

        def encode(self, text: str) -> list[int]:
            self.chars_encoded += len(text)
            return [1] * len(text)

    info = EngineInfo(ModelInfo(259, max_model_len, [2]), 1024, 16, max_model_len, 1, [2])
    return PromptChecker(CountingTokenizer(), info)


async def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenized():
    prompts = checker(max_model_len=2048)
    with pytest.raises(PromptTooLongError, match=r"^prompt: 1048576 characters cannot fit the context of 2048"):
        await prompts.check_async("x" * 2**20)
    assert prompts.tokenizer.chars_encoded == 0  # type: ignore[attr-defined]
    # A text that may fit is tokenized (at most max_model_len x the longest token), then measured.
    with pytest.raises(PromptTooLongError, match=r"^prompt: 5000 tokens"):
        await prompts.check_async("x" * 5000)
    assert prompts.tokenizer.chars_encoded == 5000  # type: ignore[attr-defined]
    with pytest.raises(InvalidRequestError, match=r"^prompt: invalid string"):
        prompts.check("a\ud800b")


async def test_requests_cancelled_while_tokenizing_never_run_more_than_the_engines_share_of_threads():
    """Found: the limiter was given back as soon as a request was cancelled,
    while its abandoned thread still tokenized: ten cancelled requests ran
    ten encodes at once (the limit is TOKENIZE_THREADS)."""
    from trioserve.frontend.text.prompt import TOKENIZE_THREADS

    prompts = checker(max_model_len=8192)
    lock, running = threading.Lock(), [0, 0]  # now, most at once

    def slow_encode(text: str) -> list[int]:
        with lock:
            running[0] += 1
            running[1] = max(running[1], running[0])
        time.sleep(0.3)
        with lock:
            running[0] -= 1
        return [1] * len(text)

    prompts.tokenizer.encode = slow_encode  # type: ignore[method-assign]
    with trio.fail_after(30):
        for _ in range(10):
            with trio.move_on_after(0.02):
                await prompts.check_async("x" * 5000)
        while running[0]:
            await trio.sleep(0.05)
    assert running[1] == TOKENIZE_THREADS


def test_a_long_text_is_encoded_with_the_gil_released_into_the_same_ids(tiny_model_dir):
    """Above GIL_FREE_ENCODE_CHARS the tokenizer uses encode_batch, which lets
    the event loop's thread run while a worker thread tokenizes; the ids are
    those encode gives."""
    from trioserve.frontend.text.tokenizer import GIL_FREE_ENCODE_CHARS

    tokenizer = Tokenizer.from_dir(tiny_model_dir("llama"))
    text = ("Hello wörld 你好 🎉 <s> " * 1000)[: GIL_FREE_ENCODE_CHARS * 3]
    assert len(text) > GIL_FREE_ENCODE_CHARS
    for special in (True, False):
        assert tokenizer.encode(text, add_special_tokens=special) == (
            tokenizer._backend.encode(text, add_special_tokens=special).ids
        )


async def test_a_text_encoding_to_ids_beyond_the_models_vocabulary_is_refused_naming_it(tiny_model_dir, caplog):
    """Found: a tokenizer larger than its model's embedding (a packaging
    mistake) let any client's text reach the worker with ids it cannot
    take; the worker died, with every request beside it, and a few such
    requests used up the restarts."""
    tokenizer = Tokenizer.from_dir(tiny_model_dir("llama"))
    assert tokenizer.vocab_size == 259
    info = EngineInfo(ModelInfo(100, 8192, [2]), 1024, 16, 8192, 1, [2])
    with caplog.at_level(logging.WARNING, logger="trioserve.prompt"):
        prompts = PromptChecker(tokenizer, info)
    assert "the tokenizer has 259 entries but the model's vocabulary has 100" in caplog.text
    low = max(tokenizer.encode("\x01\x02", add_special_tokens=False))
    assert low < 100 and prompts.check("\x01\x02")  # ids the model has pass
    assert max(tokenizer.encode("hi")) >= 100
    with pytest.raises(InvalidRequestError, match=r"^prompt: the text encodes to token id \d+, outside this model's "):
        prompts.check("hi")
    with pytest.raises(InvalidRequestError, match=r"outside this model's vocabulary of 100"):
        await prompts.check_async("hi " * 5000)  # tokenized in a thread


async def test_a_flood_of_mebibyte_prompts_is_refused_at_once_and_costs_the_front_end_no_memory(fake_config):
    with trio.fail_after(60):
        async with serving(fake_config(step_delay_s=0.005, max_model_len=512)) as server:
            before = psutil.Process().memory_info().rss

            def flood() -> list[dict]:
                big = "word " * ((2**20 - 200) // 5)  # just under the 1 MiB message limit
                with open_ws(server.url, max_size=None) as ws:
                    running = {"beside": Received()}
                    ws.send(generate("beside", "carry on", max_tokens=40))
                    errors = []
                    for i in range(24):
                        ws.send(generate(f"big{i}", big))
                    for i in range(24):
                        errors.append(expect_error(ws, "prompt_too_long", f"big{i}", running))
                    collect(ws, {"beside"}, received=running)
                    assert running["beside"].terminal["type"] == "done"  # type: ignore[index]
                    return errors

            started = time.monotonic()
            errors = await in_thread(flood)
            assert time.monotonic() - started < 20
            assert all(e["field"] == "prompt" and "characters cannot fit" in e["message"] for e in errors)
            assert psutil.Process().memory_info().rss - before < 300 * 2**20  # it took 3.2 GB before


def run_trioserve(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trioserve.cli", *argv], capture_output=True, text=True, cwd=REPO,
        env=env or dict(os.environ), timeout=120, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("how", ["option", "environment"])
async def test_an_empty_api_key_is_an_error_not_no_authentication(tiny_model_dir, how):
    argv = ["serve", "--port", "0", "--model", str(tiny_model_dir("llama")), "--runner", "fake"]
    env = dict(os.environ)
    if how == "option":
        argv += ["--api-key", ""]
    else:
        env["TRIOSERVE_API_KEY"] = ""
    done = await trio.to_thread.run_sync(lambda: run_trioserve(*argv, env=env))
    assert done.returncode == 2
    assert "the API key is empty" in done.stderr and len(done.stderr.strip().splitlines()) == 1


async def test_the_api_key_reaches_no_child_process_and_can_come_from_a_file(tiny_model_dir, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    env = {**os.environ, "TRIOSERVE_API_KEY": "from-env"}
    argv = serve_argv("--model", str(tiny_model_dir("llama")), "--runner", "fake", "--api-key-file", str(key_file))
    with trio.fail_after(60), spawned(argv, env=env) as proc:
        url = await trio.to_thread.run_sync(wait_for_url, proc, 30)
        children = tree_of(proc.pid)
        assert len(children) == 2
        for pid in children:
            environ = open(f"/proc/{pid}/environ", "rb").read()  # noqa: SIM115
            assert b"TRIOSERVE_API_KEY" not in environ and b"s3cret" not in environ
        for headers in ({}, {"Authorization": "Bearer from-env"}):  # the file's key wins over the environment
            with pytest.raises(InvalidStatus):
                await in_thread(open_ws, url, additional_headers=headers)

        def authorized() -> dict:
            with open_ws(url, additional_headers={"Authorization": "Bearer s3cret"}) as ws:
                ws.send(generate("a", "hi", max_tokens=3))
                return collect(ws, {"a"})[0]["a"].terminal  # type: ignore[return-value]

        assert (await in_thread(authorized))["type"] == "done"


async def test_an_unknown_log_level_is_a_usage_error_in_one_line(tmp_path):
    # Found: logging.basicConfig's ValueError escaped main(): a traceback and exit 1.
    with trio.fail_after(60):
        done = await trio.to_thread.run_sync(lambda: run_trioserve("serve", "--log-level", "loud"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == ["trioserve: invalid input: --log-level: unknown level 'loud'"]


@pytest.mark.parametrize("command", ["serve", "generate"])
async def test_a_missing_model_directory_is_a_start_up_error_in_one_line_naming_it(command, tmp_path):
    missing = str(tmp_path / "no-such-model")
    argv = (
        ["serve", "--port", "0", "--model", missing] if command == "serve" else ["generate", "--model", missing, "hi"]
    )
    done = await trio.to_thread.run_sync(lambda: run_trioserve(*argv))
    assert done.returncode == 3
    assert done.stderr.strip().splitlines() == [
        f"trioserve: the engine could not start: model directory not found: {missing!r}"
    ]


@pytest.mark.parametrize("flood", ["long-outputs", "prompts-at-the-context-limit"])
async def test_a_flood_that_never_reads_does_not_hold_back_a_polite_clients_request(fake_config, flood):
    """10 connections x 64 requests that never read (long outputs, or prompts
    that fill the context) beside one polite request of 8 tokens: it
    completes within 2 s on a quiet machine, and the bound is 10 s, for a
    machine busy with other tests. Before, it took 60 s (45 s at the context
    limit)."""
    config = fake_config(step_delay_s=0.005, max_num_seqs=16, max_model_len=2048, num_kv_blocks=1024)
    prompt = [7] * (2000 if flood == "prompts-at-the-context-limit" else 16)
    with trio.fail_after(60):
        async with serving(config) as server:
            flooding = [await in_thread(open_ws, server.url, ping_interval=None) for _ in range(10)]
            try:

                def flood_them() -> None:
                    for c, ws in enumerate(flooding):
                        for i in range(64):
                            ws.send(generate(f"f{c}-{i}", prompt, max_tokens=40 if len(prompt) > 16 else 2000))

                await in_thread(flood_them)
                # The flood reaches the engine: every slot is taken (or, at the context limit, every
                # KV block), and more wait.
                with trio.fail_after(10):
                    while True:
                        stats = await server.engine.stats()  # type: ignore[union-attr]
                        if (stats.num_running == 16 or stats.num_free_blocks < 500) and stats.num_waiting > 0:
                            break
                        await trio.sleep(0.05)

                def polite() -> tuple[float, dict]:
                    with open_ws(server.url) as ws:
                        started = time.monotonic()
                        ws.send(generate("p", "Hello", max_tokens=8, ignore_eos=True))
                        received = collect(ws, {"p"})[0]["p"]
                        return time.monotonic() - started, received.terminal  # type: ignore[return-value]

                took, terminal = await in_thread(polite)
                assert terminal["type"] == "done" and terminal["usage"]["completion_tokens"] == 8
                assert took < 10.0, f"the polite request took {took:.2f}s"
            finally:
                for ws in flooding:  # the flooder vanishes: its requests are aborted, their blocks freed
                    ws.socket.shutdown(socket.SHUT_RDWR)
                    ws.socket.close()
            await wait_blocks_free(server, timeout=15)


async def test_serve_started_with_its_standard_descriptors_closed_serves_and_stops_leaving_nothing(tiny_model_dir):
    """Found: started with ``<&- >&- 2>&-`` (a daemonizer that closes them),
    ``serve``'s descriptor 2 was a socket and every child inherited it as its
    standard error, and an engine core's end raised (``sys.stdout`` was
    None). Each closed one is ``/dev/null`` now, in every process."""
    with socket.socket() as probe:  # stdout is closed: the port must be known beforehand
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = ["serve", "--port", str(port), "--model", str(tiny_model_dir("llama")), "--runner", "fake"]
    closed = ["bash", "-c", 'exec "$@" <&- >&- 2>&-', "bash", sys.executable, "-m", "trioserve.cli", *argv]
    base = f"http://127.0.0.1:{port}"

    def completion() -> dict:
        with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as response:
            model = json.loads(response.read())["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 3}).encode()
        request = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    with trio.fail_after(60), spawned(closed) as proc:
        while await in_thread(http_status, f"{base}/health") != 200:
            assert proc.poll() is None
            await trio.sleep(0.05)
        tree = [proc.pid, *tree_of(proc.pid)]
        assert len(tree) == 3
        for pid in tree:
            assert [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in (0, 1, 2)] == [os.devnull] * 3, pid
        assert (await in_thread(completion))["choices"][0]["finish_reason"] == "length"
        proc.send_signal(signal.SIGTERM)
        assert await trio.to_thread.run_sync(proc.wait, 30) == 0
    assert not [pid for pid in tree if running(pid)]


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:  # not listening yet
        return 0


async def test_serve_with_a_temporary_directory_too_long_for_socket_paths_serves(tiny_model_dir, tmp_path):
    """Found: a long ``TMPDIR`` (over ~60 bytes) made ``serve`` fail with a
    traceback from zmq. Its private directories now go in /tmp."""
    long = tmp_path / ("x" * 100)
    long.mkdir()
    argv = serve_argv("--model", str(tiny_model_dir("llama")), "--runner", "fake")
    with trio.fail_after(60), spawned(argv, env={**os.environ, "TMPDIR": str(long)}) as proc:
        url = await in_thread(wait_for_url, proc, 30)
        with open_ws(url) as ws:
            ws.send(generate("a", "hi", max_tokens=3))
            assert collect(ws, {"a"})[0]["a"].terminal["type"] == "done"  # type: ignore[index]
        proc.send_signal(signal.SIGTERM)
        assert await trio.to_thread.run_sync(proc.wait, 30) == 0


async def test_modules_in_the_working_directory_reach_no_process_of_the_tree(tiny_model_dir, tmp_path):
    """Found: every child ran ``python -m``, which puts the working directory
    first on ``sys.path``: a ``trio.py`` or ``random.py`` where ``serve`` was
    started was imported by each child (the engine could not start; a file
    planted there ran as code in the server)."""
    script = Path(sys.executable).parent / "trioserve"  # the installed command: its own directory first, not ours
    for name in ("trio", "random", "msgspec"):
        (tmp_path / f"{name}.py").write_text(f"print('PLANTED {name}')\nraise SystemExit(7)\n")
    argv = [str(script), "serve", "--port", "0", "--model", str(tiny_model_dir("llama")), "--runner", "fake"]
    with trio.fail_after(60), spawned(argv, cwd=tmp_path) as proc:
        url = await in_thread(wait_for_url, proc, 30)
        with open_ws(url) as ws:
            ws.send(generate("a", "hi", max_tokens=3))
            assert collect(ws, {"a"})[0]["a"].terminal["type"] == "done"  # type: ignore[index]
        proc.send_signal(signal.SIGTERM)
        out, err = await trio.to_thread.run_sync(partial(proc.communicate, timeout=30))
    assert proc.returncode == 0, err
    assert "PLANTED" not in out + err


async def test_the_log_level_children_take_is_the_commands_whatever_the_environment_says(tiny_model_dir):
    """Found: ``TRIOSERVE_LOG_LEVEL=debug`` in the environment made every
    child raise at its first line (the engine could not start), and any value
    there won over ``--log-level``."""
    argv = serve_argv("--model", str(tiny_model_dir("llama")), "--runner", "fake", "--log-level", "info")
    with trio.fail_after(60), spawned(argv, {**os.environ, "TRIOSERVE_LOG_LEVEL": "debug"}) as proc:
        await in_thread(wait_for_url, proc, 30)
        proc.send_signal(signal.SIGTERM)
        _, err = await trio.to_thread.run_sync(partial(proc.communicate, timeout=30))
    assert proc.returncode == 0, err
    assert "INFO engine-core[" in err and "DEBUG engine-core[" not in err, err


def _cwd(pid: int) -> str | None:
    """``pid``'s working directory; None once it has exited."""
    try:
        return psutil.Process(pid).cwd()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None


async def test_children_started_after_the_working_directory_is_removed_start_in_the_root(tiny_model_dir, tmp_path):
    """Found: ``serve`` started in a directory removed afterwards (a deploy
    directory swapped) could not restart its engine: torch cannot load there
    (oneMKL: "Cannot load libtorch_cpu.so"; seen with the real runner), so the
    first crash took a healthy server down. Children started once it is gone
    start in ``/``, and a relative ``--model`` was made absolute at start."""
    deploy = tmp_path / "deploy"
    deploy.mkdir()
    (deploy / "model").symlink_to(tiny_model_dir("llama"))
    argv = serve_argv("--model", "model", "--runner", "fake")  # relative to the deploy directory
    with trio.fail_after(60), spawned(argv, cwd=deploy) as proc:
        url = await in_thread(wait_for_url, proc, 30)
        shutil.rmtree(deploy)  # the deploy directory swapped: a new one in its place
        deploy.mkdir()
        (deploy / "model").symlink_to(tiny_model_dir("llama"))
        first = tree_of(proc.pid)
        os.kill(min(first), signal.SIGKILL)  # the engine core (started before its worker)
        # The replacements: the live children not there before (one that exits
        # at once, as a zombie until reaped, has no directory to ask about).
        while len(new := [pid for pid in tree_of(proc.pid) if pid not in first and _cwd(pid) is not None]) < 2:
            await trio.sleep(0.05)
        assert [_cwd(pid) for pid in new] == ["/", "/"]
        with open_ws(url) as ws:
            ws.send(generate("a", "hi", max_tokens=3))
            assert collect(ws, {"a"})[0]["a"].terminal["type"] == "done"  # type: ignore[index]
        proc.send_signal(signal.SIGTERM)
        assert await trio.to_thread.run_sync(proc.wait, 30) == 0
