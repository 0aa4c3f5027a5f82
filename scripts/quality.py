"""What a lower precision costs in quality: perplexity on a fixed public-domain
text (``scripts/data/public_domain.txt``: the Declaration of Independence's
opening, the Gettysburg Address, the first lines of two novels) and greedy
agreement with float32 over 32 prompts, for float32, bfloat16 and int8
(``--quantization int8``: our ``Int8Linear`` layers, ``gpu/cpu_kernels/int8.py``)::

    .venv/bin/python scripts/quality.py [--model smollm2-135m] [--max-tokens 32] [--keep lm_head,down_proj]
    .venv/bin/python scripts/quality.py --modes float32,int8,w8a8 --w8a8 DIR   # DIR: trioserve quantize's

The model runs in this process as transformers builds it (eager attention),
with its linear layers swapped for ours as the engine swaps them (float32:
our GEMM; bfloat16: oneDNN's or ours; int8: ours, all but ``--keep``) and,
at float32, its norms and MLP activations fused as the eager engine fuses them.
Perplexity: the text in one window (it is shorter than the model's
context), exp of the mean negative log-likelihood of each token after the
first (with ``--perturb N``, also with every RMSNorm's output scaled by -N
to N float32 ulps, and the mean of those draws: int8's figure moves by a
percent or more with its inputs' last bits). Agreement: each prompt's greedy continuation of ``--max-tokens``
tokens against float32's: how many are identical, and the mean share of the
tokens before the first that differs.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from bf16_agreement import PROMPTS as SIXTEEN_PROMPTS  # this directory is the script's first import path
from trioserve.bench.models import resolve_model
from trioserve.gpu.cpu_kernels.fused import fuse_elementwise
from trioserve.gpu.cpu_kernels.int8 import calibration_ids, quantize_linears
from trioserve.gpu.cpu_kernels.linear import pack_linears
from trioserve.gpu.w8a8 import load_w8a8, read_scheme, without_quantization

TEXT = Path(__file__).with_name("data") / "public_domain.txt"

PROMPTS = [
    *SIXTEEN_PROMPTS,
    "The largest planet in the solar system is", "A haiku about the sea:\n", "SELECT name FROM",
    "The French Revolution began in", "Q: What is 12 times 12?\nA:", "The recipe calls for two cups of",
    "In machine learning, overfitting means", "The train left the station at", "Shakespeare wrote",
    "for i in range(10):\n", "The human heart has four", "Mount Everest is located in",
    "The opposite of hot is", "Light travels at a speed of", "My name is Anna and I", "The Roman Empire fell",
]  # fmt: skip


def load(model_dir: Path, mode: str, keep: tuple[str, ...], w8a8: Path | None = None) -> torch.nn.Module:
    dtype = torch.bfloat16 if mode == "bfloat16" else torch.float32
    if mode == "w8a8":  # a compressed-tensors int8 checkpoint, as the worker loads it
        scheme = read_scheme(w8a8 or model_dir)
        assert scheme is not None, f"{w8a8}: not a W8A8 checkpoint"
        config = without_quantization(AutoConfig.from_pretrained(scheme.model_dir))
        model = AutoModelForCausalLM.from_pretrained(
            scheme.model_dir, config=config, attn_implementation="eager", dtype=dtype
        ).eval()
        load_w8a8(model.requires_grad_(False), scheme)
        pack_linears(model)
        fuse_elementwise(model)
        return model
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=dtype).eval()
    model.requires_grad_(False)
    if mode == "int8":
        ids = calibration_ids(str(model_dir))
        quantize_linears(model, torch.device("cpu"), dtype, calibration_ids=ids, keep=keep)
    pack_linears(model)
    if dtype == torch.float32:
        fuse_elementwise(model)
    return model


def perplexity(model: torch.nn.Module, ids: torch.Tensor) -> float:
    with torch.inference_mode():
        logits = model(ids[None]).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="mean")
    return math.exp(nll.item())


def perturbed_perplexity(model: torch.nn.Module, ids: torch.Tensor, ulps: int) -> float:
    """Perplexity with every RMSNorm's output scaled by ``1 + ulps * 2^-23``
    (a few float32 ulps: how far the last bits alone move the figure)."""
    hooks = [
        module.register_forward_hook(lambda _m, _i, out: out * (1 + ulps * 2**-23))
        for module in model.modules()
        if type(module).__name__.endswith("RMSNorm")
    ]
    try:
        return perplexity(model, ids)
    finally:
        for hook in hooks:
            hook.remove()


def greedy(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def shared_share(a: list[int], b: list[int]) -> float:
    same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    return same / len(a)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--modes", default="float32,bfloat16,int8")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--keep", default="lm_head", help="linear layers (by name) int8 leaves in float")
    p.add_argument("--torch-threads", type=int, default=2)
    p.add_argument(
        "--perturb", type=int, default=0, metavar="N", help="also perplexity with the norms' outputs -N..N ulps off"
    )
    p.add_argument("--w8a8", type=Path, help="the W8A8 checkpoint that mode w8a8 loads (trioserve quantize's)")
    args = p.parse_args()
    torch.set_num_threads(args.torch_threads)
    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = torch.tensor(tokenizer(TEXT.read_text())["input_ids"])
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    keep = tuple(name for name in args.keep.split(",") if name)
    print(f"{args.model}: {len(ids)} tokens of text, {len(prompts)} prompts of {args.max_tokens} tokens")
    reference: list[list[int]] | None = None
    base_ppl = None
    for mode in args.modes.split(","):
        model = load(model_dir, mode, keep, args.w8a8)
        ppl = perplexity(model, ids)
        outputs = greedy(model, prompts, args.max_tokens)
        if reference is None:
            reference, base_ppl = outputs, ppl
        identical = sum(a == b for a, b in zip(outputs, reference, strict=True))
        share = statistics.mean(shared_share(a, b) for a, b in zip(outputs, reference, strict=True))
        print(
            f"{mode:>9}: perplexity {ppl:.3f} ({(ppl / base_ppl - 1) * 100:+.2f}% of {args.modes.split(',')[0]}), "
            f"greedy: {identical}/{len(prompts)} identical, {share:.0%} of tokens before the first difference",
            flush=True,
        )
        if args.perturb:
            steps = [u for u in range(-args.perturb, args.perturb + 1) if u]
            moved = [perturbed_perplexity(model, ids, ulps) for ulps in steps]
            mean = statistics.mean([ppl, *moved])
            print(
                f"{'':>11}every norm's output scaled by {', '.join(map(str, steps))} ulps: perplexity "
                + ", ".join(f"{p:.3f} ({(p / base_ppl - 1) * 100:+.2f}%)" for p in moved)
                + f"; mean of the {len(moved) + 1} {mean:.3f} ({(mean / base_ppl - 1) * 100:+.2f}%)",
                flush=True,
            )


if __name__ == "__main__":
    main()
