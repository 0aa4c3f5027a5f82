"""vLLM's request fields end to end on a tiny real model: through the engine
(``min_tokens``, ``logit_bias``, ``allowed_token_ids``, ``bad_words``,
``prompt_logprobs`` across chunked prefill and the prefix cache,
``include_stop_str_in_output``, bad values refused beside a request that
completes), then over the OpenAI API with the official client (``echo``,
``extra_body``, ``stream_options.continuous_usage_stats``, 400s naming the
field). One server (``HostedServer``) for both, many requests on it."""

from __future__ import annotations

from typing import Any

import openai
import pytest
import trio
from helpers.hosted import HostedServer, held
from helpers.waiting import in_thread

import trioserve
from trioserve import EngineConfig, SamplingParams
from trioserve.errors import InvalidRequestError
from trioserve.gpu.tiny_models import EOS_ID, VOCAB_SIZE
from trioserve.server import Server

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.model

LETTERS = [3 + ord(c) for c in "abcde"]  # the tiny tokenizer: byte b is token 3 + b
PROMPT = [1, *range(40, 70)]  # 31 tokens: several prefill chunks of 16


def engine_config(model_dir: Any) -> EngineConfig:
    return EngineConfig(model=str(model_dir), block_size=4, max_num_batched_tokens=16, shutdown_grace_s=3.0)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    yield from held(HostedServer(engine_config(tiny_model_dir("llama")), model_name="tiny-llama"))


def full_forward_logprobs(model_dir: Any, prompt: list[int]) -> torch.Tensor:
    """``log_softmax`` of transformers' own logits at every prompt position: ``[P, V]``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0].float().log_softmax(dim=1)


async def generate(engine: trioserve.Engine, prompt: list[int] | str, **fields: Any) -> trioserve.RequestOutput:
    return await engine.generate(prompt, SamplingParams(**fields))


def test_the_fields_act_on_the_tokens_of_a_real_model(tiny_model_dir, server):
    expected = full_forward_logprobs(tiny_model_dir("llama"), PROMPT)
    server.call(lambda s: the_fields_act(s.engine, expected), bound_s=150)


async def the_fields_act(engine: trioserve.Engine, expected: torch.Tensor) -> None:
    await engine.reset_prefix_cache()  # as on a fresh engine: nothing cached by the other test
    hits = (await engine.stats()).prefix_cache_hits
    # logit_bias: a huge bias forces its token, greedy or sampled; EOS so biased ends at once.
    for temperature in (0, 1.0):
        out = await generate(engine, PROMPT, max_tokens=6, temperature=temperature, logit_bias={100: 100})
        assert out.token_ids == [100] * 6
    out = await generate(engine, PROMPT, max_tokens=10, temperature=0, logit_bias={EOS_ID: 100})
    assert (out.token_ids, out.finish_reason) == ([EOS_ID], "stop")
    # min_tokens: EOS cannot come before, and ends the request right after.
    out = await generate(engine, PROMPT, max_tokens=10, temperature=0, logit_bias={EOS_ID: 100}, min_tokens=4)
    assert len(out.token_ids) == 5 and out.token_ids[-1] == EOS_ID and EOS_ID not in out.token_ids[:4]
    assert out.finish_reason == "stop"
    # allowed_token_ids, sampled.
    out = await generate(engine, PROMPT, max_tokens=24, temperature=1.5, seed=3, allowed_token_ids=LETTERS)
    assert set(out.token_ids) <= set(LETTERS) and len(out.token_ids) == 24
    # bad_words: the text of the greedy output's first two letters never comes again.
    letters = {"temperature": 0, "max_tokens": 12, "allowed_token_ids": LETTERS}
    plain = await generate(engine, PROMPT, **letters)
    word = plain.text[:2]
    banned = await generate(engine, PROMPT, bad_words=[word], **letters)
    assert banned.token_ids[0] == plain.token_ids[0] and banned.token_ids[1] != plain.token_ids[1]
    assert word not in banned.text
    one_letter = await generate(engine, PROMPT, bad_words=[plain.text[0], " x"], **letters)
    assert plain.text[0] not in one_letter.text
    # include_stop_str_in_output: the stop string ends the text instead of being cut off.
    stop = plain.text[3:5]
    cut = await generate(engine, PROMPT, stop=[stop], **letters)
    kept = await generate(engine, PROMPT, stop=[stop], include_stop_str_in_output=True, **letters)
    start = plain.text.index(stop)
    assert (cut.text, kept.text) == (plain.text[:start], plain.text[: start + 2])
    assert cut.stop_reason == kept.stop_reason == stop
    # prompt_logprobs: every prompt token but the first, as a full forward gives them; the same
    # prompt again (its blocks cached by now) still computes them all.
    for _ in range(2):
        out = await generate(engine, PROMPT, max_tokens=2, temperature=0, prompt_logprobs=3)
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(PROMPT) - 1
        for i, lp in enumerate(out.prompt_logprobs, start=1):
            assert lp.logprob == pytest.approx(expected[i - 1, PROMPT[i]].item(), abs=1e-4)
            assert lp.top_token_ids == expected[i - 1].topk(3).indices.tolist()
            assert lp.rank == int((expected[i - 1] > expected[i - 1, PROMPT[i]]).sum()) + 1
    assert (await engine.stats()).prefix_cache_hits > hits  # the cache was there to hit
    await refusals_beside_a_running_request(engine)


async def refusals_beside_a_running_request(engine: trioserve.Engine) -> None:
    """Each bad value is refused naming its field, while a request beside it runs to its end."""
    bad = [
        ({"logit_bias": {VOCAB_SIZE: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [3, VOCAB_SIZE + 7]}, "allowed_token_ids"),
        ({"bad_words_token_ids": [[VOCAB_SIZE]]}, "bad_words_token_ids"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ]
    done = trio.Event()

    async def beside() -> None:
        out = await generate(engine, PROMPT, max_tokens=40, temperature=0, ignore_eos=True)
        assert len(out.token_ids) == 40
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(beside)
        for fields, name in bad:
            with pytest.raises(InvalidRequestError, match=f"^{name}: ") as caught:
                await generate(engine, PROMPT, **fields)
            assert caught.value.field == name
        assert not done.is_set()  # the refusals came while it ran
    stats = await engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


# --- over the OpenAI API -----------------------------------------------------------


def check_openai_api(url: str, prompt_ids: list[int]) -> None:
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)
    model = "tiny-llama"
    # echo: the prompt, then the completion; with logprobs, the prompt's tokens first (the first has none).
    whole = client.completions.create(model=model, prompt="Hello", max_tokens=5, temperature=0, echo=True, logprobs=2)
    choice = whole.choices[0]
    plain = client.completions.create(model=model, prompt="Hello", max_tokens=5, temperature=0)
    assert choice.text == "Hello" + plain.choices[0].text
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None
    num_prompt = whole.usage.prompt_tokens
    assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
    assert len(lp.tokens) >= num_prompt and "".join(lp.tokens[1:num_prompt]) == "Hello"  # after <s>
    assert lp.text_offset is not None and lp.text_offset[:num_prompt] == [0, 0, 1, 2, 3, 4]  # <s> is not in the text
    placed = [(t, o) for t, o in zip(lp.tokens, lp.text_offset, strict=True) if t.isascii()]
    assert all(choice.text[offset:].startswith(t) for t, offset in placed[1:])
    streamed = client.completions.create(
        model=model, prompt="Hello", max_tokens=5, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    # vLLM's fields in extra_body, and logit_bias as OpenAI's.
    forced = client.completions.create(
        model=model, prompt="Hi", max_tokens=4, temperature=0, logit_bias={str(3 + ord("z")): 100},
        extra_body={"min_tokens": 2, "skip_special_tokens": False, "spaces_between_special_tokens": True},
    )  # fmt: skip
    assert forced.choices[0].text == "zzzz"
    stopped = client.completions.create(
        model=model, prompt="Hi", max_tokens=8, temperature=0, logit_bias={str(3 + ord("q")): 100},
        extra_body={"allowed_token_ids": [3 + ord("q"), 3 + ord("r")], "stop_token_ids": [3 + ord("q")],
                    "min_tokens": 2, "include_stop_str_in_output": True},
    )  # fmt: skip
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == ("rrq", "stop")
    banned = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0,
        extra_body={"allowed_token_ids": [3 + ord("a"), 3 + ord("b")], "bad_words": ["a"], "prompt_logprobs": 1},
    )  # fmt: skip
    assert banned.choices[0].message.content == "bbbbbb"
    prompt_logprobs = banned.model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == banned.usage.prompt_tokens
    assert all(len(entry) in (1, 2) for entry in prompt_logprobs[1:])
    with_ids = client.completions.create(
        model=model, prompt=prompt_ids, max_tokens=2, extra_body={"prompt_logprobs": 0}
    )
    assert len(with_ids.choices[0].model_extra["prompt_logprobs"]) == len(prompt_ids)
    # continuous_usage_stats: every chunk says the usage so far.
    chunks = list(
        client.completions.create(
            model=model, prompt="Hi", max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )  # fmt: skip
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks) and counts == sorted(counts) and counts[-1] == 4
    # Bad values: a 400 naming the field.
    for extra, field in (
        ({"logit_bias": {str(VOCAB_SIZE): 1}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(5000)}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"allowed_token_ids": [VOCAB_SIZE]}, "allowed_token_ids"),
        ({"min_tokens": 9}, "min_tokens"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=model, prompt="Hi", max_tokens=4, extra_body=extra)
        assert caught.value.body["param"] == field, (extra, caught.value.body)
        assert caught.value.body["message"].startswith(field)


def test_the_openai_api_takes_vllms_fields(server):
    async def scenario(s: Server) -> None:
        assert s.engine is not None
        await s.engine.reset_prefix_cache()  # as on a fresh engine: nothing cached by the other test
        await in_thread(check_openai_api, s.http_url, PROMPT[:10])

    server.call(scenario, bound_s=150)
