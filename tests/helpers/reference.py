"""transformers' own greedy ``generate()``: the tokens every engine test on a
real model must reproduce.

Each prompt's tokens are kept for the rest of the test process (they are a
fixed function of the model directory, the dtype and the prompt), and a
request for fewer tokens than were generated is their prefix: greedy
decoding with no stop makes the same first tokens however many follow.
"""

from __future__ import annotations

import random
import threading
from typing import Any

_lock = threading.Lock()
_models: dict[tuple[str, Any], Any] = {}
_tokens: dict[tuple[str, Any, tuple[int, ...]], list[int]] = {}


def reference_greedy(model_dir: Any, prompts: list[list[int]], max_tokens: int, dtype: Any = None) -> list[list[int]]:
    """transformers' greedy generate() with eager attention, one prompt at a
    time, never stopping early: ``max_tokens`` tokens for each prompt."""
    import torch

    dtype = dtype or torch.float32
    with _lock:
        return [_generate(str(model_dir), dtype, prompt, max_tokens) for prompt in prompts]


def _generate(model_dir: str, dtype: Any, prompt: list[int], max_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    key = (model_dir, dtype, tuple(prompt))
    known = _tokens.get(key, [])
    if len(known) < max_tokens:
        if (model_dir, dtype) not in _models:
            model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=dtype)
            _models[model_dir, dtype] = model.eval()
        known = _tokens[key] = greedy_tokens(_models[model_dir, dtype], prompt, max_tokens)
    return known[:max_tokens]


def greedy_tokens(model: Any, prompt: list[int], max_tokens: int, device: Any = None) -> list[int]:
    """``model``'s greedy ``generate()`` of ``max_tokens`` tokens after ``prompt``, never stopping early
    (the prompt on ``device``: the model's)."""
    import torch

    ids = torch.tensor([prompt], device=device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def greedy_tokens_and_margins(model: Any, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """``greedy_tokens``, and at each step the lead of the chosen token's logit over the next one's."""
    import torch

    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
        pad_token_id=0, output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    margins = [float(top[0, 0] - top[0, 1]) for top in (logits.topk(2).values for logits in out.logits)]
    return out.sequences[0, len(prompt) :].tolist(), margins


def before_a_near_tie(tokens: list[int], margins: list[float], floor: float) -> list[int]:
    """The tokens before the first step whose greedy choice led the next token by less than ``floor``: where
    another exact computation of the same model (sums in another order) may choose the other one."""
    near = [i for i, margin in enumerate(margins) if margin < floor]
    return tokens[: near[0]] if near else tokens


def make_prompts(vocab_size: int, n: int = 8) -> list[list[int]]:
    """``n`` (at most 8) prompts of 3 to 47 random tokens, the same every time."""
    rng = random.Random(1234)
    lengths = [3, 7, 12, 18, 25, 31, 40, 47][:n]
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for length in lengths]
