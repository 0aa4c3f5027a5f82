"""What incremental detokenization costs per token: the tokenizer's ``TextStream`` (the ``tokenizers`` library's
``DecodeStream``) against the same detokenizer decoding each window from Python, on one tokenizer, in one run.

    PYTHONPATH=src python scripts/bench_detokenizer.py [--model DIR] [--tokens 4000] [--rounds 7]

--model defaults to the default model's directory (SmolLM2-135M-Instruct, converted on first use).

Three token streams, each fed one token at a time to a new ``IncrementalDetokenizer`` (a 64-token prompt, no
stop strings): the README's text encoded, a text of mixed scripts and emoji encoded, and random ids of the
vocabulary (much of it invalid UTF-8 when cut). The two ways alternate, ``--rounds`` times each; the figure is the
median over rounds of microseconds per token, and the ratio is windows / stream. The texts that come out of the
two ways are compared, and the run fails if they differ.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from trioserve.default_model import default_model_dir
from trioserve.frontend.text.detokenizer import IncrementalDetokenizer
from trioserve.frontend.text.tokenizer import TextStreamError, Tokenizer

README = Path(__file__).resolve().parent.parent / "README.md"
MIXED = "Grüße aus Köln — 東京の天気は晴れ 🙂🚀, Здравствуйте, مرحبا, naïve café, ∑∫√ ≤ ≥. "


class WindowsDecodedHere:
    """The tokenizer, with streams that fail at once: the detokenizer then decodes every window itself."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, context_ids: Sequence[int], *, skip_special_tokens: bool = True) -> _FailingStream:
        return _FailingStream()


class _FailingStream:
    def step(self, token_id: int) -> str | None:
        raise TextStreamError("windows decoded here")


def run_once(tokenizer: object, prompt: list[int], ids: list[int]) -> tuple[float, str]:
    detok = IncrementalDetokenizer(tokenizer, prompt)  # type: ignore[arg-type]
    start = time.perf_counter()
    for token_id in ids:
        detok.update([token_id])
    text = detok.text + detok.flush()
    return (time.perf_counter() - start) / len(ids) * 1e6, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    model_dir = args.model or default_model_dir(announce=False)
    tokenizer = Tokenizer.from_dir(model_dir)
    rng = random.Random(0)

    def text_ids(text: str) -> list[int]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        return (ids * (args.tokens // max(len(ids), 1) + 1))[: args.tokens]

    streams = {
        "README": text_ids(README.read_text()),
        "mixed scripts": text_ids(MIXED),
        "random ids": [rng.randrange(tokenizer.vocab_size) for _ in range(args.tokens)],
    }
    prompt = tokenizer.encode("You are a helpful assistant. " * 16)[:64]
    ways = {"stream": tokenizer, "windows": WindowsDecodedHere(tokenizer)}
    print(f"tokenizer: {model_dir}, {args.tokens} tokens, {args.rounds} rounds")
    print(f"{'token stream':<14} {'stream us/tok':>14} {'windows us/tok':>15} {'windows/stream':>15}")
    for name, ids in streams.items():
        times: dict[str, list[float]] = {way: [] for way in ways}
        texts: dict[str, str] = {}
        for _ in range(args.rounds):
            for way, tok in ways.items():
                micros, texts[way] = run_once(tok, prompt, ids)
                times[way].append(micros)
        if texts["stream"] != texts["windows"]:
            raise SystemExit(f"{name}: the two ways gave different texts")
        stream, windows = (statistics.median(times[way]) for way in ways)
        print(f"{name:<14} {stream:>14.2f} {windows:>15.2f} {windows / stream:>14.2f}x")


if __name__ == "__main__":
    main()
