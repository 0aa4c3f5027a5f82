"""Stream a completion from a running ``trioserve serve`` over WebSocket.

    .venv/bin/trioserve serve                      # in one terminal
    .venv/bin/python examples/stream_client.py "Once upon a time"

Several prompts run at once on the one connection; each is printed when it
ends (a single prompt is streamed to the terminal as it arrives). The
protocol is in docs/websocket-protocol.md. Uses trio-websocket, which
trioserve already depends on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import trio
from trio_websocket import ConnectionClosed, ConnectionRejected, HandshakeError, open_websocket_url


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="text to complete (give several to multiplex)")
    parser.add_argument("--url", default="ws://127.0.0.1:8000", help="the server (default: %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("TRIOSERVE_API_KEY"), help="default: $TRIOSERVE_API_KEY")
    parser.add_argument("--max-tokens", type=int, default=64, help="default: %(default)s")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    return parser.parse_args(argv)


async def stream(args: argparse.Namespace) -> int:
    """Send every prompt, print what comes back; the exit status is 1 if any request ended with an error."""
    headers = [(b"Authorization", f"Bearer {args.api_key}".encode())] if args.api_key else []
    live = len(args.prompts) == 1
    texts = {f"p{i}": "" for i in range(len(args.prompts))}
    failed = False
    async with open_websocket_url(args.url, extra_headers=headers) as ws:
        for request_id, prompt in zip(texts, args.prompts, strict=True):
            params = {"max_tokens": args.max_tokens, "temperature": args.temperature}
            message = {"type": "generate", "id": request_id, "prompt": prompt, "params": params}
            await ws.send_message(json.dumps(message))
        pending = set(texts)
        while pending:
            msg = json.loads(await ws.get_message())
            request_id = msg["id"]
            if request_id not in pending:  # about no request of ours
                print(f"server: {msg}", file=sys.stderr)
                continue
            if msg["type"] == "delta":
                texts[request_id] += msg["text"]
                if live:
                    print(msg["text"], end="", flush=True)
                continue
            pending.discard(request_id)
            if msg["type"] == "done":
                ending = f"[{msg['usage']['completion_tokens']} tokens, finish reason: {msg['finish_reason']}]"
            else:
                failed = True
                ending = f"[error {msg['code']}: {msg['message']}]"
            if live:
                print(f"\n{ending}", file=sys.stderr)
            else:
                print(f"--- {args.prompts[int(request_id[1:])]!r} {ending}\n{texts[request_id]}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return trio.run(stream, args)
    except ConnectionRejected as exc:  # 401: a missing or wrong API key; 503: not ready
        body = (exc.body or b"").decode(errors="replace").strip()
        print(f"the server refused the connection: HTTP {exc.status_code} {body}", file=sys.stderr)
    except HandshakeError as exc:
        reason = exc.__cause__ or exc
        print(f"cannot connect to {args.url}: {reason!r} (is `trioserve serve` running?)", file=sys.stderr)
    except ConnectionClosed as exc:
        print(f"the server closed the connection: {exc.reason}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
