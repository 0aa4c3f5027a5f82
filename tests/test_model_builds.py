"""A model built on first use (the default model's conversion) is a
supervised child: stopping or killing ``trioserve serve`` while it runs
leaves neither the converter nor a half-built directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest
import trio
from helpers.serving import running, serve_argv, spawned

from trioserve.default_model import build_model_dir


def _builder(proc: subprocess.Popen[str]) -> psutil.Process | None:
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    for child in children:
        try:
            if "build" in child.cmdline():
                return child
        except psutil.Error:
            pass  # gone meanwhile
    return None


async def _wait_for_builder(proc: subprocess.Popen[str]) -> psutil.Process:
    while (builder := _builder(proc)) is None:
        assert proc.poll() is None, proc.communicate()
        await trio.sleep(0.05)
    await trio.sleep(0.5)  # into the conversion: importing torch, reading the file
    return builder


async def _wait_gone(pid: int) -> None:
    while running(pid):
        await trio.sleep(0.02)


@pytest.mark.parametrize(
    ("signum", "code", "last_line"),
    [
        (
            signal.SIGTERM,
            0,
            "trioserve: SIGTERM: stopped the default-model converter before it finished (nothing kept)",
        ),
        (signal.SIGINT, 130, "trioserve: interrupted"),
    ],
)
async def test_a_signal_while_the_default_model_converts_stops_the_converter_and_keeps_nothing(
    tmp_path, signum, code, last_line
):
    """Found: SIGTERM killed ``serve`` at once and left the converter running
    (for another 10-20 s) and its half-written directory in the cache."""
    cache = tmp_path / "cache"
    with trio.fail_after(60), spawned(serve_argv(), {**os.environ, "TRIOSERVE_CACHE_DIR": str(cache)}) as proc:
        builder = await _wait_for_builder(proc)
        proc.send_signal(signum)
        _, err = await trio.to_thread.run_sync(proc.communicate)
        assert proc.returncode == code, err
        assert err.strip().splitlines()[-1] == last_line
        assert "Traceback" not in err
        assert not running(builder.pid)
    assert os.listdir(cache) == []


async def test_kill_9_while_the_default_model_converts_ends_the_converter_which_removes_its_directory(tmp_path):
    cache = tmp_path / "cache"
    with trio.fail_after(60), spawned(serve_argv(), {**os.environ, "TRIOSERVE_CACHE_DIR": str(cache)}) as proc:
        builder = await _wait_for_builder(proc)
        proc.kill()
        await trio.to_thread.run_sync(proc.communicate)
        with trio.fail_after(3):  # it sees its parent gone at once (the watch pipe), not after the conversion
            await _wait_gone(builder.pid)
    assert os.listdir(cache) == []


def test_a_builder_that_fails_is_an_error_with_its_exit_code_and_leaves_nothing(tmp_path, capfd):
    target = tmp_path / "model"
    with pytest.raises(subprocess.CalledProcessError) as failed:
        build_model_dir(target, "trioserve.gpu.tiny_models", ["--arch", "no-such-arch"], name="tiny-model builder")
    assert failed.value.returncode == 1
    err = capfd.readouterr().err
    assert "invalid choice: 'no-such-arch'" in err  # the builder's own words, above the caller's one line
    assert "trioserve.gpu.tiny_models exited with code 2" in err
    assert os.listdir(tmp_path) == []


def test_only_a_trioserve_module_is_run_as_a_builder(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "trioserve.nurseries.entry", "build", "os", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 1
    assert "build: expected a trioserve module and its arguments" in done.stderr
