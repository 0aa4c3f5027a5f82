"""Structured outputs inside the engine core, without processes: the
scheduler's requests that wait for their grammar, the constraint held to
every token, and the compiles (cache, errors, time bound) of
``nurseries/engine_core/structured_outputs.py`` on the tiny tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import trio
from helpers.fakes import Script
from helpers.scheduling import make_request, make_scheduler

from trioserve.core.request import RequestStatus
from trioserve.messages import RunnerOutput
from trioserve.nurseries.engine_core.grammar import ConstraintError, GrammarMatcher, Tokenizer, check, compile_matcher
from trioserve.nurseries.engine_core.structured_outputs import StructuredOutputs
from trioserve.sampling_params import SamplingParams
from trioserve.structured import (
    MAX_CHOICES,
    MAX_CONSTRAINT_BYTES,
    MAX_SCHEMA_DEPTH,
    Choice,
    Grammar,
    JsonObject,
    JsonSchema,
    Regex,
    check_constraint,
    constraint_key,
)

DIGITS = Regex(pattern="[0-9]{2}")


def run(sched, step, tokens: dict[str, int]):
    req_ids = [r.request_id for r in step.samplers]
    return sched.postprocess(step, RunnerOutput(req_ids=req_ids, sampled_token_ids=[tokens[r] for r in req_ids]))


# --- the scheduler -----------------------------------------------------------


def test_a_constrained_request_waits_for_its_grammar_while_others_step():
    sched = make_scheduler()
    waiting = make_request("c", structured=DIGITS)
    sched.add(waiting)
    sched.add(make_request("u"))
    assert waiting.status is RequestStatus.WAITING_FOR_GRAMMAR
    assert sched.has_schedulable() and sched.num_waiting == 2
    step = sched.schedule()
    assert step is not None and list(step.scheduled.num_scheduled_tokens) == ["u"]
    assert not step.scheduled.awaits_bitmask
    sched.check_invariants([step])
    run(sched, step, {"u": 7})
    assert sched.grammar_ready(waiting, Script([30, 31]))
    step = sched.schedule()
    assert step is not None and set(step.scheduled.num_scheduled_tokens) == {"u", "c"}
    assert step.scheduled.awaits_bitmask
    sched.check_invariants([step])


def test_only_constrained_requests_waiting_for_grammars_leave_nothing_to_schedule():
    sched = make_scheduler()
    sched.add(make_request("c", structured=DIGITS))
    assert sched.has_unfinished() and not sched.has_schedulable()
    assert sched.schedule() is None
    sched.check_invariants()


def test_the_constraint_sees_every_token_and_its_end_stops_the_request():
    sched = make_scheduler()
    req = make_request("c", structured=DIGITS, max_tokens=10)
    sched.add(req)
    script = Script([40, 41])
    sched.grammar_ready(req, script)
    (out,) = run(sched, sched.schedule(), {"c": 40})
    assert out.finish_reason is None
    (out,) = run(sched, sched.schedule(), {"c": 41})
    assert (out.new_token_ids, out.finish_reason) == ([41], "stop")
    assert script.accepted == [40, 41] and not sched.has_unfinished()


def test_max_tokens_before_the_constraint_ends_gives_length():
    sched = make_scheduler()
    req = make_request("c", structured=DIGITS, max_tokens=1)
    sched.add(req)
    sched.grammar_ready(req, Script([40, 41]))
    (out,) = run(sched, sched.schedule(), {"c": 40})
    assert out.finish_reason == "length"


def test_a_token_the_constraint_refuses_ends_the_request_with_an_error():
    sched = make_scheduler()
    req = make_request("c", structured=DIGITS)
    sched.add(req)
    sched.grammar_ready(req, Script([40]))
    (out,) = run(sched, sched.schedule(), {"c": 99})
    assert out.finish_reason == "error" and "refuses" in (out.error or "")
    assert not sched.has_unfinished()
    sched.check_invariants()


def test_a_preempted_constrained_request_keeps_its_constraint_state():
    sched = make_scheduler(num_blocks=4, max_num_seqs=2)  # 16 tokens of cache in all
    first, second = make_request("a", prompt_len=8, max_tokens=3), make_request("b", prompt_len=8, structured=DIGITS)
    sched.add(first)
    sched.add(second)
    script = Script([50, 51, 52, 53])
    sched.grammar_ready(second, script)
    # Both prefill 2 full blocks; then each needs a third, and b is preempted until a ends.
    while sched.has_unfinished():
        step = sched.schedule()
        assert step is not None
        sched.check_invariants([step])
        want = {"a": 7}
        if second in step.samplers:
            want["b"] = script.allowed[len(script.accepted)]
        run(sched, step, want)
    assert sched.num_preemptions >= 1
    assert second.finish_reason == "stop" and script.accepted == [50, 51, 52, 53]
    assert second.output_token_ids == [50, 51, 52, 53]


def test_abort_of_a_request_waiting_for_its_grammar_forgets_it():
    sched = make_scheduler()
    req = make_request("c", structured=DIGITS)
    sched.add(req)
    assert sched.abort(["c"]) == ["c"]
    assert not sched.has_unfinished() and req.finish_reason == "abort"
    assert not sched.grammar_ready(req, Script([1]))
    assert sched.grammar_failed(req, "late") is None
    sched.check_invariants()


def test_a_grammar_that_fails_ends_only_its_request():
    sched = make_scheduler()
    req = make_request("c", structured=DIGITS)
    sched.add(req)
    sched.add(make_request("u"))
    out = sched.grammar_failed(req, "regex parse error")
    assert out is not None and (out.finish_reason, out.error) == ("error", "regex parse error")
    assert sched.request_ids() == ["u"]
    sched.check_invariants()


def test_a_result_for_an_aborted_request_never_reaches_a_new_one_with_its_id():
    sched = make_scheduler()
    old = make_request("c", structured=DIGITS)
    sched.add(old)
    sched.abort(["c"])
    new = make_request("c", structured=DIGITS)
    sched.add(new)
    assert not sched.grammar_ready(old, Script([1]))
    assert new.status is RequestStatus.WAITING_FOR_GRAMMAR


# --- the constraint types and their bounds ---------------------------------------


@pytest.mark.parametrize(
    ("constraint", "expected"),
    [
        (JsonSchema(schema={"type": "object"}), None),
        (JsonSchema(schema=True), None),
        (Regex(pattern=""), "non-empty"),
        (Choice(choices=[]), "non-empty list"),
        (Choice(choices=["a", ""]), "non-empty strings"),
        (Choice(choices=[str(i) for i in range(MAX_CHOICES + 1)]), f"at most {MAX_CHOICES}"),
        (Grammar(grammar="  "), "non-empty"),
        (Regex(pattern="a" * (MAX_CONSTRAINT_BYTES + 1)), f"at most {MAX_CONSTRAINT_BYTES}"),
        ("not a constraint", "must be one of"),
    ],
)
def test_constraints_are_bounded_in_shape_and_size(constraint, expected):
    problem = check_constraint(constraint)
    assert problem is None if expected is None else expected in (problem or "")


def test_a_schema_nested_past_the_bound_is_refused_without_recursion():
    schema: dict = {"type": "object"}
    for _ in range(100_000):  # deeper than any recursive walk could go
        schema = {"type": "array", "items": schema}
    problem = check_constraint(JsonSchema(schema=schema))
    assert problem == f"schema nests more than {MAX_SCHEMA_DEPTH} levels deep"
    with pytest.raises(ValueError, match="structured: schema nests"):
        SamplingParams(structured=JsonSchema(schema=schema))


def test_equal_constraints_have_one_key_whatever_the_order_of_their_keys():
    a = JsonSchema(schema={"type": "object", "properties": {"x": {"type": "integer"}}})
    b = JsonSchema(schema={"properties": {"x": {"type": "integer"}}, "type": "object"})
    assert constraint_key(a) == constraint_key(b) != constraint_key(JsonObject())


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (JsonSchema(schema={"type": "string", "pattern": "(unclosed"}), "unclosed group"),
        (JsonSchema(schema={"type": "array", "uniqueItems": True}), "uniqueItems"),
        (JsonSchema(schema={"$ref": "#/$defs/missing"}), "does not exist"),
        (JsonSchema(schema=False), "accepts nothing"),
        (Regex(pattern="(abc"), "unclosed group"),
        (Grammar(grammar="start: missing_rule"), "unknown name"),
        (Grammar(grammar='root ::= "a" ('), "root"),
    ],
)
def test_a_constraint_that_cannot_compile_is_refused_with_the_reason(constraint, message):
    with pytest.raises(ConstraintError, match=message):
        check(constraint)


# --- compiling, caching and masks, on the tiny tokenizer ---------------------------


@pytest.fixture
def tokenizer(tiny_model_dir):
    from trioserve.gpu.tiny_models import EOS_ID, VOCAB_SIZE

    return Tokenizer(str(tiny_model_dir("llama") / "tokenizer.json"), VOCAB_SIZE, [EOS_ID])


def allowed_tokens(outputs: StructuredOutputs, req) -> list[int]:
    mask = outputs.bitmask([req], lambda r: True)
    row = np.frombuffer(mask.bitmask, dtype="<i4").view(np.uint32)
    return [t for t in range(mask.words * 32) if row[t // 32] >> (t % 32) & 1]


def test_choice_literals_match_only_themselves(tokenizer):
    choices = ["a.b", "x|y", "(1)", "naïve ✓"]
    matcher = GrammarMatcher(compile_matcher(tokenizer, Choice(choices=choices)))
    text = b"x|y"
    assert all(matcher.accept(b + 3) for b in text)  # the tiny vocabulary: byte b is token b + 3
    assert matcher.is_complete()
    other = GrammarMatcher(compile_matcher(tokenizer, Choice(choices=choices)))
    assert not other.accept(ord("x") + 3 + 1)


async def test_compiles_once_per_constraint_and_hits_the_cache_after(tokenizer):
    outputs = StructuredOutputs(tokenizer, 259)
    schema = JsonSchema(schema=json.loads('{"type": "integer", "minimum": 1, "maximum": 3}'))
    reqs = [make_request(f"r{i}", structured=schema) for i in range(3)]
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            assert [outputs.prepare(r, nursery) for r in reqs[:2]] == [None, None]
            await outputs.wait_results()
        results = outputs.take_results()
    assert [r for r, _ in results] == reqs[:2] and all(isinstance(m, GrammarMatcher) for _, m in results)
    assert results[0][1].matcher is not results[1][1].matcher  # each request its own copy
    assert outputs.num_compiles == 1
    async with trio.open_nursery() as nursery:
        matcher = outputs.prepare(reqs[2], nursery)
    assert isinstance(matcher, GrammarMatcher) and outputs.num_cache_hits == 1
    reqs[2].constraint = matcher
    assert allowed_tokens(outputs, reqs[2]) == [ord(c) + 3 for c in "123"]


async def test_the_cache_keeps_the_most_recently_used_constraints(tokenizer):
    outputs = StructuredOutputs(tokenizer, 259, cache_size=2)
    with trio.fail_after(30):
        for pattern in ("a+", "b+", "a+", "c+", "a+", "b+"):
            async with trio.open_nursery() as nursery:
                if outputs.prepare(make_request(pattern, structured=Regex(pattern=pattern)), nursery) is None:
                    await outputs.wait_results()
            outputs.take_results()
    # a+ b+ (2 compiles), a+ (hit), c+ evicts b+, a+ (hit), b+ again (compiled)
    assert (outputs.num_compiles, outputs.num_cache_hits) == (4, 2)


async def test_a_compile_that_fails_or_takes_too_long_gives_its_requests_the_reason(tokenizer):
    slow = StructuredOutputs(tokenizer, 259, compile_timeout_s=0.0)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            slow.prepare(make_request("t", structured=Regex(pattern="[0-9]+")), nursery)
        ((_, timed_out),) = slow.take_results()
        outputs = StructuredOutputs(tokenizer, 259)
        async with trio.open_nursery() as nursery:
            outputs.prepare(make_request("bad", structured=Regex(pattern="(x")), nursery)
        ((_, failed),) = outputs.take_results()
    assert timed_out == "compiling the constraint took longer than 0s"
    assert isinstance(failed, str) and "unclosed group" in failed


async def test_a_model_without_a_tokenizer_fails_constrained_requests_only(tmp_path):
    outputs = StructuredOutputs(Tokenizer(str(tmp_path / "tokenizer.json"), 259, [2]), 259)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            outputs.prepare(make_request("c", structured=JsonObject()), nursery)
    ((_, error),) = outputs.take_results()
    assert isinstance(error, str) and error.startswith("structured outputs need the model's tokenizer")
