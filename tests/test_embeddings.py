"""Embeddings (``Engine.encode``, ``encode_batch``; ``trioserve.pooling``):
on the fake runner, whose vectors are a function of the prompt
(``pooling.fake_vector``), through the whole engine (scheduler, workers,
front-end); a generation request on an embedding engine, and the reverse,
refused naming the task."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import trio
from helpers.fakes import make_fake_config
from helpers.hosted import HostedServer
from helpers.server import open_ws, post_json
from helpers.waiting import in_thread

import trioserve
from trioserve import Engine, InvalidRequestError, SamplingParams
from trioserve.pooling import FAKE_HIDDEN_SIZE, PoolingParams, fake_vector
from trioserve.server import Server

BAD_EMBEDDINGS = [  # (the request's fields, the field its 400 names, what its message says)
    ({"input": []}, "input", "give 1 to 2048 inputs"),
    ({"input": ["ok", ""]}, "input", "an input is empty"),
    ({"input": [5, 6], "dimensions": FAKE_HIDDEN_SIZE + 1}, "dimensions", "at most the model's 32"),
    ({"input": [5, 6], "dimensions": 0}, "dimensions", "must be an integer"),
    ({"input": [5, 6], "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "must be -1 or in [1,"),
    ({"input": [[5, 999999]]}, "input", "token"),
    ({"input": [5] * 600}, "input", "do not fit the context"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format", "invalid enum value 'hex'"),
]


DEFAULTS = {"num_kv_blocks": 64, "step_delay_s": 0.002, "max_num_batched_tokens": 64}
pytestmark = pytest.mark.fake_config(**DEFAULTS)
MODEL = "tiny-embed"


# --- on shared servers --------------------------------------------------------
#
# One server of each configuration the tests of ``TestOnSharedServers`` need
# (an embedding one pooling the mean, one pooling the model's default way, a
# generation one), started when a test first asks for it; each test's bound is
# its ``run_fresh``'s. They are gone before the tests after the class count processes.


def _hosted(tiny_model_dir: Any, **options: Any) -> Iterator[HostedServer]:
    host = HostedServer(make_fake_config(str(tiny_model_dir("llama")), **DEFAULTS, **options), model_name=MODEL)
    yield host
    host.close()


@pytest.fixture(scope="class")
def mean_server(tiny_model_dir):
    yield from _hosted(tiny_model_dir, task="embed", pooling_type="mean")


@pytest.fixture(scope="class")
def embed_server(tiny_model_dir):
    yield from _hosted(tiny_model_dir, task="embed")


@pytest.fixture(scope="class")
def generate_server(tiny_model_dir):
    yield from _hosted(tiny_model_dir)


class TestOnSharedServers:
    async def test_encode_gives_each_prompts_vector_pooled_cut_and_normalised_as_asked(self, mean_server):
        async def scenario(server: Server) -> None:
            engine = server.engine
            assert engine is not None
            ids = [5, 6, 7, 8]
            out = await engine.encode(ids)
            assert out.num_prompt_tokens == 4
            assert out.embedding == pytest.approx(fake_vector(ids, PoolingParams(type="mean")), abs=1e-6)
            cut = await engine.encode(ids, dimensions=8, normalize=False)
            assert cut.embedding == pytest.approx(
                fake_vector(ids, PoolingParams(type="mean", normalize=False, dimensions=8)), abs=1e-6
            )
            # A prompt prefilled over several steps (64 tokens a step), and many at once, batched.
            prompts = [[3 + (i * j) % 200 for j in range(10 + 17 * i)] for i in range(12)]
            outs = await engine.encode_batch(prompts)
            for prompt, got in zip(prompts, outs, strict=True):
                assert got.embedding == pytest.approx(fake_vector(prompt, PoolingParams(type="mean")), abs=1e-6)
            # Submitted longest first (request ids count up in submission order), answered in input order.
            submitted = sorted(range(len(prompts)), key=lambda i: int(outs[i].request_id.rsplit("-", 1)[1]))
            assert submitted == sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
            # A prompt may fill the whole context: nothing is generated after it.
            whole = [3 + i % 250 for i in range(engine.info.max_model_len)]
            assert (await engine.encode(whole)).num_prompt_tokens == engine.info.max_model_len
            with pytest.raises(InvalidRequestError, match=r"tokens \(max_model_len\)$"):
                await engine.encode([*whole, 5])
            stats = await engine.stats()
            assert stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks
            with pytest.raises(InvalidRequestError, match=r"^dimensions: at most the model's 32 components"):
                await engine.encode(ids, dimensions=FAKE_HIDDEN_SIZE + 1)
            with pytest.raises(InvalidRequestError, match=r"^task: this model serves embeddings"):
                await engine.generate(ids, SamplingParams(max_tokens=2))

        await mean_server.run_fresh(scenario, bound_s=60)

    async def test_a_generation_engine_refuses_an_embedding_naming_the_task(self, generate_server):
        async def scenario(server: Server) -> None:
            engine = server.engine
            assert engine is not None
            with pytest.raises(InvalidRequestError, match=r"^task: this model serves text generation"):
                await engine.encode([5, 6])
            assert (await engine.generate([5, 6], SamplingParams(max_tokens=2))).num_output_tokens == 2

        await generate_server.run_fresh(scenario, bound_s=60)

    # --- POST /v1/embeddings --------------------------------------------------

    async def test_the_openai_clients_embeddings_with_every_input_form_and_both_encodings(self, mean_server):
        import base64
        import struct

        import openai

        def calls(server: Server) -> None:
            client = openai.OpenAI(base_url=server.http_url, api_key="unused", max_retries=0, timeout=20)
            tokenize = server.engine.tokenizer.encode  # type: ignore[union-attr]
            mean = PoolingParams(type="mean")
            forms = {
                "a string": ("Hello there", [tokenize("Hello there")]),
                "strings": (["one", "two words", "three"], [tokenize(t) for t in ("one", "two words", "three")]),
                "token ids": ([5, 6, 7], [[5, 6, 7]]),
                "lists of token ids": ([[5, 6], [7, 8, 9, 10]], [[5, 6], [7, 8, 9, 10]]),
            }
            for name, (given, prompts) in forms.items():
                # Not told, the client asks for base64 and decodes it; told, it gives what came.
                for encoding in (None, "float", "base64"):
                    options = {} if encoding is None else {"encoding_format": encoding}
                    answer = client.embeddings.create(model=MODEL, input=given, **options)  # type: ignore[arg-type]
                    assert [d.index for d in answer.data] == list(range(len(prompts))), name
                    for data, prompt in zip(answer.data, prompts, strict=True):
                        got: Any = data.embedding
                        if encoding == "base64":
                            got = struct.unpack(f"<{FAKE_HIDDEN_SIZE}f", base64.b64decode(got))
                        assert list(got) == pytest.approx(fake_vector(prompt, mean), abs=1e-6), name
                    assert answer.usage.prompt_tokens == sum(map(len, prompts)) == answer.usage.total_tokens
            status, raw = post_json(server, "/v1/embeddings", {"model": MODEL, "input": [5, 6, 7], "dimensions": 4})
            assert status == 200 and len(raw["data"][0]["embedding"]) == 4
            status, b64 = post_json(
                server, "/v1/embeddings", {"model": MODEL, "input": [5, 6, 7], "encoding_format": "base64"}
            )
            vector = struct.unpack(f"<{FAKE_HIDDEN_SIZE}f", base64.b64decode(b64["data"][0]["embedding"]))
            assert list(vector) == pytest.approx(fake_vector([5, 6, 7], mean), abs=1e-6)
            status, cut = post_json(
                server, "/v1/embeddings", {"model": MODEL, "input": [[5, 6, 7, 8, 9]], "truncate_prompt_tokens": 2}
            )
            assert status == 200 and cut["usage"]["prompt_tokens"] == 2
            assert cut["data"][0]["embedding"] == pytest.approx(fake_vector([5, 6], mean), abs=1e-6)
            models = client.models.list().data
            assert [getattr(m, "task", None) for m in models] == ["embed"]

        async def scenario(server: Server) -> None:
            await in_thread(calls, server)

        await mean_server.run_fresh(scenario, bound_s=60)

    async def test_each_bad_embedding_request_is_a_400_naming_it_while_another_completes(self, embed_server):
        async def scenario(server: Server) -> None:  # one server for every case
            async def beside(good: list[int]) -> None:
                status, _ = await in_thread(post_json, server, "/v1/embeddings", {"model": MODEL, "input": "fine"})
                good.append(status)

            for body, param, says in BAD_EMBEDDINGS:
                good: list[int] = []
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(beside, good)
                    status, answer = await in_thread(post_json, server, "/v1/embeddings", {"model": MODEL, **body})
                assert status == 400 and answer["error"]["param"] == param, (body, answer)
                assert says in answer["error"]["message"], (body, answer)
                assert good == [200], body
            stats = await server.engine.stats()  # type: ignore[union-attr]
            assert stats.num_free_blocks == stats.num_total_blocks

        await embed_server.run_fresh(scenario, bound_s=60)

    async def test_each_task_refuses_the_others_endpoint_naming_the_task(self, embed_server, generate_server):
        async def on_embed(server: Server) -> None:
            status, answer = await in_thread(
                post_json, server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}
            )
            assert status == 400 and answer["error"]["param"] == "task", answer
            assert "serves embeddings" in answer["error"]["message"]

        async def on_generate(server: Server) -> None:
            status, answer = await in_thread(post_json, server, "/v1/embeddings", {"model": MODEL, "input": "hi"})
            assert status == 400 and answer["error"]["param"] == "task", answer
            assert "serves text generation" in answer["error"]["message"]

        await embed_server.run_fresh(on_embed, bound_s=60)
        await generate_server.run_fresh(on_generate, bound_s=60)

    async def test_the_websockets_embed_message(self, embed_server):
        def talk(server: Server) -> list[dict[str, Any]]:
            with open_ws(server.url) as ws:
                for message in (
                    {"type": "embed", "id": "a", "prompt_token_ids": [5, 6, 7]},
                    {"type": "embed", "id": "b", "prompt_token_ids": [5, 6, 7], "dimensions": 3, "normalize": False},
                    {"type": "embed", "id": "c", "prompt": "x", "dimensions": 999},
                    {"type": "embed", "id": "d", "prompt": "x", "dimensions": "3"},
                    {"type": "generate", "id": "e", "prompt": "x"},
                ):
                    ws.send(json.dumps(message))
                replies = [json.loads(ws.recv(timeout=20)) for _ in range(5)]
            return sorted(replies, key=lambda reply: reply["id"])

        async def scenario(server: Server) -> None:
            a, b, c, d, e = await in_thread(talk, server)
            usage = {"prompt_tokens": 3, "completion_tokens": 0, "cached_tokens": 0}
            assert a["type"] == "embedding" and a["usage"] == usage
            assert a["embedding"] == pytest.approx(fake_vector([5, 6, 7], PoolingParams()), abs=1e-6)
            assert b["embedding"] == pytest.approx(
                fake_vector([5, 6, 7], PoolingParams(normalize=False, dimensions=3)), abs=1e-6
            )
            assert (c["type"], c["field"]) == ("error", "dimensions") and "at most the model's 32" in c["message"]
            assert (d["type"], d["field"]) == ("error", "dimensions") and "must be an integer" in d["message"]
            assert (e["type"], e["field"]) == ("error", "task") and "serves embeddings" in e["message"]

        await embed_server.run_fresh(scenario, bound_s=60)


async def test_kill_9_of_the_worker_under_embeddings_resumes_every_request_and_the_engine_serves_again(fake_config):
    import os
    import signal

    from helpers.fakes import children, wait_no_children

    with trio.fail_after(60):
        config = fake_config(task="embed", step_delay_s=0.02, max_num_batched_tokens=32, restart_backoff_s=0.05)
        async with trioserve.open_engine(config=config) as engine:
            old = engine.info
            prompts = [[3 + i % 200, 4, 5, 6, 7, 8, 9, 10] for i in range(400)]
            got: list[list[float]] = []

            async def many() -> None:
                got.extend(out.embedding for out in await engine.encode_batch(prompts))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(many)
                while engine.num_requests_in_flight() < 8:
                    await trio.sleep(0.01)
                os.kill(old.worker_pids[0], signal.SIGKILL)
            # Those in flight were resumed (sent again whole) once it restarted: every vector came.
            assert engine.num_requests_in_flight() == 0 and len(got) == len(prompts)
            for prompt, vector in zip(prompts, got, strict=True):
                assert vector == pytest.approx(fake_vector(prompt, PoolingParams()), abs=1e-6)
            await engine.wait_ready()
            out = await engine.encode([5, 6, 7])
            assert out.embedding == pytest.approx(fake_vector([5, 6, 7], PoolingParams()), abs=1e-6)
            assert engine.num_restarts == 1
            assert {p.pid for p in children()} == {engine.info.engine_pid, *engine.info.worker_pids}
            stats = await engine.stats()
            assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == stats.num_waiting == 0
        assert await wait_no_children() == []


def test_the_embedding_benchmarks_texts_are_seeded_and_fit_the_context(tiny_model_dir):
    from trioserve.bench.embed import embed_texts
    from trioserve.frontend.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(tiny_model_dir("llama"))
    texts = embed_texts(tokenizer, 50, (16, 64), seed=3, limit=70)
    assert (
        texts == embed_texts(tokenizer, 50, (16, 64), seed=3, limit=70) != embed_texts(tokenizer, 50, (16, 64), 4, 70)
    )
    lengths = [len(tokenizer.encode(text)) for text in texts]
    assert len(texts) == 50 and max(lengths) <= 70 and min(lengths) >= 16 and "\ufffd" not in "".join(texts)
    with pytest.raises(ValueError, match=r"^--prompt-len: texts of 64 tokens tokenize to more than 20"):
        embed_texts(tokenizer, 5, (60, 64), seed=3, limit=20)


def test_bench_refuses_url_for_an_embedding_model(tiny_model_dir, capsys):
    from trioserve.cli import main

    argv = ["bench", "--model", str(tiny_model_dir("llama")), "--task", "embed", "--runner", "fake"]
    assert main([*argv, "--url", "http://127.0.0.1:9"]) == 2
    assert "--url: an embedding model is measured in-process only" in capsys.readouterr().err


async def test_the_embedding_benchmarks_rounds_take_turns_and_stop_at_the_baselines_error(tiny_model_dir):
    """``bench --rounds``: sentence-transformers goes second in odd rounds and
    first in even ones, the engine encodes every text each round, and the
    baseline's first error is the last round run."""
    from trioserve.bench.embed import _rounds

    config = make_fake_config(str(tiny_model_dir("llama")), **DEFAULTS, task="embed", pooling_type="mean")
    texts = ["a b c", "d e", "f g h i", "j"]
    calls: list[str] = []
    baseline = {"seconds": 1.0, "inputs": 4, "tokens": 9, "dimensions": FAKE_HIDDEN_SIZE}
    answers = [baseline, baseline, {"error": "exit 1: boom"}, baseline]
    real_encode_batch = Engine.encode_batch

    async def encode_batch(self: Engine, prompts: list[str], *args: Any, **kwargs: Any) -> Any:
        calls.append(f"ours {len(prompts)}")
        return await real_encode_batch(self, prompts, *args, **kwargs)

    def theirs() -> dict[str, Any]:
        calls.append("theirs")
        return answers[len([c for c in calls if c == "theirs"]) - 1]

    with trio.fail_after(30), pytest.MonkeyPatch.context() as patch:
        patch.setattr(Engine, "encode_batch", encode_batch)
        rounds = await _rounds(config, texts, 2, 5, theirs)
    assert calls == ["ours 2", "ours 4", "theirs", "theirs", "ours 4", "ours 4", "theirs"]  # warm-up first
    assert [row["sentence-transformers"] for row in rounds] == answers[:3]
    assert all(row["trioserve"]["inputs"] == 4 and row["trioserve"]["dimensions"] == FAKE_HIDDEN_SIZE for row in rounds)


def test_bench_rounds_are_bounded_and_for_an_embedding_model_only(tiny_model_dir, capsys):
    from trioserve.cli import main

    argv = ["bench", "--model", str(tiny_model_dir("llama")), "--runner", "fake"]
    assert main([*argv, "--task", "embed", "--rounds", "0"]) == 2
    assert "--rounds: must be in [1, 100] (got 0)" in capsys.readouterr().err
    assert main([*argv, "--rounds", "2"]) == 2
    assert "--rounds: for an embedding model only" in capsys.readouterr().err
