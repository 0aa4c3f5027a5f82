"""The embedding benchmark's baseline: sentence-transformers' ``encode`` of
the texts in a JSON file, in batches of ``--batch``, on ``--threads`` torch
threads, after one batch of warm-up. Prints one JSON line: ``seconds``,
``inputs``, ``tokens`` (counted by its own tokenizer) and ``dimensions``.

    python -m trioserve.bench.st_baseline MODEL_DIR --batch 32 --threads 2 --texts FILE
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trioserve.bench.st_baseline")
    parser.add_argument("model_dir")
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--texts", required=True)
    args = parser.parse_args(argv)
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(args.threads)
    texts = json.loads(Path(args.texts).read_text())
    model = SentenceTransformer(args.model_dir, device="cpu")
    context = json.loads((Path(args.model_dir) / "config.json").read_text()).get("max_position_embeddings", 512)
    model.max_seq_length = model.tokenizer.model_max_length = context  # no text cut that trioserve computes whole
    model.encode(texts[: args.batch], batch_size=args.batch)  # warm-up
    started = time.perf_counter()
    vectors = model.encode(texts, batch_size=args.batch, convert_to_numpy=True)
    seconds = time.perf_counter() - started
    tokens = sum(len(ids) for ids in model.tokenizer(texts)["input_ids"])
    print(json.dumps({"seconds": seconds, "inputs": len(texts), "tokens": tokens, "dimensions": int(vectors.shape[1])}))


if __name__ == "__main__":
    main()
