"""``trioserve chat``: a conversation with the model at the terminal.

Each line the user types becomes a ``user`` message; the whole
conversation is rendered with the model's chat template and the reply is
streamed to the terminal as it is generated, then kept as an
``assistant`` message. ``/reset`` starts over, ``/exit`` or end of input
(Ctrl-D, or no standard input at all) quits. Ctrl-C during a reply stops that reply (it is kept as far
as it went); at the prompt, it quits. A conversation that no longer fits the context is said so,
and the user can ``/reset``. A reply that fails because the engine core died is said so, and the
conversation goes on once the engine has restarted (the session ends only when it is out of restarts).
Standard input or output that fails (a full disk, a terminal gone) ends the session with ``StdioError``.
"""

from __future__ import annotations

import signal
import sys
from typing import TextIO

import trio

from trioserve.api import Engine, open_engine
from trioserve.config import EngineConfig
from trioserve.errors import EngineDeadError, InvalidRequestError, PromptTooLongError, RequestError
from trioserve.frontend.text.chat_template import ChatTemplate
from trioserve.sampling_params import SamplingParams

PROMPT = "> "
HELP = "Type a message and press Enter. /reset starts over, /exit (or Ctrl-D) quits."


class StdioError(Exception):
    """Reading standard input or writing standard output failed for a reason
    other than its end or a reader that has gone (a full disk, a terminal
    gone). The message names the stream and the reason, in one line."""


def write_out(out: TextIO, text: str) -> None:
    """Write ``text`` to ``out`` and flush it. ``StdioError`` naming the
    stream when that fails; ``BrokenPipeError`` (whoever read it stopped:
    ``| head``) is raised as it is."""
    try:
        out.write(text)
        out.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        name = str(getattr(out, "name", "the output")).strip("<>")  # "<stdout>" -> "stdout"
        raise StdioError(f"cannot write to {name}: {exc.strerror or exc}") from None


class Conversation:
    """The messages so far. Plain state, no I/O."""

    def __init__(self, system: str | None = None) -> None:
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [] if self.system is None else [{"role": "system", "content": self.system}]

    def ask(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    def answer(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})

    def forget_last_question(self) -> None:
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()


async def run_chat(
    config: EngineConfig, params: SamplingParams, system: str | None = None, out: TextIO = sys.stdout
) -> None:
    """Start an engine and chat until end of input or ``/exit``. If
    cancelled (Ctrl-C), the reply in progress is aborted and the engine
    stopped. A model without a chat template is refused before it loads.
    ``StdioError`` when standard input or ``out`` fails."""
    await trio.to_thread.run_sync(_check_chat_template, config.model)
    async with open_engine(config=config) as engine:
        conversation = Conversation(system)
        write_out(out, HELP + "\n")
        while True:
            line = await _read_line()
            if line is None or line.strip() == "/exit":
                break
            if line.strip() == "/reset":
                conversation.reset()
                write_out(out, "(conversation reset)\n")
            elif line.strip():
                conversation.ask(line.strip())
                await _interruptible_reply(engine, conversation, params, out)
    write_out(out, "\n")


def _check_chat_template(model: str) -> None:
    """``ValueError`` when ``model`` has no chat template (a directory that
    cannot be read is left to ``open_engine``, which names what is wrong)."""
    try:
        template = ChatTemplate.from_dir(model)
    except (OSError, ValueError):
        return
    if template is None:
        raise ValueError(
            f"--model: {model} has no chat template (chat_template.jinja, or chat_template in "
            "tokenizer_config.json), so it cannot chat; `trioserve generate PROMPT` completes text"
        )


async def _read_line() -> str | None:
    """A line from standard input (None at its end, or when there is no
    standard input: ``<&-``). ``StdioError`` when reading it fails. If
    cancelled, the reading thread is abandoned."""

    def read() -> str | None:
        if sys.stdin is None or sys.stdin.closed:
            return None
        try:
            return input(PROMPT)
        except EOFError:
            return None
        except BrokenPipeError:  # the reader of the prompt (on stdout) has gone
            raise
        except OSError as exc:
            raise StdioError(f"cannot read from stdin: {exc.strerror or exc}") from None

    return await trio.to_thread.run_sync(read, abandon_on_cancel=True)


async def _interruptible_reply(engine: Engine, conversation: Conversation, params: SamplingParams, out: TextIO) -> None:
    """``_reply``, stopped early (the request aborted) by Ctrl-C."""
    reply_scope = trio.CancelScope()
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def stop_on_ctrl_c() -> None:
                async for _ in signals:
                    reply_scope.cancel()

            nursery.start_soon(stop_on_ctrl_c)
            await _reply(engine, conversation, params, out, reply_scope)
            nursery.cancel_scope.cancel()


async def _reply(
    engine: Engine, conversation: Conversation, params: SamplingParams, out: TextIO, scope: trio.CancelScope
) -> None:
    """Stream the model's reply to ``out`` and keep it in the conversation.
    If ``scope`` is cancelled, the request is aborted and the reply is kept
    as far as it went."""
    text = ""
    try:
        prompt = await engine.render_chat(conversation.messages)
        with scope:
            async with engine.stream(prompt, params) as stream:
                async for delta in stream:
                    write_out(out, delta.text)
                    text += delta.text
    except (PromptTooLongError, InvalidRequestError) as exc:
        conversation.forget_last_question()
        hint = " (/reset to start over)" if isinstance(exc, PromptTooLongError) else ""
        write_out(out, f"[{exc}{hint}]\n")
        return
    except (EngineDeadError, RequestError) as exc:
        if engine.health == "failed":  # out of restarts: the session is over (exit 4)
            raise
        conversation.forget_last_question()  # the engine restarts: the question can be asked again
        lead = "\n" if text else ""  # end the reply cut short first
        write_out(out, f"{lead}[{exc}; ask again]\n")
        return
    if scope.cancelled_caught:
        write_out(out, " [stopped]")
    write_out(out, "\n")
    conversation.answer(text)
