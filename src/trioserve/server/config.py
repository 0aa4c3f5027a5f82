"""The server's settings (HTTP and WebSocket): frozen, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from trioserve.config import check_types
from trioserve.server.tool_calls import TOOL_CALL_PARSERS


def _check(condition: bool, name: str, message: str) -> None:
    if not condition:
        raise ValueError(f"{name}: {message}")


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """How ``trioserve serve`` listens and how much it lets each client hold.
    An HTTP request body is bounded by ``max_message_bytes`` too (413 beyond it).

    ``host`` is loopback unless told otherwise. ``port`` 0 picks a free port.
    Sizes and times are per connection unless said otherwise. The defaults
    and their reasons: docs/websocket-protocol.md, "Limits".
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # required as "Authorization: Bearer <key>" when set
    max_connections: int = 1000  # TCP connections served at once, server-wide; more get 503 (/health still answers)
    idle_timeout_s: float = 120.0  # no request in flight and no client message this long: close with 4408 (inf: never)
    max_requests_per_connection: int = 64  # requests in flight on one connection
    max_message_bytes: int = 1024 * 1024  # a larger client message closes the connection with 1009
    outbox_size: int = 64  # server messages queued for one connection's sender
    slow_consumer_timeout_s: float = 10.0  # a request waiting this long to queue a delta ends (slow_consumer)
    socket_send_buffer_bytes: int | None = None  # SO_SNDBUF per client socket (None: the OS's default)
    handshake_timeout_s: float = 10.0  # from accept: to receive the HTTP request head and finish the handshake
    shutdown_grace_s: float = 10.0  # in-flight requests may finish within this after SIGINT/SIGTERM
    close_timeout_s: float = 1.0  # after the grace: to flush terminal messages and close each connection
    keepalive_timeout_s: float = 5.0  # an HTTP connection between two requests waits this long for the next head
    max_http_requests_per_connection: int = 1000  # then the connection closes (the client reconnects)
    model_name: str | None = None  # the API's name for the model (None: the model directory's name)
    model_aliases: tuple[str, ...] = ()  # more names requests may give for it (vLLM's --served-model-name a b)
    root_path: str = ""  # a prefix a proxy in front may leave on every path (vLLM's --root-path): taken off
    # A special token's text in a chat message's content becomes the token (a user can then write another
    # role's turn); off: it stays text (frontend/text/literal.py).
    special_tokens_in_content: bool = False
    strict_fields: bool = False  # a request field the API does not know is a 400 (else ignored, and logged)
    # Tool calling (vLLM's flags): tool_choice "auto" is served only with enable_auto_tool_choice, the model's own
    # calls read by tool_call_parser (server/tool_calls.py: "hermes", "llama3_json").
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # TLS (vLLM's flags; server/tls.py): with a certificate, the port speaks only HTTPS and WSS.
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None  # None: the key is in ssl_certfile
    ssl_ca_certs: str | None = None  # client certificates are checked against these
    ssl_cert_reqs: int = 0  # 0: no client certificate asked for; 1: optional; 2: required
    log_requests: bool = True  # an access-log line (logger trioserve.access, INFO) per HTTP request
    log_stats_interval_s: float | None = 10.0  # a stats line (logger trioserve.stats, INFO) this often (None: off)
    # CORS (vLLM's flags): none allowed by default; "*" allows any origin, method or header.
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        check_types(self)
        _check(isinstance(self.host, str) and self.host != "", "host", "must be an address or host name")
        _check(0 <= self.port <= 65535, "port", "must be in [0, 65535]")
        _check(self.api_key is None or self.api_key.strip() != "", "api_key", "must not be empty")
        _check(
            self.api_key is None or self.api_key == self.api_key.strip(), "api_key", "must not have spaces around it"
        )
        _check(self.max_connections >= 1, "max_connections", "must be >= 1")
        _check(self.max_requests_per_connection >= 1, "max_requests_per_connection", "must be >= 1")
        _check(self.max_message_bytes >= 1024, "max_message_bytes", "must be >= 1024")
        _check(self.outbox_size >= 1, "outbox_size", "must be >= 1")
        _check(
            self.socket_send_buffer_bytes is None or self.socket_send_buffer_bytes >= 1024,
            "socket_send_buffer_bytes",
            "must be >= 1024",
        )
        _check(self.max_http_requests_per_connection >= 1, "max_http_requests_per_connection", "must be >= 1")
        _check(self.model_name is None or self.model_name.strip() != "", "model_name", "must not be empty")
        _check(self.ssl_cert_reqs in (0, 1, 2), "ssl_cert_reqs", "must be 0 (none), 1 (optional) or 2 (required)")
        for name in ("ssl_keyfile", "ssl_ca_certs"):
            _check(getattr(self, name) is None or self.ssl_certfile is not None, name, "needs ssl_certfile")
        _check(
            self.ssl_cert_reqs == 0 or self.ssl_ca_certs is not None,
            "ssl_cert_reqs",
            "needs ssl_ca_certs to check with",
        )
        _check(
            self.tool_call_parser is None or self.tool_call_parser in TOOL_CALL_PARSERS,
            "tool_call_parser",
            f"must be one of {', '.join(sorted(TOOL_CALL_PARSERS))}",
        )
        _check(
            not self.enable_auto_tool_choice or self.tool_call_parser is not None,
            "enable_auto_tool_choice",
            "needs tool_call_parser (--tool-call-parser) to read the model's calls",
        )
        for name in (
            "slow_consumer_timeout_s",
            "handshake_timeout_s",
            "close_timeout_s",
            "idle_timeout_s",
            "keepalive_timeout_s",
        ):
            _check(getattr(self, name) > 0, name, "must be > 0")
        _check(self.shutdown_grace_s >= 0, "shutdown_grace_s", "must be >= 0")
        _check(
            self.log_stats_interval_s is None or self.log_stats_interval_s > 0, "log_stats_interval_s", "must be > 0"
        )
