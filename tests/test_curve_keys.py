"""``transport/curve.load_keys`` on key directories that are wrong in every
way an operator can make them: each refused at once, in one line naming the
path and what is wrong, and ``serve`` exits 2 (``EXIT_USAGE``) as for the
other key errors."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.serving import REPO

from trioserve.cli import EXIT_USAGE, main
from trioserve.transport.curve import load_keys, write_keys

SECRET = "trioserve.key_secret"


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    directory = tmp_path / "keys"
    write_keys(directory)
    return directory


def headless(keys_dir: Path) -> list[str]:
    """``serve --headless`` arguments that load ``keys_dir`` before anything starts."""
    return [
        "serve", "--headless", "--data-parallel-size", "2", "--data-parallel-size-local", "1",
        "--data-parallel-start-rank", "1", "--data-parallel-address", "127.0.0.1",
        "--data-parallel-rpc-port", "1234", "--curve-keys", str(keys_dir),
    ]  # fmt: skip


def _write(keys: Path, content: bytes) -> None:
    (keys / SECRET).write_bytes(content)


def _secret_a_directory(keys: Path) -> None:
    (keys / SECRET).unlink()
    (keys / SECRET).mkdir(mode=0o600)


def _secret_a_fifo(keys: Path) -> None:
    (keys / SECRET).unlink()
    os.mkfifo(keys / SECRET, 0o600)


def _public_key_of_secret_not_z85(keys: Path) -> None:
    public = (keys / "trioserve.key").read_text().split("=", 1)[1].strip()
    _write(keys, f"public-key = {public}\nsecret-key = {'~' * 40}\n".encode())


@pytest.mark.parametrize(
    ("spoil", "what"),
    [
        (lambda keys: _write(keys, bytes(range(256))), "is not a trioserve key pair: it is not ASCII text"),
        (lambda keys: _write(keys, b"public-key = \xe9\xe9\n"), "is not a trioserve key pair: it is not ASCII text"),
        (lambda keys: _write(keys, b""), "is not a trioserve key pair: it needs a public-key and a secret-key line"),
        (_public_key_of_secret_not_z85, "is not a trioserve key pair: its secret key is not the secret"),
        (_secret_a_directory, "is a directory, not a regular file"),
    ],
    ids=["binary", "latin-1", "empty", "secret-not-z85", "directory"],
)
def test_a_secret_key_file_that_is_no_key_pair_is_refused_naming_the_file_and_why(
    keys: Path, spoil: Callable[[Path], None], what: str, capsys: pytest.CaptureFixture[str]
) -> None:
    spoil(keys)
    with pytest.raises(ValueError) as refused:
        load_keys(keys)
    message = str(refused.value)
    assert f"{keys / SECRET}" in message and what in message and "\n" not in message
    assert main(headless(keys)) == EXIT_USAGE
    assert capsys.readouterr().err == f"trioserve: invalid input: {message}\n"


def test_a_key_directory_that_is_a_file_is_refused_as_not_a_directory(tmp_path: Path) -> None:
    file = tmp_path / "keys"
    file.touch(mode=0o600)
    with pytest.raises(ValueError, match=f"the directory {file} is a regular file, not a directory"):
        load_keys(file)


def test_serve_with_a_fifo_for_a_secret_key_file_exits_2_at_once(keys: Path) -> None:
    """Opening a FIFO for reading blocks until a writer comes: ``serve`` must
    not, and a process blocked in ``open`` would not even heed SIGTERM (in a
    subprocess, killed past its timeout, so that a hang fails the test)."""
    _secret_a_fifo(keys)
    argv = [sys.executable, "-m", "trioserve.cli", *headless(keys)]
    done = subprocess.run(argv, check=False, capture_output=True, text=True, cwd=REPO, timeout=30)
    assert done.returncode == EXIT_USAGE
    assert done.stderr.strip().splitlines() == [
        f"trioserve: invalid input: keys: the secret key file {keys / SECRET} is a named pipe (FIFO), "
        "not a regular file"
    ]
