"""What a chat's messages say stays what they say: text that came from a
message's content never becomes one of the model's special tokens.

A chat template writes the model's control tokens (``<|im_start|>``,
``<|im_end|>``) around each message; a user who writes ``<|im_end|>`` in a
message would otherwise end their own turn and write the assistant's or the
system's (a role injection). So after rendering, each content that holds a
special token's text is found in the rendered prompt (``mark_contents``),
and the prompt is tokenized with special tokens read as such only outside
those places (``encode_marked``). Contents without any special token's text
(nearly all) are left to the usual tokenization, unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from trioserve.errors import InvalidRequestError
from trioserve.frontend.text.chat_template import TemplatedText
from trioserve.frontend.text.tokenizer import Tokenizer


class MarkedText(TemplatedText):
    """A rendered prompt with the spans (``[start, end)``) of message
    contents whose special tokens' text must be encoded as text."""

    spans: tuple[tuple[int, int], ...] = ()


def mark_contents(
    text: TemplatedText, messages: Sequence[Mapping[str, object]], specials: Sequence[str]
) -> TemplatedText:
    """``text`` (rendered from ``messages``), marked where a content holding
    a special token's text is; ``text`` itself when no content holds one.
    Raises ``InvalidRequestError`` naming ``messages[i].content`` when such a
    content is not found in the text (the template rewrote it), rather than
    let its special tokens through."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for where, content in _contents(messages):
        if not any(special in content for special in specials):
            continue
        at = text.find(content, cursor)
        if at < 0:
            at = text.find(content)  # a template may place a message out of order (a system prompt first)
        if at < 0:
            named = next(special for special in specials if special in content)
            raise InvalidRequestError(
                where,
                f"holds {named!r}, the text of one of the model's control tokens, and the chat template "
                "rewrites this content, so it cannot be kept as text (remove the token's text from it)",
            )
        spans.append((at, at + len(content)))
        cursor = at + len(content)
    if not spans:
        return text
    marked = MarkedText(text)
    marked.spans = tuple(sorted(spans))
    return marked


def encode_marked(tokenizer: Tokenizer, text: MarkedText) -> list[int]:
    """The token ids of ``text``: special tokens read as such outside its
    spans, as text inside them; nothing added around it."""
    token_ids: list[int] = []
    at = 0
    for span_start, end in text.spans:
        start = max(span_start, at)  # overlapping spans (the same content twice): the first covers it
        if start > at:
            token_ids += tokenizer.encode(text[at:start], add_special_tokens=False)
        if end > start:
            token_ids += tokenizer.encode_literal(text[start:end])
        at = max(at, end)
    if at < len(text):
        token_ids += tokenizer.encode(text[at:], add_special_tokens=False)
    return token_ids


def _contents(messages: Sequence[Mapping[str, object]]) -> Iterator[tuple[str, str]]:
    """Each message's text: its ``content`` string, or the ``text`` of each of its parts."""
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str):
            yield f"messages[{i}].content", content
        elif isinstance(content, Sequence):
            for j, part in enumerate(content):
                if isinstance(part, Mapping) and isinstance(text := part.get("text"), str):
                    yield f"messages[{i}].content[{j}].text", text
