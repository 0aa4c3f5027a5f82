"""A model's chat template: messages to the prompt text the model was trained on.

The template is the model's own Jinja template, from ``chat_template.jinja``
in the model directory, else ``chat_template`` in ``tokenizer_config.json``
(a string, or a list of named templates: the one named ``default``). It is
rendered as transformers renders it, in an immutable sandboxed Jinja
environment (a template cannot touch Python objects or change its inputs),
with ``trim_blocks`` and ``lstrip_blocks``, loop controls, the
``{% generation %}`` block (its text is rendered as it stands), a ``tojson``
filter that keeps non-ASCII text (with transformers' ``indent``,
``separators`` and ``sort_keys``), and the globals ``raise_exception`` and
``strftime_now``; the variables are ``messages``, ``add_generation_prompt``,
``tools`` and ``documents`` when given, ``bos_token``, ``eos_token`` (and the
other special tokens named in tokenizer_config.json), and a request's own
(``chat_template_kwargs``). No transformers, so no torch.

A template is the model's code, run on a client's messages, so a render is
bounded: it is stopped after ``RENDER_TIMEOUT_S`` (an exception raised in
the rendering thread), ``*``, ``+`` and ``**`` refuse to build a value of
more than ``MAX_VALUE_SIZE`` elements (or an integer of more bits), and the
text stops growing at the caller's ``max_chars``. Any failure of the
template on the messages is an ``InvalidRequestError`` naming ``messages``;
the template's text is never a crash of its caller. (It can still allocate
through filters such as ``center``; those are the model's to get right.)

transformers' own renderer (``chat_template_utils``, torch-free) gives the
same texts at about the same speed, but has none of these bounds, and its
import costs each API server 1.7 s and 53 MiB (``scripts/compare_chat_templates.py``).

The rendered text already holds the model's special tokens, so it is
tokenized without adding any (``TemplatedText``), as transformers'
``apply_chat_template`` does.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import json
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox

from trioserve.errors import InvalidRequestError, PromptTooLongError

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
# Variables a request's chat_template_kwargs may not set: the render's own, and the special tokens'.
_RESERVED = frozenset({"messages", "add_generation_prompt", "continue_final_message", "tools", "documents"}).union(
    _SPECIAL_TOKENS
)

RENDER_THREADS = 2  # rendering threads per engine at once
RENDER_TIMEOUT_S = 5.0  # a render of the largest request a server takes is well under 1 s
MAX_VALUE_SIZE = 1 << 24  # elements of a string or list that *, + or ** may build; bits of an integer


class TemplatedText(str):
    """Prompt text rendered from a chat template: it holds its special tokens
    already, so the engine tokenizes it without adding any."""

    __slots__ = ()


class TemplateError(Exception):
    """The template raised (``raise_exception``) or failed while rendering."""


class ChatTemplate:
    """One model's compiled chat template. Rendering is synchronous and
    touches nothing but its arguments."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        self.source = source
        self._special_tokens = dict(special_tokens or {})
        self._template = _environment().from_string(source)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The template of the model in ``model_dir``, or None when it has
        none. Raises ``ValueError`` naming the file when one is unreadable
        or does not compile."""
        directory = Path(model_dir)
        config = _read_config(directory / TOKENIZER_CONFIG_FILE)
        source = _template_source(directory, config)
        if source is None:
            return None
        try:
            return cls(source, _special_tokens(config))
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"{directory}: the chat template does not compile: {exc}") from None

    @classmethod
    def from_source(cls, source: str, model_dir: str | Path) -> ChatTemplate:
        """A template given by the operator (``--chat-template``), with the
        special tokens the model in ``model_dir`` names. Raises
        ``ValueError`` when it does not compile."""
        config = _read_config(Path(model_dir) / TOKENIZER_CONFIG_FILE)
        try:
            return cls(source, _special_tokens(config))
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat_template (--chat-template) does not compile: {exc}") from None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        max_chars: int = MAX_VALUE_SIZE,
        timeout_s: float | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> TemplatedText:
        """The prompt for ``messages`` (each a mapping with ``role`` and
        ``content``), ending with the assistant's turn opened when
        ``add_generation_prompt``, or with the last message's text left open
        for the model to continue when ``continue_final_message`` (the text
        is cut after that message's content, as transformers cuts it).
        ``tools`` and ``documents`` are the template's ``tools`` and
        ``documents``; ``variables`` (a request's ``chat_template_kwargs``,
        such as ``enable_thinking``) are more of its variables.

        Raises ``InvalidRequestError`` naming ``messages`` when the template
        refuses them, fails on them or takes longer than ``timeout_s``
        (default ``RENDER_TIMEOUT_S``), naming ``chat_template_kwargs`` for a
        variable the engine sets itself, and naming ``continue_final_message``
        when it is set with ``add_generation_prompt`` or the last message's
        text is not in the prompt as it stands; ``PromptTooLongError`` when
        the text grows beyond ``max_chars``. Runs in the calling thread."""
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message", "cannot be set with add_generation_prompt (a new turn, not the last one)"
            )
        names = {"messages": [dict(m) for m in messages], "add_generation_prompt": add_generation_prompt}
        if tools is not None:
            names["tools"] = [dict(t) for t in tools]
        if documents is not None:
            names["documents"] = [dict(d) for d in documents]
        for name in variables or {}:
            if name in _RESERVED or name in self._special_tokens:
                raise InvalidRequestError("chat_template_kwargs", f"{name!r} is set by the server, not by a request")
        text = self._generate({**(variables or {}), **names, **self._special_tokens}, max_chars, timeout_s)
        return TemplatedText(_open_final_message(text, messages) if continue_final_message else text)

    def _generate(self, names: dict[str, Any], max_chars: int, timeout_s: float | None) -> str:
        timeout_s = RENDER_TIMEOUT_S if timeout_s is None else timeout_s
        pieces: list[str] = []
        size = 0
        try:
            with _interrupted_after(timeout_s):
                for piece in self._template.generate(names):
                    pieces.append(piece)
                    size += len(piece)
                    if size > max_chars:
                        raise PromptTooLongError(
                            "messages", f"the model's chat template makes more than {max_chars} characters of them"
                        )
        except _RenderTimeout:
            raise InvalidRequestError(
                "messages", f"the model's chat template took longer than {timeout_s:g} s on them"
            ) from None
        except TemplateError as exc:
            raise InvalidRequestError("messages", f"the model's chat template refused them: {exc}") from None
        except InvalidRequestError:
            raise
        except Exception as exc:  # the template is code: whatever it raises is its failure on these messages
            reason = str(exc) or type(exc).__name__
            raise InvalidRequestError("messages", f"the model's chat template failed on them: {reason}") from None
        if size == 0:
            raise InvalidRequestError("messages", "the model's chat template renders nothing for them")
        return "".join(pieces)


def _open_final_message(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """``text`` cut right after the last message's content (or that content
    stripped, for templates that strip it), so that the model continues it."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise InvalidRequestError("continue_final_message", "the last message has no text to continue")
    for content in (final, final.strip()):
        if (at := text.rfind(content)) >= 0:
            return text[: at + len(content)]
    raise InvalidRequestError(
        "continue_final_message", "the model's chat template does not write the last message's text as it stands"
    )


class _RenderTimeout(Exception):
    """Raised in a rendering thread from outside when its time is up."""


@contextlib.contextmanager
def _interrupted_after(seconds: float) -> Iterator[None]:
    """Raise ``_RenderTimeout`` in this thread if the block is still running
    after ``seconds``: at the next Python instruction it runs (a template
    runs no long C call of its own; the size limits keep those short).
    Once the block has ended, no exception can arrive, however close the
    race: a pending one is cleared."""
    deadline = _WATCHDOG.arm(seconds)
    try:
        yield
    finally:
        while True:  # an exception that arrives during this cleanup is caught, and the cleanup done again
            try:
                deadline.disarm()
                break
            except _RenderTimeout:
                continue


@dataclasses.dataclass(slots=True)
class _Deadline:
    """One render's deadline. Its ``claim`` lock is taken once, by whichever
    comes first: the rendering thread, done in time (then the watchdog never
    fires it), or the watchdog, firing it. A lock's non-blocking acquire is
    one atomic step, so the rendering thread, which an exception from the
    watchdog may interrupt between any two Python instructions, never holds a
    lock across them (a ``with`` on a lock, interrupted just after taking it,
    would leave it taken: every later render and the watchdog would wait
    for ever)."""

    at: float  # time.monotonic()
    thread_id: int
    claim: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    done: bool = False  # the rendering thread took the claim: never to fire
    sent: bool = False  # the watchdog took it, and has raised the exception in the thread

    def disarm(self) -> None:
        """After this no exception from this deadline reaches its thread: one
        raised already, or pending, is cleared. Run by the rendering thread."""
        if self.claim.acquire(False):
            self.done = True
            return
        while not self.sent:  # the watchdog is firing it: wait until it has, then clear what is pending
            time.sleep(0)
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread_id), None)


class _Watchdog:
    """One thread for the process that raises ``_RenderTimeout`` in each
    rendering thread whose deadline passes (a thread per render cost more
    than most renders: 0.3 ms). Arming takes a lock (no deadline of the
    arming thread is live then); disarming takes none (``_Deadline``); the
    thread is woken only when a new deadline is the earliest, and forgets
    the deadlines done in time when it wakes."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forgets every deadline and the thread (in a forked child, which has no such thread)."""
        self._cond = threading.Condition()
        self._armed: list[_Deadline] = []
        self._earliest = math.inf  # what the thread is waiting for
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float) -> _Deadline:
        deadline = _Deadline(time.monotonic() + seconds, threading.get_ident())
        with self._cond:
            self._armed.append(deadline)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="chat-template-watchdog", daemon=True)
                self._thread.start()
            elif deadline.at < self._earliest:
                self._cond.notify()
        return deadline

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                live = []
                for deadline in self._armed:
                    if deadline.done:
                        continue
                    if deadline.at > now:
                        live.append(deadline)
                    elif deadline.claim.acquire(False):  # not done in time: fire it
                        exc = ctypes.py_object(_RenderTimeout)
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(deadline.thread_id), exc)
                        deadline.sent = True
                self._armed = live
                self._earliest = min((d.at for d in live), default=math.inf)
                self._cond.wait(None if not live else self._earliest - now)


_WATCHDOG = _Watchdog()
os.register_at_fork(after_in_child=_WATCHDOG.reset)


class _BoundedEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The sandbox, with ``*``, ``+`` and ``**`` refusing enormous values."""

    intercepted_binops = frozenset({"*", "+", "**"})

    def call_binop(self, context: jinja2.runtime.Context, op: str, left: Any, right: Any) -> Any:
        if op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            if left.bit_length() * right > MAX_VALUE_SIZE:
                raise _TooLarge(f"{left} ** {right} is too large for a chat template")
        elif op == "*" and isinstance(right, int) and hasattr(left, "__len__"):
            _check_size(len(left) * right)
        elif op == "*" and isinstance(left, int) and hasattr(right, "__len__"):
            _check_size(len(right) * left)
        elif op == "+" and hasattr(left, "__len__") and hasattr(right, "__len__"):
            _check_size(len(left) + len(right))
        return super().call_binop(context, op, left, right)


class _TooLarge(Exception):
    """A value a template would build is beyond ``MAX_VALUE_SIZE``."""


def _check_size(size: int) -> None:
    if size > MAX_VALUE_SIZE:
        raise _TooLarge(f"a value of {size} elements is too large for a chat template")


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks the assistant's
    text for training tools; rendered as the text it holds."""

    tags = {"generation"}  # noqa: RUF012 - an instance variable of jinja2.ext.Extension

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = _BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _read_config(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable JSON file: {exc}") from None
    return value if isinstance(value, dict) else {}


def _template_source(directory: Path, config: Mapping[str, Any]) -> str | None:
    path = directory / TEMPLATE_FILE
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: cannot read the chat template: {exc}") from None
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    tokens = {}
    for name in _SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):  # an AddedToken saved as {"content": ...}
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens
