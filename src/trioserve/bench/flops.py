"""Model FLOPs of a workload, from the model's config (no torch).

Counted as a matrix-multiply FLOP count (2 per multiply-add), for a decoder
with a gated MLP (Llama, Qwen, Mistral, Gemma: gate, up and down):

- the dense layers, for every token the model computes: a prompt's tokens
  and every output token but the last (which is sampled, never fed back):
  per layer 2 x hidden x (q + k + v + o widths) + 2 x 3 x hidden x MLP width;
- attention over each token's context: per layer 2 x 2 x heads x head_dim x
  (tokens it sees) for QK^T and PV;
- the LM head only for the sampled tokens: 2 x hidden x vocabulary each.

Embedding lookups, norms, rotary and sampling are not counted. Prefix-cache
hits are not subtracted: it is the workload's cost, not the run's (so the
benchmark gives no utilisation for a system that had hits: ``report.flops_figures``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        text = config.get("text_config", config)
        heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        return cls(
            hidden=hidden,
            layers=int(text["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            mlp=int(text["intermediate_size"]),
            vocab=int(text["vocab_size"]),
        )

    @property
    def dense_flops_per_token(self) -> int:
        """All layers' linear layers, one token."""
        qkvo = self.hidden * (2 * self.heads * self.head_dim + 2 * self.kv_heads * self.head_dim)
        return self.layers * 2 * (qkvo + 3 * self.hidden * self.mlp)

    def attention_flops(self, num_tokens: int) -> int:
        """Attention of tokens 1..n of one sequence, each over its context so far."""
        return self.layers * 4 * self.heads * self.head_dim * num_tokens * (num_tokens + 1) // 2

    @property
    def lm_head_flops(self) -> int:
        return 2 * self.hidden * self.vocab


def workload_flops(shape: ModelShape, requests: list[tuple[int, int]]) -> int:
    """FLOPs of requests given as ``(prompt tokens, output tokens)``."""
    total = 0
    for prompt, output in requests:
        computed = prompt + max(output, 1) - 1
        total += computed * shape.dense_flops_per_token + shape.attention_flops(computed)
        total += output * shape.lm_head_flops
    return total


def utilisation(flops: int, seconds: float, peak_flops_per_s: float) -> float:
    """Model FLOP utilisation: achieved FLOP/s over the peak rate."""
    return flops / seconds / peak_flops_per_s
