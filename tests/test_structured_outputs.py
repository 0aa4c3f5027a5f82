"""Structured outputs through the whole engine, on a tiny random-weight model:
every output of the schema suite, sampled (temperature 1, several seeds) and
greedy, parses and validates; regexes and choices match; unconstrained
requests beside constrained ones give exactly the tokens they give alone,
through preemptions and prefix-cache hits; a constraint that cannot compile
fails its request only. One engine serves the module."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import trio
from helpers.hosted import HostedEngine, held
from helpers.json_schemas import SCHEMAS

from trioserve import EngineConfig, RequestError, SamplingParams
from trioserve.structured import Choice, Grammar, JsonObject, JsonSchema, Regex

pytestmark = pytest.mark.model

PROMPT = "Reply with JSON only, please: "  # 30 byte tokens: whole blocks of it hit the prefix cache
SEEDS = (1, 2)
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    # 128 blocks of 4 tokens: a batch of the whole suite runs out of blocks and preempts.
    config = EngineConfig(
        model=str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=128, torch_threads=1, shutdown_grace_s=3.0
    )
    yield from held(HostedEngine(config))


def suite_params() -> list[tuple[str, dict, SamplingParams]]:
    """Each schema of the suite, sampled with each seed and greedily."""
    runs = []
    for name, schema, _ in SCHEMAS:
        constraint = JsonSchema(schema=schema)
        for seed in SEEDS:
            runs.append((name, schema, SamplingParams(max_tokens=MAX_TOKENS, seed=seed, structured=constraint)))
        runs.append((name, schema, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured=constraint)))
    return runs


async def generate_all(engine, requests: list[tuple[str, SamplingParams]]) -> list:
    results: list = [None] * len(requests)

    async def one(i: int, prompt: str, params: SamplingParams) -> None:
        results[i] = await engine.generate(prompt, params)

    async with trio.open_nursery() as nursery:
        for i, (prompt, params) in enumerate(requests):
            nursery.start_soon(one, i, prompt, params)
    return results


def check_valid(schema: dict, text: str) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def test_every_output_of_the_schema_suite_validates_sampled_and_greedy(engine):
    runs = suite_params()
    results = engine.call(lambda e: generate_all(e, [(PROMPT, params) for _, _, params in runs]), bound_s=240)
    for (name, schema, params), result in zip(runs, results, strict=True):
        assert result.finish_reason == "stop", (name, params.seed, result.text)
        check_valid(schema, result.text)
    assert len({r.text for r in results}) > len(SCHEMAS)  # seeds do sample different outputs


REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)!?", r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)", r"-?(0|[1-9][0-9]{0,5})"]
CHOICES = ["red", "green", "blue", "a|b", "naïve ✓", "(x)"]


def test_regexes_and_choices_hold_sampled_and_greedy(engine):
    params = []
    for temperature, seed in ((1.0, 3), (1.0, 4), (0.0, None)):
        params += [
            SamplingParams(max_tokens=60, temperature=temperature, seed=seed, structured=Regex(pattern=r))
            for r in REGEXES
        ]
        params.append(
            SamplingParams(max_tokens=60, temperature=temperature, seed=seed, structured=Choice(choices=CHOICES))
        )
    results = engine.call(lambda e: generate_all(e, [("Say something: ", p) for p in params]), bound_s=120)
    for p, result in zip(params, results, strict=True):
        assert result.finish_reason == "stop", (p.structured, result.text)
        if isinstance(p.structured, Regex):
            assert re.fullmatch(p.structured.pattern, result.text), (p.structured.pattern, result.text)
        else:
            assert result.text in CHOICES


def test_a_lark_grammar_and_any_json_object_hold(engine):
    lark = 'start: "(" item ("," item)* ")"\nitem: /[a-z]/ | start'
    params = [
        SamplingParams(max_tokens=200, seed=5, structured=Grammar(grammar=lark)),
        SamplingParams(max_tokens=200, seed=5, structured=Grammar(grammar='root ::= "x" [0-9] [0-9]?')),
        SamplingParams(max_tokens=300, seed=6, structured=JsonObject()),
    ]
    results = engine.call(lambda e: generate_all(e, [("Go: ", p) for p in params]), bound_s=120)
    assert all(r.finish_reason == "stop" for r in results), [r.text for r in results]
    assert re.fullmatch(r"[(),a-z]+", results[0].text) and results[0].text.count("(") == results[0].text.count(")")
    assert re.fullmatch(r"x[0-9][0-9]?", results[1].text)
    assert isinstance(json.loads(results[2].text), dict)


def test_a_constraint_not_finished_within_max_tokens_ends_with_length(engine):
    schema = {"type": "string", "minLength": 40, "maxLength": 50}
    result = engine.call(
        lambda e: e.generate(PROMPT, SamplingParams(max_tokens=5, structured=JsonSchema(schema=schema)))
    )
    assert result.finish_reason == "length" and len(result.token_ids) == 5 and result.text.startswith('"')


def unconstrained_params() -> list[SamplingParams]:
    sampled = [
        SamplingParams(max_tokens=24, seed=s, ignore_eos=True, top_k=50, repetition_penalty=1.2) for s in (7, 8, 9)
    ]
    return [*sampled, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)]


def test_unconstrained_requests_beside_constrained_ones_give_the_tokens_they_give_alone(engine):
    plain = [(PROMPT + f"#{i} ", p) for i, p in enumerate(unconstrained_params())]

    async def scenario(e):
        alone = await generate_all(e, plain)
        before = await e.stats()
        constrained = [(PROMPT, p) for _, _, p in suite_params()]
        mixed = await generate_all(e, plain + constrained)
        return alone, mixed, before, await e.stats()

    alone, mixed, before, after = engine.call(scenario, bound_s=240)
    assert [r.token_ids for r in mixed[: len(plain)]] == [r.token_ids for r in alone]
    for (name, schema, _), result in zip(suite_params(), mixed[len(plain) :], strict=True):
        assert result.finish_reason == "stop", name
        check_valid(schema, result.text)
    assert after.num_preemptions > before.num_preemptions
    assert after.prefix_cache_hits > before.prefix_cache_hits


def test_a_constraint_that_does_not_compile_fails_its_request_and_nothing_else(engine):
    async def scenario(e):
        beside = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        async with trio.open_nursery() as nursery:
            results = {}

            async def run(key, params):
                try:
                    results[key] = await e.generate(PROMPT, params)
                except RequestError as exc:
                    results[key] = exc

            nursery.start_soon(run, "bad", SamplingParams(structured=Regex(pattern="(unclosed")))
            nursery.start_soon(run, "beside", beside)
        return results

    results = engine.call(scenario)
    assert isinstance(results["bad"], RequestError) and "unclosed group" in str(results["bad"])
    assert results["beside"].finish_reason == "length" and len(results["beside"].token_ids) == 8
