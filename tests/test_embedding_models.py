"""Embeddings from real (tiny, random) models through the whole engine: the
vectors of 32 prompts of different lengths, several of them prefilled over
steps, equal transformers' own (``AutoModel``'s last hidden states, pooled the
same way) to a cosine of at least 0.99999: a decoder (Qwen3-shaped) whose
sentence-transformers files say last-token pooling and normalisation, and
the same model pooled by the mean and by its first token; with
``dimensions`` and without normalisation."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
import trio

import trioserve
from trioserve import EngineConfig

MIN_COSINE = 0.99999


def sentence_transformers_dir(model_dir, out, mode: str, normalize: bool):
    """``model_dir`` copied to ``out`` with sentence-transformers' module files."""
    shutil.copytree(model_dir, out)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir()
    modes = {"pooling_mode_lasttoken": False, "pooling_mode_mean_tokens": False, "pooling_mode_cls_token": False}
    modes[mode] = True
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))
    return out


def reference(model, ids: list[int], pooling: str, normalize: bool, dimensions: int | None) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0].float()
    vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling][:dimensions]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


@pytest.mark.parametrize(
    ("mode", "pooling", "override"),
    [("pooling_mode_lasttoken", "last", None), ("pooling_mode_mean_tokens", "mean", None), (None, "cls", "cls")],
    ids=["last-from-its-files", "mean-from-its-files", "cls-by-config"],
)
async def test_vectors_equal_transformers_pooled_the_same_way(tiny_model_dir, tmp_path, mode, pooling, override):
    from transformers import AutoModel

    model_dir = sentence_transformers_dir(
        tiny_model_dir("qwen3"), tmp_path / "embed", mode or "pooling_mode_lasttoken", normalize=True
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 259) for _ in range(rng.randrange(1, 80))] for _ in range(31)]
    prompts.insert(0, [rng.randrange(3, 259) for _ in range(40)])  # encoded again below
    config = EngineConfig(
        model=str(model_dir), block_size=8, max_num_batched_tokens=48, pooling_type=override, enable_prefix_caching=True
    )
    with trio.fail_after(120):
        async with trioserve.open_engine(config=config) as engine:
            assert engine.info.model.hidden_size == 64
            outs = await engine.encode_batch(prompts)
            raw = await engine.encode_batch(prompts[:4], dimensions=16, normalize=False)
            again = await engine.encode(prompts[0])  # a last-pooled prompt may come from the prefix cache
            stats = await engine.stats()
    model = AutoModel.from_pretrained(model_dir).eval()
    for prompt, out in zip(prompts, outs, strict=True):
        want = reference(model, prompt, pooling, normalize=True, dimensions=None)
        got = torch.tensor(out.embedding)
        assert got.shape == want.shape and abs(float(got.norm()) - 1) < 1e-5
        assert float(torch.nn.functional.cosine_similarity(got, want, dim=0)) >= MIN_COSINE
    for prompt, out in zip(prompts[:4], raw, strict=True):
        want = reference(model, prompt, pooling, normalize=False, dimensions=16)
        got = torch.tensor(out.embedding)
        assert got.shape == (16,) and torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    assert torch.allclose(torch.tensor(again.embedding), torch.tensor(outs[0].embedding), atol=1e-5)
    if pooling == "last":
        assert again.num_cached_tokens == 32  # its 4 whole blocks of 8 tokens but the last
    else:  # mean and first-token pooling read every token: no prefix-cache hit
        assert not again.num_cached_tokens
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0
