"""The model's forward under ``torch.compile``, the paged attention left as one op.

The whole causal LM forward (embedding, decoder layers, final norm, the LM
head over the sampled rows) is traced once by dynamo and compiled by
inductor, which fuses the element-wise work between the matrix multiplies
(RMSNorm, rotary embedding, SiLU x up, the residual adds). Each layer's
attention stays one opaque custom op, ``trioserve::paged_attention``
(``gpu/attention.py``): it writes the layer's KV cache and attends through
the block tables, reading the step's metadata from ``step_metadata`` rather
than from the graph, so no block table, context length or decode grouping
ever reaches a guard.

The number of tokens in the packed batch (T) and of sampled rows (S) are
unbacked symbolic sizes (``mark_unbacked``): one graph serves every batch,
one token or two thousand, with no recompilation (a plain dynamic size would
still be specialised for 0 and 1). The weights stay inputs of the graph,
not constants: the oneDNN-packed linears of ``gpu/cpu_kernels/linear.py`` run
inside it as one more opaque op, and a model loaded again (after a deep
sleep) runs in the same graph. (Inductor's ``freezing``, which packs the
linears itself, makes the weights constants, and then neither the FX graph
cache nor the AOTAutograd cache applies: every start compiled afresh.)

Compiling SmolLM2-135M took 80 s here the first time; inductor's caches
(the FX graph and AOTAutograd caches, the built kernels) live under
``inductor_cache_dir()``, so a later start of the same model re-traces
(14 s) but neither generates nor builds again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from trioserve.config import cache_dir

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"

# input_ids [1, T], position_ids [1, T], logits_to_keep [S] -> logits [S, V]
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def inductor_cache_dir() -> Path:
    """Where inductor caches what it compiled: ``$TORCHINDUCTOR_CACHE_DIR``,
    which importing ``trioserve.gpu`` sets (when unset) to ``inductor`` in
    trioserve's cache (``~/.cache/trioserve``)."""
    return Path(os.environ.get(INDUCTOR_CACHE_ENV) or cache_dir() / "inductor")


def eager_forward(model: torch.nn.Module) -> Forward:
    """The model called as it is."""

    def forward(input_ids: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=logits_to_keep)
        return out.logits[0]

    return forward


def compiled_forward(model: torch.nn.Module) -> Forward:
    """The model under ``torch.compile``, compiled lazily at the first call
    (run the calls under ``torch.inference_mode()``)."""
    compiled = torch.compile(model, fullgraph=True)

    def forward(input_ids: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: torch.Tensor) -> torch.Tensor:
        for tensor, dim in ((input_ids, 1), (position_ids, 1), (logits_to_keep, 0)):
            torch._dynamo.decorators.mark_unbacked(tensor, dim)
        out = compiled(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=logits_to_keep)
        return out.logits[0]

    return forward
