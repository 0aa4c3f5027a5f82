"""A model's chat template: messages to the prompt text the model was trained on.

The template is the model's own Jinja template, from ``chat_template.jinja``
in the model directory, else ``chat_template`` in ``tokenizer_config.json``
(a string, or a list of named templates: the one named ``default``). It is
rendered as transformers renders it, in an immutable sandboxed Jinja
environment (a template cannot touch Python objects or change its inputs),
with ``trim_blocks`` and ``lstrip_blocks``, loop controls, a ``tojson``
filter that keeps non-ASCII text, and the globals ``raise_exception`` and
``strftime_now``; the variables are ``messages``, ``add_generation_prompt``,
``bos_token``, ``eos_token`` (and the other special tokens named in
tokenizer_config.json). No transformers, so no torch.

The rendered text already holds the model's special tokens, so it is
tokenized without adding any (``TemplatedText``), as transformers'
``apply_chat_template`` does.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.sandbox

from trioserve.errors import InvalidRequestError

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


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

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> TemplatedText:
        """The prompt for ``messages`` (each a mapping with ``role`` and
        ``content``), ending with the assistant's turn opened when
        ``add_generation_prompt``. Raises ``InvalidRequestError`` naming
        ``messages`` when the template refuses them."""
        try:
            text = self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
            )
        except TemplateError as exc:
            raise InvalidRequestError("messages", f"the model's chat template refused them: {exc}") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise InvalidRequestError("messages", f"the model's chat template failed on them: {exc}") from None
        return TemplatedText(text)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


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
