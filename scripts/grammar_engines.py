"""Compare the grammar engines trioserve could use for structured outputs: llguidance and xgrammar.

For each engine, over the JSON-schema suite (tests/helpers/json_schemas.py) with a model's tokenizer:
- compile: building a matcher from a schema (no cache), and its first mask (what a request's
  time to first token pays on a cold cache);
- mask: filling the token bitmask of 32 rows (the suite's schemas, cycled), once per step, each row
  walking the tokens of its schema's example, with the engine's parallel batch fill.

    PYTHONPATH=src:tests python scripts/grammar_engines.py [TOKENIZER_DIR] [--threads N]

TOKENIZER_DIR defaults to the default model's directory (SmolLM2-135M-Instruct). An engine that
is not installed is skipped (xgrammar: pip install --no-deps --target DIR xgrammar apache-tvm-ffi,
then put DIR on PYTHONPATH; it imports torch).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from helpers.json_schemas import SCHEMAS

BATCH = 32


def default_tokenizer_dir() -> Path:
    from trioserve.config import cache_dir
    from trioserve.default_model import DEFAULT_MODEL_NAME

    return cache_dir() / DEFAULT_MODEL_NAME


def examples_tokens(encode: Any) -> list[list[int]]:
    return [encode(json.dumps(example)) for _, _, example in SCHEMAS]


def report(name: str, compile_ms: list[float], first_ms: list[float], steps_ms: list[float], extra: str) -> None:
    print(f"{name} ({extra})")
    print(
        f"  compile, {len(compile_ms)} schemas: mean {statistics.mean(compile_ms):.2f} ms, "
        f"max {max(compile_ms):.2f} ms, total {sum(compile_ms):.1f} ms"
    )
    print(f"  first mask after compile: mean {statistics.mean(first_ms):.2f} ms, max {max(first_ms):.2f} ms")
    print(
        f"  mask fill, batch {BATCH}, {len(steps_ms)} steps: mean {statistics.mean(steps_ms):.3f} ms, "
        f"median {statistics.median(steps_ms):.3f} ms, max {max(steps_ms):.3f} ms per step"
    )


def run_llguidance(tokenizer_dir: Path, vocab_size: int, eos: int, threads: int) -> None:
    import llguidance
    import llguidance.numpy

    started = time.perf_counter()
    tok = llguidance.LLTokenizer((tokenizer_dir / "tokenizer.json").read_text(), n_vocab=vocab_size, eos_token=eos)
    tokenizer_s = time.perf_counter() - started
    options: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    compile_ms, first_ms, templates = [], [], []
    mask = llguidance.numpy.allocate_token_bitmask(BATCH, vocab_size)
    for _, schema, _ in SCHEMAS:
        started = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        matcher = llguidance.LLMatcher(tok, grammar)
        compile_ms.append((time.perf_counter() - started) * 1e3)
        if matcher.is_error():
            raise SystemExit(f"llguidance: {matcher.get_error()}")
        templates.append(matcher.deep_copy())
        started = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        first_ms.append((time.perf_counter() - started) * 1e3)
    examples = examples_tokens(tok.tokenize_str)
    executor = llguidance.LLExecutor(num_threads=threads)
    rows = [(templates[i % len(templates)].deep_copy(), examples[i % len(examples)]) for i in range(BATCH)]
    steps_ms = []
    for step in range(max(len(tokens) for _, tokens in rows) + 1):
        started = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask_par(executor, [(m, i) for i, (m, _) in enumerate(rows)], mask)
        steps_ms.append((time.perf_counter() - started) * 1e3)
        for i, (matcher, tokens) in enumerate(rows):
            if step < len(tokens):
                allowed = (mask[i, tokens[step] // 32] >> (tokens[step] % 32)) & 1
                if not allowed or not matcher.consume_token(tokens[step]):
                    raise SystemExit(f"llguidance: row {i} refused its example's token {step}")
    report(
        f"llguidance {llguidance.__version__}",
        compile_ms,
        first_ms,
        steps_ms,
        f"tokenizer built in {tokenizer_s * 1e3:.0f} ms, {threads} threads",
    )


def run_xgrammar(tokenizer_dir: Path, vocab_size: int, threads: int) -> None:
    try:
        import xgrammar
    except ImportError:
        print("xgrammar: not installed, skipped")
        return
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    started = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size)
    tokenizer_s = time.perf_counter() - started
    compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
    compile_ms, first_ms, compiled = [], [], []
    mask = xgrammar.allocate_token_bitmask(BATCH, vocab_size)
    for _, schema, _ in SCHEMAS:
        started = time.perf_counter()
        grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
        compile_ms.append((time.perf_counter() - started) * 1e3)
        compiled.append(grammar)
        matcher = xgrammar.GrammarMatcher(grammar)
        started = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        first_ms.append((time.perf_counter() - started) * 1e3)
    examples = examples_tokens(lambda text: hf.encode(text, add_special_tokens=False))
    batch = xgrammar.BatchGrammarMatcher(max_threads=threads)
    rows = [(xgrammar.GrammarMatcher(compiled[i % len(compiled)]), examples[i % len(examples)]) for i in range(BATCH)]
    steps_ms = []
    for step in range(max(len(tokens) for _, tokens in rows) + 1):
        started = time.perf_counter()
        batch.batch_fill_next_token_bitmask([m for m, _ in rows], mask)
        steps_ms.append((time.perf_counter() - started) * 1e3)
        for i, (matcher, tokens) in enumerate(rows):
            if step < len(tokens) and not matcher.accept_token(tokens[step]):
                raise SystemExit(f"xgrammar: row {i} refused its example's token {step}")
    report(
        f"xgrammar {importlib.metadata.version('xgrammar')}",
        compile_ms,
        first_ms,
        steps_ms,
        f"tokenizer info built in {tokenizer_s * 1e3:.0f} ms, {threads} threads; imports torch",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokenizer_dir", nargs="?", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    tokenizer_dir = args.tokenizer_dir or default_tokenizer_dir()
    config = json.loads((tokenizer_dir / "config.json").read_text())
    vocab_size, eos = int(config["vocab_size"]), config.get("eos_token_id", 0)
    eos = eos[0] if isinstance(eos, list) else int(eos)
    print(
        f"{len(SCHEMAS)} schemas; tokenizer {tokenizer_dir.name}, vocab {vocab_size}; python {sys.version.split()[0]}"
    )
    run_llguidance(tokenizer_dir, vocab_size, eos, args.threads)
    run_xgrammar(tokenizer_dir, vocab_size, args.threads)


if __name__ == "__main__":
    main()
