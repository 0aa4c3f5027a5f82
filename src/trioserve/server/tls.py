"""TLS for the server's port (vLLM's ``--ssl-keyfile``, ``--ssl-certfile``,
``--ssl-ca-certs``, ``--ssl-cert-reqs``): the ``ssl.SSLContext`` each
accepted connection is wrapped in (``trio.SSLStream``), so HTTP, server-sent
events and WebSockets all go over it (``https://``, ``wss://``).

The files are read once, when the server is built: a file that is missing,
unreadable or not a certificate or key is an error naming it then, before
anything listens. A client that fails the handshake (plain HTTP on the TLS
port, an unknown certificate authority) is dropped, with one debug line.
"""

from __future__ import annotations

import ssl

CERT_REQS = {0: ssl.CERT_NONE, 1: ssl.CERT_OPTIONAL, 2: ssl.CERT_REQUIRED}  # vLLM's --ssl-cert-reqs values


def server_context(
    certfile: str, keyfile: str | None, *, ca_certs: str | None = None, cert_reqs: int = 0
) -> ssl.SSLContext:
    """A server context holding ``certfile``'s chain and ``keyfile``'s key
    (None: the key is in ``certfile``); with ``ca_certs``, client
    certificates are checked against those authorities, asked for
    (``cert_reqs`` 1) or required (2). Raises ``ValueError`` naming the
    option whose file cannot be used."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(
            f"--ssl-certfile {certfile!r} / --ssl-keyfile {keyfile!r}: cannot load the certificate and key: "
            f"{_reason(exc)}"
        ) from None
    if ca_certs is not None:
        try:
            context.load_verify_locations(ca_certs)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"--ssl-ca-certs {ca_certs!r}: cannot load the certificates: {_reason(exc)}") from None
    context.verify_mode = CERT_REQS[cert_reqs]
    return context


def _reason(exc: OSError | ssl.SSLError) -> str:
    return exc.strerror if isinstance(exc, OSError) and not isinstance(exc, ssl.SSLError) and exc.strerror else str(exc)
