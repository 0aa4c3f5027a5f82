"""``serve``'s server options and the ``ServerConfig`` built from them."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from trioserve.cli.engine import DEFAULT_MODEL_SERVED_NAME, model_argument
from trioserve.server import ServerConfig
from trioserve.server.tls import server_context
from trioserve.server.tool_calls import TOOL_CALL_PARSERS

API_KEY_ENV = "TRIOSERVE_API_KEY"  # never passed on to a child process (nurseries.supervision.process.SECRET_ENV_NAMES)


def add_server_options(parser: argparse.ArgumentParser) -> None:
    defaults = ServerConfig()
    group = parser.add_argument_group("server")
    group.add_argument(
        "--host",
        default=defaults.host,
        help="address to listen on (default: %(default)s, this machine only; 0.0.0.0 for every interface)",
    )
    group.add_argument(
        "--port", type=int, default=defaults.port, help="TCP port; 0 picks a free one (default: %(default)s)"
    )
    keys = group.add_mutually_exclusive_group()
    keys.add_argument(
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every WebSocket handshake and API request (/v1; not "
        "/health or /metrics). A key on the command line shows "
        "in ps: prefer --api-key-file or $TRIOSERVE_API_KEY (default: $TRIOSERVE_API_KEY, else no key)",
    )
    keys.add_argument(
        "--api-key-file",
        metavar="FILE",
        help="read the API key from FILE (its first line; keep the file readable by you alone)",
    )
    group.add_argument(
        "--max-connections",
        type=int,
        default=defaults.max_connections,
        metavar="N",
        help="TCP connections served at once; more get HTTP 503 with Retry-After, while GET /health still answers "
        "(default: %(default)s: far more than a GPU serves at once, since one connection carries many requests, "
        "yet a bounded fd and memory budget; the open-files limit is raised to fit when the hard limit allows)",
    )
    group.add_argument(
        "--idle-timeout",
        type=float,
        default=defaults.idle_timeout_s,
        metavar="SECONDS",
        help="close a WebSocket with code 4408 after this long with no request in flight and no message from the "
        "client; pings do not count; inf: never (default: %(default)s, to free the slots of clients that vanished "
        "without closing, while a client between two requests rarely waits that long)",
    )
    group.add_argument(
        "--handshake-timeout",
        type=float,
        default=defaults.handshake_timeout_s,
        metavar="SECONDS",
        help="drop a connection that has not sent its HTTP request head and finished the WebSocket handshake this "
        "long after it was accepted (default: %(default)s, ample for a slow link, short for a silent client)",
    )
    group.add_argument(
        "--max-requests-per-connection",
        type=int,
        default=defaults.max_requests_per_connection,
        metavar="N",
        help="requests one connection may have in flight (default: %(default)s)",
    )
    group.add_argument(
        "--max-message-bytes",
        type=int,
        default=defaults.max_message_bytes,
        metavar="BYTES",
        help="a larger client message closes its connection with code 1009 (default: %(default)s)",
    )
    group.add_argument(
        "--slow-consumer-timeout",
        type=float,
        default=defaults.slow_consumer_timeout_s,
        metavar="SECONDS",
        help="end a client's requests when it reads nothing for this long, and drop it after as long again "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--shutdown-grace",
        type=float,
        default=defaults.shutdown_grace_s,
        metavar="SECONDS",
        help="on SIGINT/SIGTERM, time for requests in flight to finish (default: %(default)s)",
    )
    group.add_argument(
        "--keepalive-timeout",
        type=float,
        default=defaults.keepalive_timeout_s,
        metavar="SECONDS",
        help="close an HTTP connection that sends no new request for this long after a response (default: %(default)s)",
    )
    group.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        metavar="M",
        help="API-server processes sharing the port, each connected to every engine core, for when one process's "
        "tokenizing and streaming is the bottleneck; with M > 1, serve itself only supervises them and the engine "
        "cores (docs/deployment.md; default: %(default)s)",
    )
    group.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="the model's names in the OpenAI API: requests may give any of them as 'model', responses carry the "
        "first, /v1/models lists each (default: the model as given: a Hugging Face id, a .gguf file's name, or the "
        "model directory's name)",
    )
    group.add_argument(
        "--root-path",
        default="",
        metavar="PATH",
        help="a path prefix a proxy in front leaves on requests (/api with /api/v1/models): taken off (vLLM's flag)",
    )
    logs = parser.add_argument_group("logs")
    logs.add_argument(
        "--disable-log-requests",
        "--disable-uvicorn-access-log",
        dest="log_requests",
        action="store_false",
        help="no access-log line per request (by default: method, path, status, duration, tokens, request id)",
    )
    logs.add_argument(
        "--enable-log-requests", dest="log_requests", action="store_true", help="the access log (the default)"
    )
    logs.add_argument("--disable-log-stats", dest="log_stats", action="store_false", help="no periodic stats line")
    logs.add_argument(
        "--log-stats-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how often the stats line is logged, when something happened (default: %(default)s)",
    )
    group.add_argument(
        "--strict-fields",
        action="store_true",
        help="refuse (400) a request field the API does not know; by default it is ignored, with a warning line "
        "per field name, as OpenAI-compatible servers do",
    )
    tools = parser.add_argument_group("tool calling (vLLM's flags)")
    tools.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto" (the default with tools): the model decides, and its calls are read from its '
        'output by --tool-call-parser; "required" and a named function are served without it',
    )
    tools.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_CALL_PARSERS),
        default=None,
        help="the model's format of call: hermes (<tool_call>{...}</tool_call>: Hermes, Qwen 2.5 and 3) or "
        "llama3_json (JSON objects: Llama 3.1 to 3.3)",
    )
    tls = parser.add_argument_group("TLS (vLLM's flags): with a certificate the port serves HTTPS and WSS only")
    tls.add_argument("--ssl-certfile", metavar="FILE", help="the server's certificate chain (PEM)")
    tls.add_argument("--ssl-keyfile", metavar="FILE", help="its private key (PEM; default: in --ssl-certfile)")
    tls.add_argument("--ssl-ca-certs", metavar="FILE", help="certificate authorities to check client certificates with")
    tls.add_argument(
        "--ssl-cert-reqs",
        type=int,
        choices=(0, 1, 2),
        default=0,
        help="client certificates: 0 not asked for (default), 1 optional, 2 required (needs --ssl-ca-certs)",
    )
    cors = parser.add_argument_group("CORS (vLLM's flags; off unless --allowed-origins is given)")
    cors.add_argument(
        "--allowed-origins",
        type=_names_list,
        default=(),
        metavar="LIST",
        help='origins a browser may call from: a JSON list (\'["https://ui.example"]\') or a comma list; "*" for any',
    )
    cors.add_argument("--allowed-methods", type=_names_list, default=("*",), metavar="LIST", help='default: "*"')
    cors.add_argument("--allowed-headers", type=_names_list, default=("*",), metavar="LIST", help='default: "*"')
    cors.add_argument("--allow-credentials", action="store_true", help="answer with Access-Control-Allow-Credentials")
    group.add_argument(
        "--special-tokens-in-content",
        action="store_true",
        help="let the text of a special token in a chat message's content (<|im_end|>) become that token, as "
        "transformers does; by default it stays text, so that a user cannot end their turn and write another role's",
    )


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The server's config; ``ValueError`` naming the option that cannot be used (a TLS file is read here, so
    that a bad one ends the command before anything starts)."""
    names = list(dict.fromkeys(args.served_model_name or []))
    config = ServerConfig(
        host=args.host,
        port=args.port,
        api_key=_api_key(args),
        max_connections=args.max_connections,
        idle_timeout_s=args.idle_timeout,
        handshake_timeout_s=args.handshake_timeout,
        max_requests_per_connection=args.max_requests_per_connection,
        max_message_bytes=args.max_message_bytes,
        slow_consumer_timeout_s=args.slow_consumer_timeout,
        shutdown_grace_s=args.shutdown_grace,
        keepalive_timeout_s=args.keepalive_timeout,
        model_name=names[0] if names else _served_name(model_argument(args)),
        model_aliases=tuple(names[1:]),
        root_path=args.root_path.rstrip("/"),
        special_tokens_in_content=args.special_tokens_in_content,
        strict_fields=args.strict_fields,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        log_requests=args.log_requests,
        log_stats_interval_s=args.log_stats_interval if args.log_stats else None,
        allowed_origins=args.allowed_origins,
        allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers,
        allow_credentials=args.allow_credentials,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
    )
    if config.ssl_certfile is not None:
        server_context(config.ssl_certfile, config.ssl_keyfile, ca_certs=config.ssl_ca_certs)
    return config


def _names_list(text: str) -> tuple[str, ...]:
    """A JSON list of strings (vLLM's form) or a comma-separated list."""
    if text.lstrip().startswith("["):
        try:
            value = json.loads(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a JSON list: {text[:80]!r}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"must be a JSON list of strings: {text[:80]!r}")
        return tuple(value)
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _served_name(given: str | None) -> str | None:
    """The API's name for the model given (None: its directory's name)."""
    if given is None:
        return DEFAULT_MODEL_SERVED_NAME
    path = Path(given)
    if path.is_dir():
        return None
    return path.stem if path.suffix == ".gguf" else given  # a Hugging Face id, as vLLM names it


def _api_key(args: argparse.Namespace) -> str | None:
    """The key from ``--api-key``, ``--api-key-file`` or ``$TRIOSERVE_API_KEY``,
    in that order; None when none is given. An empty key is an error, not "no
    key": ``--api-key "$KEY"`` with ``KEY`` unset must not turn authentication off."""
    if args.api_key is not None:
        key, source = args.api_key, "--api-key"
    elif args.api_key_file is not None:
        try:
            key, source = Path(args.api_key_file).read_text().partition("\n")[0].strip(), "--api-key-file"
        except OSError as exc:
            raise ValueError(f"--api-key-file: cannot read {args.api_key_file!r}: {exc.strerror or exc}") from None
    elif API_KEY_ENV in os.environ:
        key, source = os.environ[API_KEY_ENV], f"${API_KEY_ENV}"
    else:
        return None
    key = str(key)
    if key.strip() == "":
        raise ValueError(f"{source}: the API key is empty (unset the option to serve without a key)")
    return key
