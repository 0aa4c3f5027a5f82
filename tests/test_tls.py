"""TLS on the server's port (``--ssl-certfile``/``--ssl-keyfile``): the
official client over HTTPS, a WebSocket over WSS and ``/health``, all with a
certificate of a test authority (trustme); a client that speaks plain HTTP
to the port, or stops in the handshake, is dropped and the server serves
on; a required client certificate; a file that cannot be used ends
``serve`` at once, naming its option."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import sys
import urllib.request

import openai
import pytest
import trio
import trustme
from helpers.fakes import SERVING
from helpers.server import collect, generate, open_ws, serving
from helpers.waiting import in_thread

pytestmark = pytest.mark.fake_config(**SERVING)

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def authority() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def cert_files(authority, tmp_path) -> dict[str, str]:
    cert = authority.issue_cert("127.0.0.1", "localhost")
    files = {"ssl_certfile": tmp_path / "cert.pem", "ssl_keyfile": tmp_path / "key.pem"}
    cert.private_key_pem.write_to_path(str(files["ssl_keyfile"]))
    for blob in cert.cert_chain_pems:
        blob.write_to_path(str(files["ssl_certfile"]), append=True)
    return {name: str(path) for name, path in files.items()}


def client_context(authority: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context()
    authority.configure_trust(context)
    return context


async def test_https_wss_and_health_with_a_certificate_and_a_plain_http_client_is_dropped(
    fake_config, authority, cert_files
):
    trusted = client_context(authority)
    with trio.fail_after(60):
        async with serving(fake_config(), model_name=MODEL, **cert_files) as server:
            assert server.http_url.startswith("https://") and server.url.startswith("wss://")
            api = openai.OpenAI(
                base_url=server.http_url,
                api_key="unused",
                max_retries=0,
                timeout=20,
                http_client=openai.DefaultHttpxClient(verify=trusted),
            )
            reply = await in_thread(lambda: api.completions.create(model=MODEL, prompt="hi", max_tokens=3))
            assert reply.choices[0].finish_reason == "length"
            streamed = await in_thread(
                lambda: list(api.completions.create(model=MODEL, prompt="hi", max_tokens=3, stream=True))
            )
            assert "".join(c.choices[0].text for c in streamed if c.choices) == reply.choices[0].text
            health = await in_thread(lambda: urllib.request.urlopen(server.health_url, context=trusted).read())
            assert json.loads(health)["status"] == "ready"

            def over_wss() -> str:
                with open_ws(server.url, ssl=trusted) as ws:
                    ws.send(generate("a", "hi", max_tokens=3))
                    return collect(ws, {"a"})[0]["a"].terminal["type"]  # type: ignore[index]

            assert await in_thread(over_wss) == "done"

            def plain_http() -> bytes:
                with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                    try:
                        return sock.recv(1024)
                    except ConnectionResetError:
                        return b""

            assert not (await in_thread(plain_http)).startswith(b"HTTP/")  # no answer in the clear
            untrusted = openai.OpenAI(base_url=server.http_url, api_key="unused", max_retries=0, timeout=10)
            with pytest.raises(openai.APIConnectionError):  # the client does not know the authority
                await in_thread(untrusted.models.list)
            again = await in_thread(lambda: api.completions.create(model=MODEL, prompt="hi", max_tokens=3))
            assert again.choices[0].text == reply.choices[0].text


async def test_a_required_client_certificate_is_asked_for_and_checked(fake_config, authority, cert_files, tmp_path):
    clients = trustme.CA()  # the authority of the clients' certificates
    clients.cert_pem.write_to_path(str(tmp_path / "clients.pem"))
    options = {**cert_files, "ssl_ca_certs": str(tmp_path / "clients.pem"), "ssl_cert_reqs": 2}
    with trio.fail_after(60):
        async with serving(fake_config(), model_name=MODEL, **options) as server:
            without = client_context(authority)
            with_cert = client_context(authority)
            clients.issue_cert("client@example").configure_cert(with_cert)
            assert await in_thread(lambda: urllib.request.urlopen(server.health_url, context=with_cert).status) == 200
            with pytest.raises(OSError):  # ssl.SSLError, or the connection reset by the server
                await in_thread(lambda: urllib.request.urlopen(server.health_url, context=without, timeout=10).read())


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (["--ssl-certfile", "{tmp}/missing.pem"], "--ssl-certfile"),
        (["--ssl-certfile", "{tmp}/notacert.pem"], "--ssl-certfile"),
        (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{key}", "--ssl-ca-certs", "{tmp}/nope.pem"], "--ssl-ca-certs"),
        (["--ssl-keyfile", "{key}"], "ssl_keyfile: needs ssl_certfile"),
    ],
)
def test_a_tls_file_that_cannot_be_used_ends_serve_at_once_naming_its_option(
    tiny_model_dir, cert_files, tmp_path, options, named
):
    (tmp_path / "notacert.pem").write_text("hello\n")
    values = {"tmp": str(tmp_path), "cert": cert_files["ssl_certfile"], "key": cert_files["ssl_keyfile"]}
    argv = [sys.executable, "-m", "trioserve.cli", "serve", "--port", "0", "--runner", "fake"]
    argv += ["--model", str(tiny_model_dir("llama")), *(o.format(**values) for o in options)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert named in done.stderr and "Traceback" not in done.stderr, done.stderr
