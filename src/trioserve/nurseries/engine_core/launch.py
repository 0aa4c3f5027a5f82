"""The launch contract between an engine core and the process that starts it.

A parent (the front-end's engine client, or a headless process on another
host) starts an engine core with ``python -m trioserve.nurseries.supervision.entry
engine-core`` and an environment that ``EngineCoreLaunch.env`` writes; the
engine core reads it back with ``EngineCoreLaunch.from_env``. The rest of the
contract is how sockets at an address are secured (``socket_options``: CURVE on
TCP, with the keys the environment names) and the one exit code that is not a
failure (``HEAD_LEFT_EXIT``). This module is all a parent imports of the engine
core: the names below are written nowhere else.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import zmq

from trioserve.config import ENGINES_ON_HOST_ENV
from trioserve.errors import EngineStartupError
from trioserve.transport.curve import CurveKeys, load_keys
from trioserve.transport.zmq_trio import TrioZmqSocket

HANDSHAKE_ADDRESS_ENV = "TRIOSERVE_HANDSHAKE_ADDRESS"
ENGINE_INDEX_ENV = "TRIOSERVE_ENGINE_INDEX"
LOCAL_INDEX_ENV = "TRIOSERVE_LOCAL_ENGINE_INDEX"
HANDSHAKE_TIMEOUT_ENV = "TRIOSERVE_HANDSHAKE_TIMEOUT_S"
CURVE_KEYS_ENV = "TRIOSERVE_CURVE_KEYS"
# The key pair itself ("public secret", Z85), for a parent that holds it in memory (a Ray actor): read
# and removed from the environment at start, so the engine core's own children never see it.
CURVE_KEY_PAIR_ENV = "TRIOSERVE_CURVE_KEY_PAIR"
INSECURE_TCP_ENV = "TRIOSERVE_INSECURE_TCP"
PRIVATE_DIR_ENV = "TRIOSERVE_PRIVATE_DIR"
API_SERVERS_DIR_ENV = "TRIOSERVE_API_SERVERS_DIR"
API_SERVERS_HOST_ENV = "TRIOSERVE_API_SERVERS_HOST"
API_SERVERS_PORT_ENV = "TRIOSERVE_API_SERVERS_PORT"
DEFAULT_HANDSHAKE_TIMEOUT_S = 30.0  # EngineConfig.startup_timeout_s's default

# The exit code of a headless engine core whose front-end said it is stopping
# (EX_TEMPFAIL): its headless supervisor says so in one line and joins again.
HEAD_LEFT_EXIT = 75

log = logging.getLogger("trioserve.engine_core")


@dataclass(frozen=True)
class EngineCoreLaunch:
    """What an engine core is told when it starts.

    - ``handshake_address``: the parent's handshake socket (``ipc://`` in the
      front-end's private directory, or ``tcp://`` on another host).
    - ``engine_index``: its data-parallel rank.
    - ``handshake_timeout_s``: how long it waits for ``HandshakeInit`` (the
      front-end's ``startup_timeout_s``).
    - ``api_servers_dir``: where a local engine core listens for API servers.
    - ``api_servers_host`` / ``api_servers_port``: on another host, the
      address it binds for API servers and the first of its two ports (0: the
      kernel picks).
    - ``curve_keys_dir`` (or ``curve_key_pair``, the keys themselves), or
      ``insecure_tcp``: on TCP, the deployment's CURVE keys, or going without.
    - ``private_dir``: on TCP, a private directory of the parent's for this
      life (tensor parallelism's rendezvous file goes there); the parent
      removes it when the engine core ends, however it ends.
    - ``engines_on_host``: how many engine cores share this host's cores.
    - ``local_index``: its place among the engine cores of its host (None:
      ``engine_index``, as on the head); its workers take the accelerators
      of that place (``gpu/device.py``).
    """

    handshake_address: str
    engine_index: int = 0
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S
    api_servers_dir: str | None = None
    api_servers_host: str | None = None
    api_servers_port: int = 0
    curve_keys_dir: str | None = None
    curve_key_pair: CurveKeys | None = None
    insecure_tcp: bool = False
    private_dir: str | None = None
    engines_on_host: int | None = None
    local_index: int | None = None

    @property
    def local_engine_index(self) -> int:
        """Its place among the engine cores of its host."""
        return self.engine_index if self.local_index is None else self.local_index

    @property
    def process(self) -> str:
        """The engine core's name in messages: ``engine-core-{engine_index}``."""
        return f"engine-core-{self.engine_index}"

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` with this launch written into it."""
        env = dict(base)
        env[HANDSHAKE_ADDRESS_ENV] = self.handshake_address
        env[ENGINE_INDEX_ENV] = str(self.engine_index)
        env[HANDSHAKE_TIMEOUT_ENV] = str(self.handshake_timeout_s)
        optional = {
            API_SERVERS_DIR_ENV: self.api_servers_dir,
            API_SERVERS_HOST_ENV: self.api_servers_host,
            API_SERVERS_PORT_ENV: str(self.api_servers_port) if self.api_servers_port else None,
            CURVE_KEYS_ENV: self.curve_keys_dir,
            CURVE_KEY_PAIR_ENV: None if (pair := self.curve_key_pair) is None else _pair_text(pair),
            INSECURE_TCP_ENV: "1" if self.insecure_tcp else None,
            PRIVATE_DIR_ENV: self.private_dir,
            ENGINES_ON_HOST_ENV: None if self.engines_on_host is None else str(self.engines_on_host),
            LOCAL_INDEX_ENV: None if self.local_index is None else str(self.local_index),
        }
        env.update({name: value for name, value in optional.items() if value is not None})
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> EngineCoreLaunch:
        """The launch an engine core was started with. ``KeyError`` without a
        handshake address; a handshake timeout that is missing or not a
        positive number is the default (with a warning)."""
        engines = environ.get(ENGINES_ON_HOST_ENV, "")
        local = environ.get(LOCAL_INDEX_ENV, "")
        return cls(
            handshake_address=environ[HANDSHAKE_ADDRESS_ENV],
            engine_index=int(environ.get(ENGINE_INDEX_ENV, "0")),
            handshake_timeout_s=_timeout(environ.get(HANDSHAKE_TIMEOUT_ENV)),
            api_servers_dir=environ.get(API_SERVERS_DIR_ENV),
            api_servers_host=environ.get(API_SERVERS_HOST_ENV) or None,
            api_servers_port=int(environ.get(API_SERVERS_PORT_ENV) or 0),
            curve_keys_dir=environ.get(CURVE_KEYS_ENV) or None,
            curve_key_pair=_key_pair(environ.get(CURVE_KEY_PAIR_ENV)),
            insecure_tcp=environ.get(INSECURE_TCP_ENV) == "1",
            private_dir=environ.get(PRIVATE_DIR_ENV),
            engines_on_host=int(engines) if engines.isdigit() else None,
            local_index=int(local) if local.isdigit() else None,
        )

    def curve_keys(self, address: str) -> CurveKeys | None:
        """The CURVE keys for TCP sockets at ``address``: None with
        ``insecure_tcp``; ``EngineStartupError`` with neither keys nor that."""
        if self.curve_key_pair is not None:
            return self.curve_key_pair
        if self.curve_keys_dir:
            try:
                return load_keys(self.curve_keys_dir)
            except ValueError as exc:
                raise EngineStartupError(str(exc), stage="handshake") from None
        if self.insecure_tcp:
            return None
        raise EngineStartupError(
            f"{address} is TCP: set {CURVE_KEYS_ENV} to the CURVE keys' directory (or {INSECURE_TCP_ENV}=1)",
            stage="handshake",
        )

    def socket_options(self, address: str, *, bind: bool = False) -> dict[str, object]:
        """Options for a socket at ``address``: on TCP, CURVE (a client
        connecting to the front-end, or with ``bind`` a server for the API
        servers: the process then needs a ZAP handler for ``curve_keys``), or
        nothing with ``insecure_tcp``; nothing for ``ipc://``."""
        if not address.startswith("tcp://"):
            return {}
        keys = self.curve_keys(address)
        if keys is None:
            return {}
        return keys.server_options() if bind else keys.client_options()


def _pair_text(pair: CurveKeys) -> str:
    return f"{pair.public.decode()} {pair.secret.decode()}"  # (Z85 has no space; it has ':')


def _key_pair(raw: str | None) -> CurveKeys | None:
    """``public secret`` as a key pair; None when absent or not one (then the
    keys' directory or ``insecure_tcp`` decide, as without it)."""
    public, _, secret = (raw or "").partition(" ")
    if len(public) != 40 or len(secret) != 40:
        return None
    return CurveKeys(public.encode(), secret.encode())


def _timeout(raw: str | None) -> float:
    if raw is None:
        return DEFAULT_HANDSHAKE_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        log.warning(
            "%s=%r is not a positive number of seconds: using %ss",
            HANDSHAKE_TIMEOUT_ENV,
            raw,
            DEFAULT_HANDSHAKE_TIMEOUT_S,
        )
        return DEFAULT_HANDSHAKE_TIMEOUT_S
    return value


def endpoint(sock: TrioZmqSocket) -> str:
    """The endpoint ``sock`` was last bound or connected to (``tcp://host:port``
    with the port the kernel picked)."""
    last = sock.socket.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(last, bytes)
    return last.decode()


def ipc_directory(address: str) -> str | None:
    """The directory of an ``ipc://`` address (None for TCP)."""
    return os.path.dirname(address.removeprefix("ipc://")) if address.startswith("ipc://") else None
