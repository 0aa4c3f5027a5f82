"""The command line's failures that come from the machine, not the engine:
an unusable cache directory, paths too long, standard input or output that
fails. Each is one line naming what was wrong, never a traceback."""

from __future__ import annotations

import errno
import io
import os
import subprocess
import sys

import pytest

from trioserve import default_model
from trioserve.chat import StdioError, write_out
from trioserve.cli import EXIT_ERROR, EXIT_STARTUP_FAILED, EXIT_USAGE, main
from trioserve.nurseries.supervision.oneshot import Finished
from trioserve.transport import curve

LONG_NAME = "a" * 300  # over NAME_MAX (255): ENAMETOOLONG


@pytest.fixture(autouse=True)
def _restore_log_level_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRIOSERVE_LOG_LEVEL", "WARNING")  # main() sets it; undone after the test


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


# --- the cache directory --------------------------------------------------------------


@pytest.mark.parametrize("where", ["a file", "under a file", "a name too long"])
def test_an_unusable_cache_dir_is_a_startup_error_naming_it(tmp_path, capsys, monkeypatch, where):
    """Found: $TRIOSERVE_CACHE_DIR a file (or under one) gave a traceback of
    the default model's mkdir, exit 1."""
    (tmp_path / "file").touch()
    cache = {
        "a file": tmp_path / "file",
        "under a file": tmp_path / "file" / "sub",
        "a name too long": tmp_path / LONG_NAME,
    }[where]
    monkeypatch.setenv("TRIOSERVE_CACHE_DIR", str(cache))
    monkeypatch.setattr(
        default_model, "gguf_path", lambda: tmp_path / "model.gguf"
    )  # never read: the cache fails first
    assert main(["generate", "--runner", "fake", "hi"]) == EXIT_STARTUP_FAILED
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert last_line(err).startswith(
        f"trioserve: the engine could not start: the cache directory {cache} cannot be used: "
    )
    assert "TRIOSERVE_CACHE_DIR" in last_line(err)


def test_bench_with_an_unusable_cache_dir_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").touch()
    monkeypatch.setenv("TRIOSERVE_CACHE_DIR", str(tmp_path / "file"))
    assert main(["bench", "--model", "bench-llama-40m", "--baselines", "none"]) == EXIT_USAGE
    assert last_line(capsys.readouterr().err) == (
        f"trioserve: invalid input: model: cannot use 'bench-llama-40m': the cache directory {tmp_path / 'file'} "
        "cannot be used: it is not a directory (set $TRIOSERVE_CACHE_DIR to a directory this user can write, "
        "or pass --model DIR)"
    )


def test_bench_whose_model_build_fails_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    """Found: a failing build of a benchmark model ended ``trioserve bench`` with a traceback."""
    monkeypatch.setenv("TRIOSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(default_model, "run_oneshot", lambda *args, **options: Finished(1))  # a builder that failed
    assert main(["bench", "--model", "bench-llama-40m", "--baselines", "none"]) == EXIT_USAGE
    assert last_line(capsys.readouterr().err) == (
        "trioserve: invalid input: model: building 'bench-llama-40m' failed (exit code 1; its error is above)"
    )
    assert os.listdir(tmp_path) == []


# --- paths too long -------------------------------------------------------------------


def test_keys_in_a_path_too_long_is_one_line_naming_it(tmp_path, capsys):
    assert main(["keys", str(tmp_path / LONG_NAME)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err == f"trioserve: invalid input: keys: cannot use {tmp_path / LONG_NAME}: File name too long\n"


def test_keys_that_cannot_be_written_leave_no_half_pair(tmp_path, monkeypatch):
    real_open = os.open

    def open_(path, flags, mode=0o777):
        if str(path).endswith(".key_secret"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_open(path, flags, mode)

    monkeypatch.setattr(curve.os, "open", open_)
    with pytest.raises(ValueError, match=r"keys: cannot write .*trioserve\.key_secret: No space left on device"):
        curve.write_keys(tmp_path / "keys")
    assert os.listdir(tmp_path / "keys") == []


# --- standard input and output --------------------------------------------------------


def run_cli(tiny_model_dir, *args: str, shell: str = 'exec "$0" "$@"', **options) -> subprocess.CompletedProcess:
    """``trioserve ARGS`` on the fake runner, through ``sh -c SHELL`` (to
    close a standard stream); ``options`` go to ``subprocess.run``."""
    command = ["sh", "-c", shell, sys.executable, "-m", "trioserve.cli", *args]
    command += ["--runner", "fake", "--model", str(tiny_model_dir("llama")), "--max-tokens", "5"]
    options = {"stdin": subprocess.DEVNULL, "stdout": subprocess.PIPE, **options}
    return subprocess.run(command, stderr=subprocess.PIPE, text=True, timeout=60, check=False, **options)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_output_to_a_full_device_is_one_line_and_exit_1(tiny_model_dir, command):
    """Found: a traceback of the OSError (only EPIPE was handled), exit 1."""
    args = ["generate", "hi"] if command == "generate" else ["chat"]
    with open("/dev/full", "w") as full:
        done = run_cli(tiny_model_dir, *args, stdin=None, input="hi\n", stdout=full)
    assert done.returncode == EXIT_ERROR, done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    assert last_line(done.stderr) == "trioserve: cannot write to stdout: No space left on device"


def test_chat_without_stdin_ends_as_at_its_end(tiny_model_dir):
    """Found: ``trioserve chat <&-`` gave a traceback (input(): lost sys.stdin), exit 1."""
    done = run_cli(tiny_model_dir, "chat", shell='exec "$0" "$@" <&-')
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.startswith("Type a message")


def test_generate_without_stdout_says_so_in_one_line(tiny_model_dir):
    done = run_cli(tiny_model_dir, "generate", "hi", stdout=None, shell='exec "$0" "$@" >&-')
    assert done.returncode == EXIT_ERROR
    assert done.stderr == "trioserve: cannot write to stdout: it is closed\n"


def test_a_failing_write_names_the_stream_and_a_closed_pipe_passes_as_it_is():
    class Failing(io.StringIO):
        name = "<stdout>"

        def __init__(self, exc: OSError) -> None:
            super().__init__()
            self.exc = exc

        def write(self, text: str) -> int:
            raise self.exc

    with pytest.raises(StdioError, match=r"^cannot write to stdout: Input/output error$"):
        write_out(Failing(OSError(errno.EIO, os.strerror(errno.EIO))), "x")  # type: ignore[arg-type]
    with pytest.raises(BrokenPipeError):
        write_out(Failing(BrokenPipeError(errno.EPIPE, "Broken pipe")), "x")  # type: ignore[arg-type]
    out = io.StringIO()
    write_out(out, "fine")
    assert out.getvalue() == "fine"


def test_an_open_files_limit_too_low_to_start_an_engine_is_one_line_naming_it(tiny_model_dir):
    """Found: under ``ulimit -n 16`` (the hard limit), a traceback from zmq's bind."""
    done = run_cli(tiny_model_dir, "generate", "hi", shell='ulimit -n 16 && exec "$0" "$@"')
    assert done.returncode == EXIT_ERROR
    assert done.stderr == (
        "trioserve: the open-files limit (RLIMIT_NOFILE) is 16, below the 64 that an engine needs to start: "
        "raise 'ulimit -n'\n"
    )
    soft_only = run_cli(tiny_model_dir, "generate", "hi", shell='ulimit -S -n 16 && exec "$0" "$@"')
    assert soft_only.returncode == 0, soft_only.stderr  # raised up to the hard limit, which allows it


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_text_the_locale_cannot_encode_is_written_as_question_marks(tiny_model_dir, command):
    """Found: under an ASCII or Latin-1 locale (here ``PYTHONIOENCODING``),
    ``generate`` and ``chat`` ended at the model's first character the
    encoding lacks, as "invalid input" (exit 2)."""
    args = ["generate", "hi"] if command == "generate" else ["chat"]
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    done = run_cli(tiny_model_dir, *args, stdin=None, input="hi\n", env=env)
    assert done.returncode == 0, done.stderr
    assert "?" in done.stdout and "invalid input" not in done.stderr


@pytest.mark.parametrize("value", ["abc", "inf", "nan", "-1"])
def test_a_hard_exit_time_that_is_not_seconds_is_one_line_naming_the_variable(tiny_model_dir, value):
    """Found: ``abc`` said "could not convert string to float", ``inf`` gave
    a traceback at the stop, ``nan`` a child that said "still alive nans"."""
    done = run_cli(tiny_model_dir, "generate", "hi", env={**os.environ, "TRIOSERVE_HARD_EXIT_S": value})
    assert done.returncode == EXIT_USAGE
    assert done.stderr == (
        f"trioserve: invalid input: TRIOSERVE_HARD_EXIT_S: must be a number of seconds >= 0, got {value!r}\n"
    )


SIGNAL_AFTER_CLOSE = """
import os, signal, trio
from trioserve.cli.signals import shutdown_signals
from trioserve.nurseries.supervision.oneshot import ignored_after_close

async def main():
    with trio.open_signal_receiver(*ignored_after_close(shutdown_signals())) as signals:
        os.kill(os.getpid(), signal.SIGTERM)  # taken by the receiver
        await signals.__anext__()
        os.kill(os.getpid(), signal.SIGHUP)  # a second one, not taken before it closes
        os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # and one as the process exits
    print("alive")

trio.run(main)
"""


def test_a_signal_that_the_servers_receiver_did_not_take_is_ignored_not_fatal():
    """Found: two signals 0.1 s apart while the engine loaded killed ``serve``
    (exit -1 or -15) after it had said "stopped": Trio's receiver delivers
    the signals it has not taken to the handler it found, the default, when
    it closes."""
    argv = [sys.executable, "-c", SIGNAL_AFTER_CLOSE]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert (done.returncode, done.stdout) == (0, "alive\n"), done.stderr
