"""``trioserve quantize``: a float checkpoint written as a compressed-tensors
W8A8 int8 one (``gpu/w8a8.py``, in a supervised child process: this one
never imports torch), which trioserve and vLLM both serve."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from trioserve.cli.exits import EXIT_ERROR, EXIT_OK, EXIT_USAGE
from trioserve.nurseries.supervision.oneshot import run_oneshot
from trioserve.stdio import announce, say


def add_quantize_parser(commands: Any) -> None:
    """``trioserve quantize``, in an ``add_subparsers()`` object."""
    quantize = commands.add_parser(
        "quantize",
        help="write a float model as a W8A8 int8 checkpoint (compressed-tensors, as vLLM serves it)",
        description="Quantize a float checkpoint's linear layers (all but the LM head) to int8 per output channel, "
        "smoothed by one calibration pass (SmoothQuant's factors folded into the layers before them), and write it "
        "to OUTPUT in the compressed-tensors W8A8 format, with its tokenizer: serve it with trioserve serve --model "
        "OUTPUT (or vLLM).",
    )
    quantize.add_argument("output", metavar="OUTPUT", help="the directory to write (it must not exist)")
    quantize.add_argument(
        "--model",
        default="smollm2-135m",
        help="a float checkpoint's directory, a .gguf file or a Hugging Face id in the local cache, or a benchmark "
        "model's name (default: %(default)s, the default model)",
    )
    quantize.add_argument(
        "--no-smooth", dest="smooth", action="store_false", help="quantize the weights as they are (no calibration)"
    )
    quantize.set_defaults(func=cmd_quantize)


def cmd_quantize(args: argparse.Namespace) -> int:
    """Write in a directory beside OUTPUT, renamed into place when complete:
    whatever stops it half-way leaves no OUTPUT."""
    from trioserve.bench.models import resolve_model

    output = Path(args.output).absolute()
    if output.exists():
        raise ValueError(f"quantize: {output} already exists (quantize writes a new directory)")
    model_dir = resolve_model(args.model)
    say(f"quantizing {model_dir} to int8 (W8A8) ...")
    start = time.monotonic()
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=f".{output.name}.quantizing-") as tmp:
        building = Path(tmp) / "model"
        argv = [str(model_dir), str(building), *([] if args.smooth else ["--no-smooth"])]
        done = run_oneshot("trioserve.gpu.w8a8", argv, name="quantizer", scratch=Path(tmp), capture=True)
        if done.exit_code != 0:
            lines = done.stderr.strip().splitlines() or [f"the quantizer exited with code {done.exit_code}"]
            say(f"trioserve: quantize failed: {lines[-1]}")
            return EXIT_ERROR
        counts = json.loads(done.stdout.strip().splitlines()[-1])
        if "refused" in counts:
            say(f"trioserve: invalid input: {counts['refused']}")
            return EXIT_USAGE
        os.rename(building, output)
    say(
        f"{counts['quantized']} linear layers in int8 ({counts['smoothed']} smoothed), "
        f"in {time.monotonic() - start:.1f} s"
    )
    announce(f"wrote {output}")
    return EXIT_OK
