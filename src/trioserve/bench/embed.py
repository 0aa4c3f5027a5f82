"""``trioserve bench --task embed``: embeddings per second, trioserve against
sentence-transformers' ``encode`` on the same texts, batch size and threads,
in one run.

The workload: ``--num-requests`` texts of ``--prompt-len`` tokens each (drawn
from the tokenizer's vocabulary without its special tokens, seeded by
``--seed``, decoded to text; a text's own token count, once tokenized again,
is what both systems compute). ``--concurrency`` is the batch size: the
engine's ``max_num_seqs``, and sentence-transformers' ``batch_size``. Each
system first encodes one batch uncounted (a warm-up), then all the texts;
the figure is inputs per second over that, and tokens per second beside it.

trioserve runs in this process (the engine's worker, in its own process, with
``--torch-threads`` threads, or its default share of the cores);
sentence-transformers in a child process (``bench/st_baseline.py``) with the
same number of torch threads, its ``max_seq_length`` raised to the model's
context so that no text is cut that trioserve computes whole.

``--rounds R`` (the figure to quote on a shared machine): each system encodes
all the texts R times, the two taking turns (trioserve first in odd rounds,
sentence-transformers first in even ones; the engine stays open, idle while
the baseline runs, and a fresh baseline process warms up each round); each
system's row is its median round, and the ratio is the median of the
rounds' ratios, with their least and greatest beside it.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from trioserve.api import open_engine
from trioserve.bench.report import write_json
from trioserve.bench.workload import parse_range
from trioserve.config import EngineConfig, cpu_threads_per_worker
from trioserve.frontend.text.tokenizer import Tokenizer
from trioserve.nurseries.supervision.oneshot import run_oneshot
from trioserve.stdio import say

_SYSTEMS = ("trioserve", "sentence-transformers")
_MAX_TEXT_ATTEMPTS = 8  # redraws of a text that its tokenizer reads as more tokens than the context holds


def embed_texts(tokenizer: Tokenizer, count: int, lengths: tuple[int, int], seed: int, limit: int) -> list[str]:
    """``count`` texts of about ``lengths`` tokens (see the module's
    docstring), each at most ``limit`` tokens once tokenized again."""
    rng = random.Random(seed)
    usable = [
        i
        for i in range(tokenizer.vocab_size)
        if i not in tokenizer.all_special_ids
        and (text := tokenizer.decode([i]))
        and "\ufffd" not in text
        and text.isprintable()
    ]
    if not usable:
        raise ValueError("model: its tokenizer has no printable token to draw texts from")
    texts = []
    for _ in range(count):
        for _ in range(_MAX_TEXT_ATTEMPTS):
            text = tokenizer.decode([rng.choice(usable) for _ in range(rng.randint(*lengths))])
            if len(tokenizer.encode(text)) <= limit:
                break
        else:
            raise ValueError(f"--prompt-len: texts of {lengths[1]} tokens tokenize to more than {limit}")
        texts.append(text)
    return texts


def _figures(outs: list[Any], seconds: float) -> dict[str, Any]:
    tokens = sum(out.num_prompt_tokens for out in outs)
    return {"seconds": seconds, "inputs": len(outs), "tokens": tokens, "dimensions": len(outs[0].embedding)}


async def _rounds(
    config: EngineConfig, texts: list[str], batch: int, rounds: int, theirs: Callable[[], dict[str, Any]]
) -> list[dict[str, dict[str, Any]]]:
    """Each round's figures of both systems (see the module's docstring); the
    rounds stop at the baseline's first error, which is the last row's."""
    done: list[dict[str, dict[str, Any]]] = []
    async with open_engine(config=config.replace(max_num_seqs=batch)) as engine:
        await engine.encode_batch(texts[:batch])  # warm-up
        for index in range(rounds):
            row: dict[str, dict[str, Any]] = {}
            for name in _SYSTEMS if index % 2 == 0 else _SYSTEMS[::-1]:
                if name == "trioserve":
                    started = time.perf_counter()
                    outs = await engine.encode_batch(texts)
                    row[name] = _figures(outs, time.perf_counter() - started)
                else:
                    say(f"trioserve bench: round {index + 1} of {rounds}, sentence-transformers ...")
                    row[name] = await trio.to_thread.run_sync(theirs)
            done.append(row)
            if "error" in row["sentence-transformers"]:
                break
    return done


def _theirs(model_dir: Path, texts: list[str], batch: int, threads: int, timeout_s: float | None) -> dict[str, Any]:
    """sentence-transformers in a supervised child process: its figures, or ``{"error": ...}``."""
    with tempfile.TemporaryDirectory(prefix="trioserve-bench-") as directory:
        texts_file = Path(directory) / "texts.json"
        texts_file.write_text(json.dumps(texts))
        args = [str(model_dir), "--batch", str(batch), "--threads", str(threads), "--texts", str(texts_file)]
        done = run_oneshot(
            "trioserve.bench.st_baseline",
            args,
            name="sentence-transformers baseline",
            capture=True,
            timeout_s=timeout_s,
        )
    if done.timed_out:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    if done.exit_code != 0:
        lines = done.stderr.strip().splitlines() or ["(no output)"]
        return {"error": f"exit {done.exit_code}: {lines[-1]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_embed_bench(args: argparse.Namespace, config: EngineConfig, model_dir: Path, max_model_len: int) -> int:
    """Run the embedding benchmark (see the module's docstring); print its table. Exit code 0, or 1 on an error."""
    tokenizer = Tokenizer.from_dir(config.tokenizer or model_dir)
    lengths = parse_range(args.prompt_len, "--prompt-len")
    texts = embed_texts(tokenizer, args.num_requests, lengths, args.seed, max_model_len)
    batch = args.concurrency or 32
    threads = config.torch_threads or cpu_threads_per_worker(config)
    say(f"trioserve bench: {len(texts)} texts of {lengths[0]}-{lengths[1]} tokens, batch {batch}, {threads} threads")
    theirs = functools.partial(_theirs, model_dir, texts, batch, threads, args.baseline_timeout)
    rounds = trio.run(_rounds, config, texts, batch, args.rounds, theirs)
    print(f"embeddings: {model_dir}, {len(texts)} texts of {lengths[0]}-{lengths[1]} tokens, batch {batch}")
    failed = next((row["sentence-transformers"] for row in rounds if "error" in row["sentence-transformers"]), None)
    good = [row for row in rounds if "error" not in row["sentence-transformers"]]
    ratios = [_rate(row["trioserve"]) / _rate(row["sentence-transformers"]) for row in good]
    if len(rounds) > 1:
        print(f"  {'round':<6} {'trioserve inputs/s':>19} {'sentence-transformers inputs/s':>31} {'ratio':>7}")
        for index, (both, each) in enumerate(zip(good, ratios, strict=True), 1):
            ours, base = _rate(both["trioserve"]), _rate(both["sentence-transformers"])
            print(f"  {index:<6} {ours:>19.1f} {base:>31.1f} {each:>6.2f}x")
    print(f"  {'system':<24} {'inputs/s':>10} {'tokens/s':>10} {'seconds':>9}")
    medians = {name: _median_round([row[name] for row in rounds if "error" not in row[name]]) for name in _SYSTEMS}
    for name in _SYSTEMS:
        shown = medians[name] or failed
        if shown is None or "error" in shown:
            print(f"  {name:<24} {(shown or {}).get('error', 'no round ran')}")
            continue
        seconds = shown["seconds"]
        print(f"  {name:<24} {_rate(shown):>10.1f} {shown['tokens'] / seconds:>10.0f} {seconds:>9.2f}")
    ratio = statistics.median(ratios) if ratios else None
    if ratio is not None:
        spread = f" (median of {len(ratios)} rounds, {min(ratios):.2f}x-{max(ratios):.2f}x)" if len(ratios) > 1 else ""
        print(f"  trioserve / sentence-transformers: {ratio:.2f}x{spread} (target: at least 1x)")
    if args.json:
        result = {
            "model": str(model_dir),
            "batch": batch,
            "threads": threads,
            "systems": {name: medians[name] or failed for name in _SYSTEMS},
            "rounds": rounds,
            "ratio": ratio,
        }
        write_json(result, args.json)
    return 1 if failed is not None else 0


def _rate(row: dict[str, Any]) -> float:
    return float(row["inputs"]) / row["seconds"]


def _median_round(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The round whose rate is the median (the lower middle of an even count); None for none."""
    return sorted(rows, key=_rate)[(len(rows) - 1) // 2] if rows else None
