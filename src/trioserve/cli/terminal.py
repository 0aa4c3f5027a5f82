"""``trioserve generate`` and ``trioserve chat``: an engine for the
terminal, stopped when done (or by a signal)."""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from trioserve.api import open_engine
from trioserve.chat import StdioError, run_chat, write_out
from trioserve.cli.engine import command_engine_config
from trioserve.cli.exits import EXIT_OK, EXIT_SIGNALLED_BASE
from trioserve.config import EngineConfig
from trioserve.engine_options import add_engine_options
from trioserve.errors import EngineDeadError, RequestError
from trioserve.nurseries.supervision.oneshot import until_stop_signal
from trioserve.sampling_params import SamplingParams
from trioserve.stdio import say


def add_generate_parser(commands: Any) -> None:
    """``trioserve generate PROMPT``, in an ``add_subparsers()`` object."""
    generate = commands.add_parser(
        "generate",
        help="generate text for one prompt, streamed to the terminal",
        description="Start an engine, stream the completion of PROMPT to stdout, then stop the engine.",
    )
    generate.add_argument("prompt", metavar="PROMPT", help="the text to complete")
    add_engine_options(generate)
    _add_sampling_options(generate)
    generate.set_defaults(func=cmd_generate)


def add_chat_parser(commands: Any) -> None:
    """``trioserve chat``, in an ``add_subparsers()`` object."""
    chat = commands.add_parser(
        "chat",
        help="chat with a model at the terminal, replies streamed",
        description="Start an engine and chat with its model: type a message and press Enter; the reply streams "
        "in. Messages are rendered with the model's own chat template. /reset starts over; Ctrl-D or /exit quits.",
    )
    chat.add_argument("--system", metavar="TEXT", help="a system message to open the conversation with")
    add_engine_options(chat)
    _add_sampling_options(chat, max_tokens=512)
    chat.set_defaults(func=cmd_chat)


def cmd_generate(args: argparse.Namespace) -> int:
    _check_stdout()
    config = command_engine_config(args)
    params = _sampling_params(args)
    return _one_shot(functools.partial(_generate, config, args.prompt, params))


def cmd_chat(args: argparse.Namespace) -> int:
    _check_stdout()
    config = command_engine_config(args)
    params = _sampling_params(args)
    return _one_shot(functools.partial(run_chat, config, params, args.system, sys.stdout))


def _add_sampling_options(parser: argparse.ArgumentParser, *, max_tokens: int = 64) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate (default: %(default)s)")
    group.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default: %(default)s)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: off)")
    group.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (default: off)")
    group.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top one (default: off)")
    group.add_argument("--seed", type=int, default=None, help="make sampling reproducible")
    group.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop at this text (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


async def _generate(config: EngineConfig, prompt: str, params: SamplingParams) -> None:
    async with open_engine(config=config) as engine:
        started = time.perf_counter()
        final = None
        try:
            async with engine.stream(prompt, params) as stream:
                async for out in stream:
                    write_out(sys.stdout, out.text)
                    final = out
        except EngineDeadError as exc:
            # The supervisor decides once the engine core has exited (well within a second of its
            # death): out of restarts, the engine fails for good (exit 4); else only this request did.
            with trio.move_on_after(1.0):
                raise await engine.wait_failed() from None
            raise RequestError(f"the request failed: {exc}") from None
        elapsed = time.perf_counter() - started
    write_out(sys.stdout, "\n")
    assert final is not None
    say(f"[{final.num_output_tokens} tokens in {elapsed:.2f}s, finish reason: {final.finish_reason}]")


def _check_stdout() -> None:
    """``StdioError`` when there is no standard output (``>&-``): nothing to
    write a reply to, so no engine is started."""
    if sys.stdout is None:
        raise StdioError("cannot write to stdout: it is closed")


def _one_shot(main: Callable[[], Awaitable[None]]) -> int:
    """``generate`` and ``chat``: exit 0 when done, 143 after a SIGTERM and
    129 after a SIGHUP (the engine stopped in order first)."""
    if (signum := trio.run(until_stop_signal, main)) is not None:
        say(f"\ntrioserve: {signum.name}: stopped")
        return EXIT_SIGNALLED_BASE + signum
    return EXIT_OK
