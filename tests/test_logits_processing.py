"""Per-row logits processing (``gpu/logits_processing.py``) against a plain
loop over each row and token, the sampler around it, prompt logprobs
(``gpu/prompt_logprobs.py``) against a full ``log_softmax``, and the engine
core's part (min_tokens and prompt logprobs in ``core/request.py``)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve.core.request import Request
from trioserve.errors import InvalidRequestError
from trioserve.messages import SampleLogprobs
from trioserve.sampling_params import MAX_LOGIT_BIAS, SamplingParams

torch = pytest.importorskip("torch")

from trioserve.gpu.logits_processing import RowProcessors, apply_logits_processors  # noqa: E402
from trioserve.gpu.prompt_logprobs import PromptLogprobsPlan  # noqa: E402
from trioserve.gpu.sampler import SamplingBatch, sample  # noqa: E402

V = 40
EOS = 2
CPU = torch.device("cpu")
NEG = float("-inf")


def reference(logits: torch.Tensor, params: list[SamplingParams], token_ids, num_prompt) -> torch.Tensor:
    """The processing, one row and one token at a time."""
    out = logits.clone()
    for i, p in enumerate(params):
        outputs = list(token_ids[i][num_prompt[i] :])
        for token, bias in p.logit_bias.items():
            out[i, token] += bias
        for token in range(V):
            banned = p.allowed_token_ids is not None and token not in p.allowed_token_ids
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS})
            banned |= len(outputs) < p.min_tokens and token in stops
            for word in p.bad_words_token_ids:
                prefix = list(word[:-1])
                completes = len(outputs) >= len(prefix) and outputs[len(outputs) - len(prefix) :] == prefix
                banned |= token == word[-1] and completes
            if banned:
                out[i, token] = NEG
    return out


token = st.integers(0, V - 1)
row_params = st.fixed_dictionaries(
    {},
    optional={
        "logit_bias": st.dictionaries(token, st.floats(-100, 100), max_size=5),
        "allowed_token_ids": st.lists(token, min_size=1, max_size=8),
        "bad_words_token_ids": st.lists(st.lists(token, min_size=1, max_size=3), max_size=4),
        "min_tokens": st.integers(0, 4),
        "stop_token_ids": st.lists(token, max_size=3),
        "ignore_eos": st.booleans(),
    },
)


@settings(max_examples=150, deadline=None)
@given(
    rows=st.lists(st.tuples(row_params, st.lists(token, max_size=6), st.integers(1, 4)), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_processing_matches_a_loop_over_every_row_and_token(rows, seed):
    params = [SamplingParams(max_tokens=8, **fields) for fields, _, _ in rows]
    num_prompt = [n for _, _, n in rows]
    token_ids = [[5] * n + outputs for (_, outputs, n) in rows]
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(seed))
    processors = [RowProcessors.build(p, [EOS], V, CPU) for p in params]
    got = apply_logits_processors(logits, processors, token_ids, num_prompt)
    torch.testing.assert_close(got, reference(logits, params, token_ids, num_prompt))


def test_rows_asking_nothing_are_untouched_and_a_step_of_them_returns_the_logits_themselves():
    logits = torch.randn(3, V)
    plain = SamplingParams()
    assert RowProcessors.build(plain, [EOS], V, CPU) is None
    assert apply_logits_processors(logits, [None, None, None], [[1], [1], [1]], [1, 1, 1]) is logits
    biased = RowProcessors.build(SamplingParams(logit_bias={3: 5.0}, allowed_token_ids=[3, 4]), [EOS], V, CPU)
    got = apply_logits_processors(logits, [None, biased, None], [[1], [1], [1]], [1, 1, 1])
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    assert got[1, 3] == logits[1, 3] + 5 and torch.isinf(got[1, 5])


def test_a_token_id_outside_the_vocabulary_is_refused_naming_the_field():
    for fields, name in (
        ({"logit_bias": {V: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [0, V]}, "allowed_token_ids"),
        ({"bad_words_token_ids": [[1, V]]}, "bad_words_token_ids"),
    ):
        with pytest.raises(ValueError, match=f"^{name}: "):
            RowProcessors.build(SamplingParams(**fields), [EOS], V, CPU)


def test_greedy_and_sampled_rows_alike_take_a_hugely_biased_token_and_keep_to_allowed_tokens():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    params = [
        SamplingParams(temperature=0, logit_bias={17: 100.0}),
        SamplingParams(temperature=1.0, logit_bias={17: 100.0}),
        SamplingParams(temperature=0, allowed_token_ids=[30, 31]),
        SamplingParams(temperature=1.5, allowed_token_ids=[30, 31]),
    ]
    processors = [RowProcessors.build(p, [EOS], V, CPU) for p in params]
    batch = SamplingBatch(params, [[1, 2]] * 4, [2] * 4, processors)
    drawn = [sample(logits, batch, torch.Generator().manual_seed(s)).token_ids for s in range(30)]
    assert all(t[0] == 17 and t[1] == 17 for t in drawn)
    assert {t[2] for t in drawn} == {int(logits[2, 30:32].argmax()) + 30}
    assert {t[3] for t in drawn} == {30, 31}  # 30 draws among two allowed tokens: both come


def test_min_tokens_bans_eos_and_stop_ids_until_enough_output_then_lets_them_win():
    logits = torch.zeros(1, V)
    logits[0, EOS], logits[0, 9] = 50.0, 40.0  # EOS first, then stop token 9
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[9])
    processors = [RowProcessors.build(params, [EOS], V, CPU)]
    picks = []
    for outputs in ([], [7], [7, 7]):
        batch = SamplingBatch([params], [[1, *outputs]], [1], processors)
        picks.append(sample(logits, batch, torch.Generator()).token_ids[0])
    assert picks[0] not in (EOS, 9) and picks[1] not in (EOS, 9) and picks[2] == EOS


def test_logprobs_stay_those_of_the_raw_logits_with_their_rank():
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=0, logprobs=2, allowed_token_ids=[11])
    out = sample(logits, SamplingBatch([params], [[1]], [1], [RowProcessors.build(params, [EOS], V, CPU)]), None)
    raw = logits.log_softmax(dim=1)[0]
    lp = out.logprobs[0]
    assert out.token_ids == [11] and lp.logprob == pytest.approx(raw[11].item())
    assert lp.rank == int((raw > raw[11]).sum()) + 1
    assert lp.top_token_ids == raw.topk(2).indices.tolist()


def test_prompt_logprobs_of_chunks_are_those_of_a_full_log_softmax():
    rng = random.Random(0)
    prompt = [rng.randrange(V) for _ in range(11)]
    logits = torch.randn(len(prompt), V, generator=torch.Generator().manual_seed(1))  # position p's logits
    full = logits.log_softmax(dim=1)
    got: list[SampleLogprobs] = []
    for start, end in ((0, 4), (4, 9), (9, 11)):  # a prompt in three chunks; the last reaches its end
        plan = PromptLogprobsPlan()
        plan.add("r", prompt, len(prompt), 3, start, end, packed_at=0)
        out = plan.compute(logits[start:end][: len(plan.rows)])
        assert out is not None and out[0].start == len(got) + 1
        got += out[0].logprobs
    assert len(got) == len(prompt) - 1  # every token but the first
    for i, lp in enumerate(got, start=1):
        assert lp.logprob == pytest.approx(full[i - 1, prompt[i]].item(), abs=1e-5)
        assert lp.top_token_ids == full[i - 1].topk(3).indices.tolist()
        assert lp.rank == int((full[i - 1] > full[i - 1, prompt[i]]).sum()) + 1


def test_min_tokens_holds_back_eos_and_stop_ids_in_the_engine_core():
    req = Request("r", [1, 2], SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=[9]), [EOS])
    req.append_output_token(EOS)
    assert req.stop_reason(100) is None
    req.append_output_token(9)
    assert req.stop_reason(100) is None
    req.append_output_token(9)
    assert req.stop_reason(100) == "stop"


def test_prompt_logprobs_given_again_after_a_preemption_are_kept_once_and_in_order():
    req = Request("r", list(range(8)), SamplingParams(prompt_logprobs=0), [EOS])
    entries = [SampleLogprobs(-float(i), [], [], 1) for i in range(1, 8)]  # tokens 1..7
    req.add_prompt_logprobs(1, entries[:3])
    req.add_prompt_logprobs(1, entries[:5])  # computed again from the start: only the new ones are taken
    req.add_prompt_logprobs(7, entries[6:])  # a gap: not taken
    req.add_prompt_logprobs(6, entries[5:])
    assert req.prompt_logprobs == entries


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"min_tokens": 17}, "min_tokens"),
        ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
        ({"logit_bias": {3: math.nan}}, "logit_bias"),
        ({"logit_bias": {3: 101}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": ["x"] * 65}, "bad_words"),
        ({"bad_words_token_ids": [[]]}, "bad_words_token_ids"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ],
)
def test_bad_values_are_refused_naming_the_field(fields, name):
    with pytest.raises(InvalidRequestError, match=f"^{name}: ") as caught:
        SamplingParams(max_tokens=16, **fields)
    assert caught.value.field == name
