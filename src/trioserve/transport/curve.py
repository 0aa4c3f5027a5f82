"""CURVE: ZeroMQ's authentication and encryption, for engine sockets on TCP.

One key pair per deployment. ``trioserve keys DIR`` writes it (``write_keys``):
``DIR/trioserve.key`` (the public key) and ``DIR/trioserve.key_secret`` (both
keys), each 0600, in a 0700 directory; copy that directory to every host.
The side that binds (the head's front-end; a headless engine core's
sockets for the head's API servers) is the CURVE server with the secret key;
each side that connects (a headless engine core to the head; an API server
to a headless engine core) is a CURVE client that presents the same pair
and checks that the server holds the secret of the public key it expects. A peer without the secret cannot pose
as the head, and a peer whose public key is not the deployment's is refused
by the ZAP handler (``CurveAuthenticator``) during the ZeroMQ handshake,
before any message of its is queued on the socket: it never reaches an
engine. Every byte on the wire is encrypted.

Why a Trio task, not pyzmq's ``ThreadAuthenticator``: the ZAP handler is one
REP socket on ``inproc://zeromq.zap.01`` answering a request per new
connection; driven like every other socket here (``TrioZmqSocket``), it lives
and dies with the process's ``trio.run`` and needs no thread. It answers
only while the event loop runs, which is also when any connection matters.
Server sockets set ``zap_enforce_domain``, so that if no handler is there,
the connection is refused rather than let in.

Invariants: keys are loaded only from a directory no one else can enter
(mode 0700) and a secret file no one else can read (0600), else
``ValueError`` naming the path; a server socket is never bound without
``zap_enforce_domain``.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
import zmq
from zmq.utils import z85

from trioserve.transport.zmq_trio import TrioZmqSocket

__all__ = ["CurveAuthenticator", "CurveKeys", "load_keys", "write_keys"]

KEY_NAME = "trioserve"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"trioserve"


@dataclass(frozen=True)
class CurveKeys:
    """The deployment's key pair (Z85-encoded, 40 bytes each)."""

    public: bytes
    secret: bytes

    def server_options(self) -> dict[str, Any]:
        """Socket options for the side that binds."""
        return {
            "curve_server": 1,
            "curve_secretkey": self.secret,
            "zap_domain": ZAP_DOMAIN,
            "zap_enforce_domain": 1,
        }

    def client_options(self) -> dict[str, Any]:
        """Socket options for the side that connects."""
        return {"curve_serverkey": self.public, "curve_publickey": self.public, "curve_secretkey": self.secret}

    def __repr__(self) -> str:  # never print a secret
        return f"CurveKeys(public={self.public.decode()!r})"


def write_keys(directory: str | os.PathLike[str]) -> CurveKeys:
    """Write a new key pair into ``directory``: a new one (created 0700), or
    an existing private one (0700). ``ValueError`` naming the path when it
    is empty, cannot be looked at (too long, say), is not a directory, is
    open to others (it is never chmod-ed: it may be a shared one, such as
    the current directory), cannot be created, already holds a key pair
    (never overwritten), or a key file cannot be written (then neither is
    left there)."""
    if os.fspath(directory) == "":
        raise ValueError("keys: give a directory to write the key pair in")
    path = Path(directory)
    public_file, secret_file = path / f"{KEY_NAME}.key", path / f"{KEY_NAME}.key_secret"
    try:
        exists, is_dir = path.exists(), path.is_dir()
        holds_keys = is_dir and (public_file.exists() or secret_file.exists())
    except OSError as exc:  # a name too long, a loop of links
        raise ValueError(f"keys: cannot use {path}: {exc.strerror or exc}") from None
    if exists:
        if not is_dir:
            raise ValueError(f"keys: {path} is not a directory")
        if holds_keys:
            raise ValueError(f"keys: {path} already holds a key pair; remove it first, or choose another directory")
        _check_mode(path, "directory", 0o700)
    else:
        try:
            path.mkdir(mode=0o700, parents=True)
            os.chmod(path, 0o700)  # whatever the umask
        except OSError as exc:
            raise ValueError(f"keys: cannot create {path}: {exc.strerror or exc}") from None
    public, secret = zmq.curve_keypair()
    written: list[Path] = []
    for file, text in (
        (public_file, f"public-key = {public.decode()}\n"),
        (secret_file, f"public-key = {public.decode()}\nsecret-key = {secret.decode()}\n"),
    ):
        try:
            fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            written.append(file)
            with os.fdopen(fd, "w") as f:
                f.write(text)
        except OSError as exc:
            for done in written:
                done.unlink(missing_ok=True)
            raise ValueError(f"keys: cannot write {file}: {exc.strerror or exc}") from None
    return CurveKeys(public, secret)


def load_keys(directory: str | os.PathLike[str]) -> CurveKeys:
    """The key pair in ``directory``. ``ValueError`` (one line naming the
    path and what is wrong) when the directory is not one, or is open to
    others (not 0700); when the secret file is missing, a symbolic link, not
    a regular file (a directory, a FIFO: never opened, so a FIFO cannot
    block), readable by others (not 0600), or does not hold a key pair (not
    ASCII text, malformed, or its two keys do not match)."""
    path = Path(directory)
    _check_mode(path, "directory", 0o700, kind=stat.S_IFDIR)
    secret_file = path / f"{KEY_NAME}.key_secret"
    _check_mode(secret_file, "secret key file", 0o600, kind=stat.S_IFREG)
    raw = _read_small_file(secret_file, "secret key file")
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError(_not_a_pair(secret_file, "it is not ASCII text")) from None
    fields: dict[str, bytes] = {}
    for line in text.splitlines():
        name, sep, value = line.partition("=")
        if sep:
            fields[name.strip()] = value.strip().encode()
    public, secret = fields.get("public-key", b""), fields.get("secret-key", b"")
    if len(public) != 40 or len(secret) != 40:
        raise ValueError(_not_a_pair(secret_file, "it needs a public-key and a secret-key line, 40 characters each"))
    try:
        matches = zmq.curve_public(secret) == public
    except zmq.ZMQError:  # a secret key that is not Z85
        matches = False
    if not matches:
        raise ValueError(_not_a_pair(secret_file, "its secret key is not the secret of its public key"))
    return CurveKeys(public, secret)


def _not_a_pair(path: Path, why: str) -> str:
    return f"keys: {path} is not a trioserve key pair: {why} (write one with `trioserve keys DIR`)"


_MAX_KEY_FILE = 4096  # bytes read at most: a key pair file is about 110


def _read_small_file(path: Path, what: str) -> bytes:
    """The first ``_MAX_KEY_FILE`` bytes of the regular file ``path``, opened
    without following a link and without blocking, so that a FIFO put there
    since ``_check_mode`` looked is refused, not waited on. ``ValueError``
    naming the path (the ``what``) when it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"keys: the {what} {path} is not a regular file")
            return f.read(_MAX_KEY_FILE)
    except OSError as exc:
        raise ValueError(f"keys: cannot read the {what} {path}: {exc.strerror or exc}") from None


_FILE_TYPES = {
    stat.S_IFDIR: "directory",
    stat.S_IFREG: "regular file",
    stat.S_IFIFO: "named pipe (FIFO)",
    stat.S_IFSOCK: "socket",
    stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
}


def _check_mode(path: Path, what: str, most: int, *, kind: int | None = None) -> None:
    """``ValueError`` naming ``path`` (the ``what``) unless it exists, is no
    symbolic link, is of file type ``kind`` (``stat.S_IFDIR``...; any when
    None), is this user's, and has no mode bit beyond ``most``."""
    try:
        info = path.lstat()
    except OSError as exc:
        raise ValueError(f"keys: cannot read the {what} {path}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(info.st_mode):
        raise ValueError(f"keys: the {what} {path} is a symbolic link; give the real path")
    if kind is not None and stat.S_IFMT(info.st_mode) != kind:
        found = _FILE_TYPES.get(stat.S_IFMT(info.st_mode), "special file")
        raise ValueError(f"keys: the {what} {path} is a {found}, not a {_FILE_TYPES[kind]}")
    if info.st_uid != os.getuid():
        raise ValueError(f"keys: the {what} {path} belongs to another user")
    mode = stat.S_IMODE(info.st_mode)
    if mode & ~most:
        raise ValueError(
            f"keys: the {what} {path} has mode {mode:04o}; it must be {most:04o} at most "
            f"(chmod {most:o} {path}): keys others can read are no secret"
        )


class CurveAuthenticator:
    """The process's ZAP handler: lets in a CURVE peer whose public key is
    the deployment's, and no other. Start it (``await nursery.start(auth.run)``)
    before binding any server socket; one per process (the ZAP endpoint is
    the process's zmq context's)."""

    def __init__(self, keys: CurveKeys) -> None:
        self._allowed = {z85.decode(keys.public)}
        self.num_allowed = 0
        self.num_refused = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Answer ZAP requests until cancelled (then the endpoint is closed)."""
        with TrioZmqSocket.bind(zmq.REP, ZAP_ENDPOINT, linger=0) as sock:
            task_status.started()
            while True:
                request = await sock.recv_multipart()
                await sock.send_multipart(self.answer(request))

    def answer(self, request: list[bytes]) -> list[bytes]:
        """The reply to one ZAP request (RFC 27): 200 for an allowed CURVE key, else 400."""
        if len(request) < 6:
            self.num_refused += 1
            return [b"1.0", b"", b"400", b"malformed ZAP request", b"", b""]
        version, request_id, domain, _address, _identity, mechanism, *credentials = request
        allowed = (
            version == b"1.0"
            and domain == ZAP_DOMAIN
            and mechanism == b"CURVE"
            and len(credentials) == 1
            and credentials[0] in self._allowed
        )
        if allowed:
            self.num_allowed += 1
            return [b"1.0", request_id, b"200", b"OK", b"engine", b""]
        self.num_refused += 1
        return [b"1.0", request_id, b"400", b"not a key of this deployment", b"", b""]
