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
    is empty, not a directory, open to others (it is never chmod-ed: it may
    be a shared one, such as the current directory), cannot be created, or
    already holds a key pair (never overwritten)."""
    if os.fspath(directory) == "":
        raise ValueError("keys: give a directory to write the key pair in")
    path = Path(directory)
    public_file, secret_file = path / f"{KEY_NAME}.key", path / f"{KEY_NAME}.key_secret"
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"keys: {path} is not a directory")
        if public_file.exists() or secret_file.exists():
            raise ValueError(f"keys: {path} already holds a key pair; remove it first, or choose another directory")
        _check_mode(path, "directory", 0o700)
    else:
        try:
            path.mkdir(mode=0o700, parents=True)
            os.chmod(path, 0o700)  # whatever the umask
        except OSError as exc:
            raise ValueError(f"keys: cannot create {path}: {exc.strerror or exc}") from None
    public, secret = zmq.curve_keypair()
    for file, text in (
        (public_file, f"public-key = {public.decode()}\n"),
        (secret_file, f"public-key = {public.decode()}\nsecret-key = {secret.decode()}\n"),
    ):
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    return CurveKeys(public, secret)


def load_keys(directory: str | os.PathLike[str]) -> CurveKeys:
    """The key pair in ``directory``. ``ValueError`` (naming the path) when
    the directory is open to others (not 0700), the secret file is readable
    by others (not 0600), or a file is missing or malformed."""
    path = Path(directory)
    _check_mode(path, "directory", 0o700)
    secret_file = path / f"{KEY_NAME}.key_secret"
    _check_mode(secret_file, "secret key file", 0o600)
    fields: dict[str, bytes] = {}
    for line in secret_file.read_text().splitlines():
        name, sep, value = line.partition("=")
        if sep:
            fields[name.strip()] = value.strip().encode()
    public, secret = fields.get("public-key", b""), fields.get("secret-key", b"")
    if len(public) != 40 or len(secret) != 40 or zmq.curve_public(secret) != public:
        raise ValueError(f"keys: {secret_file} is not a trioserve key pair (write one with `trioserve keys DIR`)")
    return CurveKeys(public, secret)


def _check_mode(path: Path, what: str, most: int) -> None:
    try:
        info = path.lstat()
    except OSError as exc:
        raise ValueError(f"keys: cannot read the {what} {path}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(info.st_mode):
        raise ValueError(f"keys: the {what} {path} is a symbolic link; give the real path")
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
