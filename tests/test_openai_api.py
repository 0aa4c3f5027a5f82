"""The OpenAI-compatible API of a real server (in-process, the fake runner),
driven by the official ``openai`` client in threads, and by raw HTTP where
the client would hide what the server sent.

Tests that need no server options of their own share one server
(``shared_server``, a ``HostedServer``), its prefix cache emptied before each.
"""

from __future__ import annotations

import contextlib
import functools
import json
import socket
import time
from typing import Any

import openai
import pytest
import trio
from helpers.fakes import SERVING, make_fake_config
from helpers.hosted import HostedServer, held
from helpers.server import raw_request, serving, wait_blocks_free
from helpers.waiting import in_thread, wait_until
from prometheus_client.parser import text_string_to_metric_families

from trioserve.server import Server

pytestmark = pytest.mark.fake_config(**SERVING)

MODEL = "tiny-llama"  # the served model's name in these tests


@pytest.fixture(scope="module")
def shared_server(tiny_model_dir):
    yield from held(HostedServer(make_fake_config(str(tiny_model_dir("llama")), **SERVING), model_name=MODEL))


def client(server: Server, **options: Any) -> openai.OpenAI:
    options.setdefault("api_key", "unused")
    return openai.OpenAI(base_url=server.http_url, max_retries=0, timeout=20, **options)


def stream_text(stream: Any, n: int = 1) -> tuple[list[str], list[str | None], Any]:
    texts, finishes, usage = [""] * n, [None] * n, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] += piece or ""
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    return texts, finishes, usage


async def chat_prompt_tokens(server: Server, messages: list[dict[str, str]]) -> int:
    engine = server.engine
    assert engine is not None
    return len(engine.tokenizer.encode(await engine.render_chat(messages), add_special_tokens=False))


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


# --- the official client -------------------------------------------------------------


async def test_completions_streamed_and_not_give_the_same_text_and_the_right_usage(shared_server):
    async def scenario(server: Server) -> None:
        api = client(server)
        whole = await in_thread(api.completions.create, model=MODEL, prompt="Hello there", max_tokens=12, temperature=0)
        streamed = await in_thread(
            api.completions.create,
            model=MODEL,
            prompt="Hello there",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        texts, finishes, usage = await in_thread(stream_text, streamed)
        assert server.engine is not None
        prompt_tokens = len(server.engine.tokenizer.encode("Hello there"))
        assert whole.object == "text_completion" and whole.model == MODEL
        assert [c.index for c in whole.choices] == [0] and whole.choices[0].text
        assert texts == [whole.choices[0].text] and finishes == [whole.choices[0].finish_reason] == ["length"]
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (
            prompt_tokens,
            12,
            prompt_tokens + 12,
        )
        assert usage is not None and usage.model_dump(exclude={"prompt_tokens_details"}) == whole.usage.model_dump(
            exclude={"prompt_tokens_details"}
        )
        # The second request found the first 8 of its 12 prompt tokens in the prefix cache.
        assert whole.usage.prompt_tokens_details.cached_tokens == 0 and usage.prompt_tokens_details.cached_tokens == 8

    await shared_server.run_fresh(scenario)


async def test_usage_reports_the_prompt_tokens_found_in_the_prefix_cache(shared_server):
    prompt = (
        "A system prompt that two requests share, and then: "  # 52 tokens: the first 48 (12 blocks of 4) can be cached
    )

    async def scenario(server: Server) -> None:
        api = client(server)
        first = await in_thread(api.completions.create, model=MODEL, prompt=prompt, max_tokens=4)
        second = await in_thread(api.completions.create, model=MODEL, prompt=prompt, max_tokens=4)
        streamed = await in_thread(
            api.completions.create,
            model=MODEL,
            prompt=prompt,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        _, _, usage = await in_thread(stream_text, streamed)
        assert first.usage.prompt_tokens == 52 and first.usage.prompt_tokens_details.cached_tokens == 0
        assert second.usage.prompt_tokens_details.cached_tokens == 48
        assert usage is not None and usage.prompt_tokens_details.cached_tokens == 48

    await shared_server.run_fresh(scenario)


async def test_chat_completions_streamed_and_not_give_the_same_text_and_n_2_gives_two_choices(shared_server):
    async def scenario(server: Server) -> None:
        api = client(server)
        create = api.chat.completions.create
        whole = await in_thread(create, model=MODEL, messages=MESSAGES, max_completion_tokens=10, temperature=0)
        streamed = await in_thread(create, model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, stream=True)
        texts, finishes, usage = await in_thread(stream_text, streamed)
        two = await in_thread(create, model=MODEL, messages=MESSAGES, max_tokens=7, n=2, seed=3)
        two_streamed = await in_thread(
            create,
            model=MODEL,
            messages=MESSAGES,
            max_tokens=7,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
        texts2, finishes2, usage2 = await in_thread(stream_text, two_streamed, 2)
        prompt_tokens = await chat_prompt_tokens(server, MESSAGES)
        message = whole.choices[0].message
        assert whole.object == "chat.completion" and message.role == "assistant" and message.content
        assert texts == [message.content] and finishes == ["length"] and usage is None
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_tokens, 10)
        assert [c.index for c in two.choices] == [0, 1] and all(c.message.content for c in two.choices)
        assert (two.usage.prompt_tokens, two.usage.completion_tokens, two.usage.total_tokens) == (
            prompt_tokens,
            14,
            prompt_tokens + 14,
        )
        assert all(texts2) and finishes2 == ["length", "length"]
        assert usage2 is not None and (usage2.prompt_tokens, usage2.completion_tokens) == (prompt_tokens, 14)

    await shared_server.run_fresh(scenario)


async def test_models_lists_the_served_model_and_stop_strings_end_a_request(shared_server):
    async def scenario(server: Server) -> None:
        api = client(server)
        models = await in_thread(api.models.list)
        model = await in_thread(api.models.retrieve, MODEL)
        with pytest.raises(openai.NotFoundError, match="is not served here"):
            await in_thread(api.models.retrieve, "gpt-4")
        whole = await in_thread(api.completions.create, model=MODEL, prompt="Hello", max_tokens=30, temperature=0)
        stop = whole.choices[0].text[3:5]
        stopped = await in_thread(api.completions.create, model=MODEL, prompt="Hello", max_tokens=30, stop=stop)
        assert [m.id for m in models.data] == [MODEL]
        assert model == models.data[0] and model.object == "model"
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].text == whole.choices[0].text[: whole.choices[0].text.index(stop)]

    await shared_server.run_fresh(scenario)


@pytest.fixture(scope="class")
def key_server(tiny_model_dir):
    """A server with an API key (10 ms steps) for the tests of a class."""
    config = make_fake_config(str(tiny_model_dir("llama")), **{**SERVING, "step_delay_s": 0.01})
    host = HostedServer(config, model_name=MODEL, api_key="sesame")
    yield host
    host.close()


class TestOnOneServerWithAnApiKey:
    async def test_the_api_key_is_required_on_the_api_but_not_on_health_and_metrics(self, key_server):
        async def scenario(server: Server) -> None:
            with pytest.raises(openai.AuthenticationError) as info:
                await in_thread(client(server, api_key="wrong").models.list)
            good = await in_thread(client(server, api_key="sesame").models.list)
            health = await in_thread(raw_request, server, "GET", "/health")
            metrics = await in_thread(raw_request, server, "GET", "/metrics")
            assert info.value.status_code == 401
            assert info.value.body == {  # type: ignore[comparison-overlap]
                "message": "missing or wrong API key: send 'Authorization: Bearer <key>'",
                "type": "authentication_error",
                "param": None,
                "code": "invalid_api_key",
            }
            assert [m.id for m in good.data] == [MODEL]
            assert health[0] == 200 and metrics[0] == 200

        await key_server.run_fresh(scenario, bound_s=60)

    async def test_the_engine_is_paused_slept_and_resumed_over_http_and_health_says_so(self, key_server):
        """Requests running when generation is paused with mode=abort end with a
        503 ``aborted`` (an error event in a stream), never a short "success"."""
        auth = {"Authorization": "Bearer sesame"}

        async def scenario(server: Server) -> None:
            assert (await in_thread(raw_request, server, "POST", "/v1/engine/pause"))[0] == 401
            api = client(server, api_key="sesame")
            cut: dict[str, BaseException] = {}
            long = {"model": MODEL, "max_tokens": 2000, "extra_body": {"ignore_eos": True}}

            async def whole() -> None:
                with pytest.raises(openai.InternalServerError) as info:
                    await in_thread(api.completions.create, prompt="Hi", **long)
                cut["whole"] = info.value

            async def streamed() -> None:
                with pytest.raises(openai.APIError) as info:
                    await in_thread(
                        stream_text,
                        await in_thread(api.chat.completions.create, messages=MESSAGES, stream=True, **long),
                    )
                cut["streamed"] = info.value

            async with trio.open_nursery() as nursery:
                nursery.start_soon(whole)
                nursery.start_soon(streamed)
                with trio.fail_after(10):
                    while (await server.engine.stats()).num_running < 2:  # type: ignore[union-attr]
                        await trio.sleep(0.02)
                paused = await in_thread(raw_request, server, "POST", "/v1/engine/pause?mode=abort", headers=auth)
            health_paused = await in_thread(raw_request, server, "GET", "/health")
            bad = await in_thread(raw_request, server, "POST", "/v1/engine/sleep?level=3", headers=auth)
            asleep = await in_thread(raw_request, server, "POST", "/v1/engine/sleep?level=1", headers=auth)
            woken = await in_thread(raw_request, server, "POST", "/v1/engine/wake_up", headers=auth)
            resumed = await in_thread(raw_request, server, "POST", "/v1/engine/resume", headers=auth)
            answer = await in_thread(
                client(server, api_key="sesame").completions.create, model=MODEL, prompt="Hi", max_tokens=3
            )
            assert (paused[0], json.loads(paused[2])) == (200, {"health": "paused"})
            for error in cut.values():
                assert "mode=abort" in str(error) and error.code == "aborted"  # type: ignore[attr-defined]
            assert cut["whole"].status_code == 503  # type: ignore[attr-defined]
            assert (health_paused[0], json.loads(health_paused[2])) == (503, {"status": "paused"})
            assert bad[0] == 400 and "level: must be 1 or 2" in json.loads(bad[2])["error"]["message"]
            assert (asleep[0], json.loads(asleep[2])) == (200, {"health": "sleeping"})
            # still paused: only resume ends that
            assert (woken[0], json.loads(woken[2])) == (200, {"health": "paused"})
            assert (resumed[0], json.loads(resumed[2])) == (200, {"health": "ready"})
            assert answer.choices[0].finish_reason == "length"

        await key_server.run_fresh(scenario, bound_s=60)


# --- bad requests ----------------------------------------------------------------------


UNKNOWN_FIELDS = [  # (path, body, the field refused with --strict-fields)
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "x", "a`b": 1}', "a`b"),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "x", "bogus": 1}', "bogus"),
    (
        "/v1/chat/completions",
        b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x", "mood": 1}]}',
        "messages[0].mood",
    ),
]


@pytest.mark.parametrize("strict", [False, True])
async def test_unknown_fields_are_ignored_with_one_warning_per_name_or_refused_with_strict_fields(
    fake_config, strict, caplog
):
    with trio.fail_after(60):
        async with serving(fake_config(), model_name=MODEL, strict_fields=strict) as server:
            for _ in range(2):
                for path, body, field in UNKNOWN_FIELDS:
                    status, _, payload = await in_thread(raw_request, server, "POST", path, body)
                    answer = json.loads(payload)
                    if strict:
                        assert (status, answer["error"]["param"], answer["error"]["code"]) == (
                            400,
                            field,
                            "unknown_field",
                        )
                    else:
                        assert status == 200, answer
    ignored = [r.getMessage() for r in caplog.records if "ignored the request field" in r.getMessage()]
    if not strict:  # one line per name, not per request: a client cannot fill the log
        assert sorted(ignored) == sorted(
            f"ignored the request field {name!r}, which this server does not use (--strict-fields refuses it)"
            for name in ("a`b", "bogus", "messages[].mood")
        )


BAD_REQUESTS = [
    # (path, body, status, param, code)
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "x"', 400, None, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, None, "invalid_json"),
    (
        "/v1/completions",
        b'{"model": "tiny-llama", "prompt": "x", "temperature": -1}',
        400,
        "temperature",
        "invalid_value",
    ),
    (
        "/v1/completions",
        b'{"model": "tiny-llama", "prompt": "x", "max_tokens": "many"}',
        400,
        "max_tokens",
        "invalid_type",
    ),
    (
        "/v1/chat/completions",
        b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}',
        400,
        "max_completion_tokens",
        "invalid_value",
    ),
    (
        "/v1/chat/completions",
        b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], '
        b'"logprobs": true, "top_logprobs": 21}',
        400,
        "top_logprobs",
        "invalid_value",
    ),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "x", "n": 0}', 400, "n", "invalid_value"),
    (
        "/v1/completions",
        b'{"model": "tiny-llama", "prompt": "' + b"long " * 400 + b'"}',
        400,
        "prompt",
        "context_length_exceeded",
    ),
    (
        "/v1/chat/completions",
        b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "' + b"long " * 400 + b'"}]}',
        400,
        "messages",
        "context_length_exceeded",
    ),
    ("/v1/completions", b'{"prompt": "x"}', 400, "model", "missing_field"),
    ("/v1/completions", b'{"model": "gpt-4", "prompt": "x"}', 404, "model", "model_not_found"),
    ("/v1/nothing", b"{}", 404, None, "not_found"),
    # More samples than the engine takes at once (max_num_seqs + max_waiting_requests = 8): no retry could run it.
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "x", "n": 9}', 400, "n", "invalid_value"),
]


async def test_every_bad_request_gets_an_openai_error_object_and_a_request_beside_it_completes(fake_config):
    with trio.fail_after(90):
        # 150 steps of 30 ms: the long request runs about 4.5 s, while the bad ones are sent one by one.
        engine_config = fake_config(max_model_len=256, step_delay_s=0.03, max_num_seqs=4, max_waiting_requests=4)
        async with serving(engine_config, model_name=MODEL) as server:
            api = client(server)
            results: dict[str, Any] = {}

            async def long_request() -> None:
                stream = await in_thread(
                    api.completions.create,
                    model=MODEL,
                    prompt="Beside",
                    max_tokens=150,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                results["long"] = await in_thread(stream_text, stream)

            async def long_request_running() -> bool:
                assert server.engine is not None
                return (await server.engine.stats()).num_running == 1

            async with trio.open_nursery() as nursery:
                nursery.start_soon(long_request)
                await wait_until(long_request_running, 10, "the long request running")
                for path, body, *_ in BAD_REQUESTS:
                    results[path, body] = await in_thread(raw_request, server, "POST", path, body)
                results["405"] = await in_thread(raw_request, server, "GET", "/v1/completions")
                results["413"] = await in_thread(
                    raw_request, server, "POST", "/v1/completions", declared_length=2 << 20
                )
                assert "long" not in results, "the long request ended before the bad ones were sent"
    for path, body, status, param, code in BAD_REQUESTS:
        got_status, headers, payload = results[path, body]
        error = json.loads(payload)["error"]
        assert (got_status, error["param"], error["code"]) == (status, param, code), (path, body[:80], error)
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert param is None or error["message"].startswith(param), error
        assert headers["content-type"] == "application/json"
    assert results["405"][0] == 405 and json.loads(results["405"][2])["error"]["code"] == "method_not_allowed"
    assert results["413"][0] == 413
    assert json.loads(results["413"][2])["error"] == {
        "message": f"request body of {2 << 20} bytes is larger than {1 << 20}",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_too_large",
    }
    texts, finishes, _ = results["long"]
    assert finishes == ["length"] and texts[0]


# --- disconnects, metrics, keep-alive -----------------------------------------------------


async def test_a_streaming_client_that_disconnects_has_its_request_aborted_and_its_blocks_freed(fake_config):
    body = json.dumps(
        {"model": MODEL, "prompt": "Go on", "max_tokens": 2000, "stream": True, "ignore_eos": True, "n": 2}
    ).encode()
    with trio.fail_after(60):
        async with serving(fake_config(step_delay_s=0.01), model_name=MODEL) as server:
            assert server.engine is not None

            def read_a_little_then_leave() -> bytes:
                with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
                    sock.sendall(head.encode() + body)
                    data = b""
                    while data.count(b"data: ") < 6:
                        data += sock.recv(4096)
                    return data

            data = await in_thread(read_a_little_then_leave)
            assert b"text/event-stream" in data and b"transfer-encoding: chunked" in data.lower()
            running = await server.engine.stats()
            await wait_blocks_free(server)
            assert server.engine.num_requests_in_flight() == 0
            metrics = parse_metrics((await in_thread(raw_request, server, "GET", "/metrics"))[2])
    assert running.num_running + running.num_waiting <= 2  # (it may have been aborted already)
    assert metrics["vllm:request_success_total", (("engine", "0"), ("finished_reason", "abort"))] == 2


def parse_metrics(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "model_name"}  # (one model: its name is MODEL)
            samples[sample.name, tuple(sorted(labels.items()))] = sample.value
    return samples


async def test_metrics_parse_and_their_counters_move_as_requests_are_served(fake_config):
    engine0 = (("engine", "0"),)
    with trio.fail_after(60):
        async with serving(fake_config(), model_name=MODEL) as server:
            status, headers, before_text = await in_thread(raw_request, server, "GET", "/metrics")
            api = client(server)
            await in_thread(api.completions.create, model=MODEL, prompt="Count me", max_tokens=9)
            await in_thread(api.chat.completions.create, model=MODEL, messages=MESSAGES, max_tokens=4, n=2)
            after = parse_metrics((await in_thread(raw_request, server, "GET", "/metrics"))[2])
            chat_tokens = await chat_prompt_tokens(server, MESSAGES)
            prompt_tokens = len(server.engine.tokenizer.encode("Count me")) + 2 * chat_tokens
    before = parse_metrics(before_text)
    assert status == 200 and headers["content-type"].startswith("text/plain")
    length = ("vllm:request_success_total", (("engine", "0"), ("finished_reason", "length")))
    assert before[length] == 0 and after[length] == 3
    assert after["vllm:prompt_tokens_total", engine0] - before["vllm:prompt_tokens_total", engine0] == (prompt_tokens)
    assert after["vllm:generation_tokens_total", engine0] == 9 + 2 * 4
    assert after["vllm:time_to_first_token_seconds_count", engine0] == 3
    assert after["vllm:e2e_request_latency_seconds_count", engine0] == 3
    assert after["vllm:inter_token_latency_seconds_count", engine0] == 8 + 2 * 3
    assert after["vllm:num_requests_running", engine0] == 0
    assert after["vllm:kv_cache_usage_perc", engine0] == 0
    assert after["trioserve_engine_restarts_total", engine0] == 0
    assert ("vllm:num_preemptions_total", engine0) in after


def test_preemptions_count_a_restarted_engines_own_even_once_it_has_caught_up():
    """The engine core counts preemptions since its start. Found: a new life
    that reached the old one's count before a scrape added only the
    difference (5 + 5 preemptions were counted as 5)."""
    from prometheus_client.exposition import generate_latest

    from trioserve.messages import EngineStats
    from trioserve.server.metrics import ServerMetrics

    metrics = ServerMetrics()

    def scrape(num_restarts: int, num_preemptions: int) -> float:
        metrics.update_restarts([num_restarts])
        metrics.update_from_stats(EngineStats(0, 0, 8, 8, num_preemptions, 50))
        return parse_metrics(generate_latest(metrics.registry))["vllm:num_preemptions_total", (("engine", "0"),)]

    assert scrape(0, 5) == 5
    assert scrape(1, 5) == 10  # a new life, 5 of its own
    assert scrape(1, 7) == 12
    assert scrape(2, 1) == 13


async def test_a_request_refused_as_overloaded_counts_nothing_whatever_its_n(fake_config):
    """Found: with room for one of its two samples, the refused request's
    first sample was counted as an abort."""
    with trio.fail_after(60):
        cfg = fake_config(max_num_seqs=1, max_waiting_requests=1, step_delay_s=0.01)
        async with serving(cfg, model_name=MODEL) as server:
            api = client(server)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    functools.partial(in_thread, api.completions.create, model=MODEL, prompt="a", max_tokens=300)
                )
                with trio.fail_after(10):
                    while (await server.engine.stats()).num_running < 1:  # type: ignore[union-attr]
                        await trio.sleep(0.02)
                with pytest.raises(openai.InternalServerError, match="retry later"):
                    await in_thread(api.completions.create, model=MODEL, prompt="b", max_tokens=4, n=2)
            after = parse_metrics((await in_thread(raw_request, server, "GET", "/metrics"))[2])
    requests = {reason: after["vllm:request_success_total", (("engine", "0"), ("finished_reason", reason))]
                for reason in ("length", "abort")}  # fmt: skip
    assert requests == {"length": 1, "abort": 0}
    assert after["vllm:e2e_request_latency_seconds_count", (("engine", "0"),)] == 1


async def test_with_two_engines_each_metric_is_each_engines_own(fake_config):
    """Data parallel: every series exists for engine 0 and engine 1 from the
    start, a request counts under the engine it ran on, and the gauges are
    each engine's own (not the sum under engine 0)."""
    with trio.fail_after(60):
        async with serving(fake_config(data_parallel_size=2, step_delay_s=0.02), model_name=MODEL) as server:
            before = parse_metrics((await in_thread(raw_request, server, "GET", "/metrics"))[2])
            api = client(server)
            async with trio.open_nursery() as nursery:  # six at once: the least loaded engine takes each
                for i in range(6):
                    nursery.start_soon(
                        functools.partial(in_thread, api.completions.create, model=MODEL, prompt=f"n{i}", max_tokens=5)
                    )
            engine = server.engine
            assert engine is not None
            stats = await engine.stats()
            after = parse_metrics((await in_thread(raw_request, server, "GET", "/metrics"))[2])
    for index in ("0", "1"):
        assert before["vllm:request_success_total", (("engine", index), ("finished_reason", "length"))] == 0
        assert ("vllm:num_requests_running", (("engine", index),)) in before
    served = [after["vllm:request_success_total", (("engine", i), ("finished_reason", "length"))] for i in "01"]
    assert served == [e.num_requests for e in stats.engines]  # each engine's own count, as the engine says
    assert sum(served) == 6 and all(n > 0 for n in served)
    generated = [after["vllm:generation_tokens_total", (("engine", i),)] for i in "01"]
    assert generated == [5 * n for n in served]


async def test_keep_alive_serves_several_requests_on_one_connection_and_an_idle_one_is_closed(fake_config):
    with trio.fail_after(60):
        async with serving(
            fake_config(), model_name=MODEL, keepalive_timeout_s=0.5, max_http_requests_per_connection=3
        ) as server:

            def three_then_closed() -> tuple[list[int], float, bytes]:
                statuses = []
                with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                    file = sock.makefile("rb")
                    for _ in range(3):
                        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
                        statuses.append(int(file.readline().split()[1]))
                        length = 0
                        while (line := file.readline()) != b"\r\n":
                            if line.lower().startswith(b"content-length:"):
                                length = int(line.split(b":")[1])
                        file.read(length)
                    return statuses, 0.0, file.read()  # the server closes after the third

            def idle() -> float:
                with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                    start = time.monotonic()
                    data = b""
                    while chunk := sock.recv(4096):
                        data += chunk
                    assert data.startswith(b"HTTP/1.1 200")
                    return time.monotonic() - start

            statuses, _, rest = await in_thread(three_then_closed)
            waited = await in_thread(idle)
    assert statuses == [200, 200, 200] and rest == b""
    assert 0.4 <= waited < 2.0


# --- what a hostile client found (review) ----------------------------------------------


def exchange(server: Server, data: bytes, timeout: float = 20) -> bytes:
    """Send ``data`` on a fresh connection, then read until the server closes
    it (a reset counts as a close): everything the server sent."""
    received = b""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
            while chunk := sock.recv(65536):
                received += chunk
        except (ConnectionResetError, BrokenPipeError):
            received += b"<reset>"
    return received


def post(path: str, body: bytes, *headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Length: {len(body)}", "Connection: close", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def test_a_body_that_is_not_utf8_gets_invalid_json_and_the_server_serves_on(shared_server):
    # Found: msgspec raised UnicodeDecodeError, which nothing caught: the
    # connection was dropped without a response and "a connection failed" logged.
    body = b'{"model": "tiny-llama", "prompt": "caf\xe9"}'

    async def scenario(server: Server) -> None:
        answer = await in_thread(exchange, server, post("/v1/completions", body))
        chat = await in_thread(
            exchange,
            server,
            post(
                "/v1/chat/completions",
                b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\xff"}]}',
            ),
        )
        after = await in_thread(raw_request, server, "GET", "/v1/models")
        for data in (answer, chat):
            assert data.startswith(b"HTTP/1.1 400 "), data
            error = json.loads(data.partition(b"\r\n\r\n")[2])["error"]
            assert error["code"] == "invalid_json" and "UTF-8" in error["message"], error
        assert after[0] == 200

    await shared_server.run_fresh(scenario)


async def test_a_client_that_never_reads_a_whole_response_is_dropped_after_the_slow_consumer_timeout(fake_config):
    # Found: a non-streamed response was sent without any bound: a client
    # that never reads it held its connection (and a slot of
    # --max-connections) forever, past every timeout.
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1000, "n": 16, "ignore_eos": True}).encode()
    with trio.fail_after(60):
        async with serving(
            fake_config(step_delay_s=0.001, num_kv_blocks=8192),
            model_name=MODEL,
            slow_consumer_timeout_s=1.0,
            socket_send_buffer_bytes=4096,
        ) as server:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            try:
                await in_thread(sock.connect, ("127.0.0.1", server.port))
                await in_thread(sock.sendall, post("/v1/completions", body))  # then never read
                with trio.move_on_after(15):
                    while server.num_connections or server.engine.num_requests_in_flight():  # type: ignore[union-attr]
                        await trio.sleep(0.05)
                held = server.num_connections
                await wait_blocks_free(server)
            finally:
                sock.close()
    assert held == 0, "the connection of a client that reads nothing is still held 15 s on"


@pytest.fixture(scope="class")
def small_body_server(tiny_model_dir):
    """A server of 64 KiB messages and 2 requests a connection, for the tests of a class."""
    config = make_fake_config(str(tiny_model_dir("llama")), **SERVING)
    host = HostedServer(config, model_name=MODEL, max_message_bytes=64 * 1024, max_http_requests_per_connection=2)
    yield host
    host.close()


class TestOnOneServerOfSmallBodies:
    async def test_a_body_over_the_limit_gets_its_413_even_when_the_client_sent_it_whole(self, small_body_server):
        # Found: the server answered 413 and closed at once with the rest of the
        # body unread, so the kernel sent a reset and the client lost the 413
        # (ECONNRESET instead of the documented answer).
        async def scenario(server: Server) -> None:
            answer = await in_thread(exchange, server, post("/v1/completions", b"x" * (8 << 20)))
            assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]

        await small_body_server.run_fresh(scenario, bound_s=60)

    async def test_a_body_announced_too_large_with_expect_100_continue_gets_413_and_no_100(self, small_body_server):
        # Found: "100 Continue" went out before the declared length was checked,
        # inviting the client to send a body the server then refused (RFC 9110:
        # a server that will refuse the body answers with the final status instead).
        head = post("/v1/completions", b"", "Expect: 100-continue").replace(
            b"Content-Length: 0", b"Content-Length: 2097152"
        )

        async def scenario(server: Server) -> None:
            answer = await in_thread(exchange, server, head)
            assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]

        await small_body_server.run_fresh(scenario, bound_s=60)

    async def test_the_last_response_a_connection_serves_says_connection_close(self, small_body_server):
        # Found: after its last request (max_http_requests_per_connection) the
        # server closed the connection without saying so in the response, so a
        # client reusing it could send a request nobody would read (RFC 9112 9.6).
        request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"

        async def scenario(server: Server) -> None:
            answer = await in_thread(exchange, server, request * 2)
            first, second = answer.split(b"HTTP/1.1 200 OK")[1:]
            assert b"Connection: close" not in first and b"Connection: close" in second, answer

        await small_body_server.run_fresh(scenario, bound_s=60)


async def test_a_body_that_never_ends_frees_its_connection_at_the_body_deadline(fake_config):
    # Found: after the body deadline (--handshake-timeout) the server read on
    # for another --handshake-timeout to drop the rest of the body it had
    # given up on: a slow body held its connection twice the documented bound.
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
    with trio.fail_after(60):
        async with serving(fake_config(), model_name=MODEL, handshake_timeout_s=2.0) as server:
            started = trio.current_time()
            await in_thread(exchange, server, head)
            held = trio.current_time() - started
    assert held < 3.2, f"held {held:.1f}s; the body deadline is 2s (twice that was the bug)"


async def test_a_shutdown_ends_http_requests_past_the_grace_with_a_shutdown_error(fake_config):
    # Found: past the grace, an SSE stream was cut mid-stream (no error event,
    # no [DONE], no last chunk) and a non-streamed request got an empty reply,
    # where a WebSocket request gets error "shutdown".
    def body(stream: bool) -> bytes:
        request = {"model": MODEL, "prompt": "Hi", "max_tokens": 2000, "ignore_eos": True, "stream": stream}
        return json.dumps(request).encode()

    with trio.fail_after(60):
        async with serving(fake_config(step_delay_s=0.01), model_name=MODEL, shutdown_grace_s=0.5) as server:
            answers: dict[bool, bytes] = {}

            async def one(stream: bool) -> None:
                answers[stream] = await in_thread(exchange, server, post("/v1/completions", body(stream)))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, True)
                nursery.start_soon(one, False)
                assert server.engine is not None
                while server.engine.num_requests_in_flight() < 2:
                    await trio.sleep(0.02)
                server.shutdown()
    sse, whole = answers[True], answers[False]
    assert sse.startswith(b"HTTP/1.1 200 ") and b'"code": "shutdown"' in sse, sse[-300:]
    assert sse.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), sse[-300:]
    assert whole.startswith(b"HTTP/1.1 503 "), whole[:300]
    assert json.loads(whole.partition(b"\r\n\r\n")[2])["error"]["code"] == "shutdown"


async def test_a_body_of_one_byte_chunks_is_refused_before_it_costs_seconds_of_parsing(shared_server):
    # Found: every chunk of a chunked body is one h11 event parsed on the
    # event loop (~25 us each): 200,000 one-byte chunks (1.2 MB on the wire,
    # within --max-message-bytes) took the server about 5 s of CPU, in slices
    # of ~0.2 s during which nothing else (streams, /health) ran.
    chunks = b"".join(b"1\r\nx\r\n" for _ in range(200_000))
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"

    async def scenario(server: Server) -> None:
        started = trio.current_time()
        answer = await in_thread(exchange, server, request + chunks + b"0\r\n\r\n")
        took = trio.current_time() - started
        assert answer.startswith((b"HTTP/1.1 400 ", b"HTTP/1.1 413 ")), answer[:200]
        assert took < 2.0, f"the server spent {took:.1f}s on one request body"

    await shared_server.run_fresh(scenario)


async def test_the_gauges_are_read_while_the_engine_is_paused(fake_config):
    """Found: the gauges were read only while the engine was ready, so after
    a pause that aborted a running request /metrics still said one ran."""
    running = ("vllm:num_requests_running", (("engine", "0"),))
    with trio.fail_after(60):
        async with serving(fake_config(step_delay_s=0.01), model_name=MODEL) as server:
            engine = server.engine
            assert engine is not None
            api = client(server)
            async with trio.open_nursery() as nursery:

                async def long_request() -> None:
                    with contextlib.suppress(openai.APIStatusError):  # ended by the pause
                        await in_thread(
                            api.completions.create,
                            model=MODEL,
                            prompt="a",
                            max_tokens=2000,
                            extra_body={"ignore_eos": True},
                        )

                nursery.start_soon(long_request)
                while (await engine.stats()).num_running < 1:
                    await trio.sleep(0.02)
                assert parse_metrics((await in_thread(raw_request, server, "GET", "/metrics"))[2])[running] == 1
                await engine.pause(mode="abort")
            assert engine.health == "paused"
            assert parse_metrics((await in_thread(raw_request, server, "GET", "/metrics"))[2])[running] == 0
