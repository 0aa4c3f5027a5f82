"""A request's ``SamplingParams`` made ready for the engine core, where the
tokenizer and the model's vocabulary are known (they are not in the
engine core, nor when a client builds the params):

- every token id a field names (``logit_bias``, ``allowed_token_ids``,
  ``bad_words_token_ids``) must be inside the model's vocabulary: the
  worker indexes the logits with them;
- ``bad_words`` are tokenized into ``bad_words_token_ids``: each word as it
  stands (less leading spaces), and after a space when that makes a
  different first token in as many tokens, so that the word is banned at
  the start of the text and after a space alike.

Errors are ``InvalidRequestError`` naming the field.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from trioserve.checks import short_repr
from trioserve.errors import InvalidRequestError
from trioserve.frontend.text.tokenizer import Tokenizer
from trioserve.sampling_params import MAX_BAD_WORD_TOKENS, SamplingParams


def prepare_params(params: SamplingParams, tokenizer: Tokenizer, vocab_size: int) -> SamplingParams:
    """``params`` checked against the vocabulary, with ``bad_words`` tokenized."""
    _check_in_vocab("logit_bias", params.logit_bias, vocab_size)
    _check_in_vocab("allowed_token_ids", params.allowed_token_ids or (), vocab_size)
    _check_in_vocab("bad_words_token_ids", (t for word in params.bad_words_token_ids for t in word), vocab_size)
    if not params.bad_words:
        return params
    words = list(params.bad_words_token_ids)
    for word in params.bad_words:
        for ids in bad_word_token_ids(tokenizer, word):
            if len(ids) > MAX_BAD_WORD_TOKENS:
                raise InvalidRequestError(
                    "bad_words", f"{short_repr(word)} is {len(ids)} tokens long: at most {MAX_BAD_WORD_TOKENS}"
                )
            _check_in_vocab("bad_words", ids, vocab_size)
            if ids not in words:
                words.append(ids)
    return msgspec.structs.replace(params, bad_words=[], bad_words_token_ids=words)


def bad_word_token_ids(tokenizer: Tokenizer, word: str) -> list[list[int]]:
    """The token sequences that write ``word``: at the start of a text, and
    after a space when that is another first token in as many tokens."""
    bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
    if not bare:
        return []
    spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
    if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
        return [bare, spaced]
    return [bare]


def _check_in_vocab(name: str, token_ids: Iterable[int], vocab_size: int) -> None:
    for token_id in token_ids:
        if token_id >= vocab_size:
            raise InvalidRequestError(
                name, f"token id {token_id} is outside this model's vocabulary of {vocab_size} tokens"
            )
