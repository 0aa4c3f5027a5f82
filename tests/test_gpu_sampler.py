"""The batched sampler on hand-made logits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve.sampling_params import SamplingParams

torch = pytest.importorskip("torch")

from trioserve.gpu.sampler import SamplingBatch, apply_filters, apply_penalties, sample  # noqa: E402

V = 50


def batch_of(params: list[SamplingParams], token_ids=None, num_prompt=None) -> SamplingBatch:
    token_ids = token_ids or [[1, 2, 3]] * len(params)
    return SamplingBatch(params, token_ids, num_prompt or [len(t) for t in token_ids])


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def fresh_generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_seeded_tokens_do_not_depend_on_batch_composition():
    logits = random_logits(1)[0]
    seeded = SamplingParams(temperature=1.0, seed=77)
    others = [SamplingParams(temperature=0.8), SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=5)]
    for prompt_len in range(3, 9):  # successive tokens of one request
        history = list(range(prompt_len))
        alone = sample(logits[None], batch_of([seeded], [history]), fresh_generator(1)).token_ids[0]
        mixed_logits = torch.stack([random_logits(1, seed=9)[0], logits, logits, logits])
        mixed = batch_of([others[0], seeded, others[1], others[2]], [[5, 6], history, [7], [8, 9, 10, 11]])
        assert sample(mixed_logits, mixed, fresh_generator(2)).token_ids[1] == alone


def test_seeded_draws_change_with_position_and_seed():
    logits = torch.zeros(1, V)  # uniform: the noise alone decides

    def draw(seed: int, position: int) -> int:
        batch = batch_of([SamplingParams(seed=seed)], [[0] * position])
        return sample(logits, batch, fresh_generator()).token_ids[0]

    assert len({draw(3, pos) for pos in range(1, 30)}) > 10
    assert len({draw(seed, 10) for seed in range(30)}) > 10
    assert draw(3, 10) == draw(3, 10)


def test_unseeded_rows_use_the_worker_generator():
    logits = torch.zeros(4, V)
    params = [SamplingParams()] * 4
    a = sample(logits, batch_of(params), fresh_generator(5)).token_ids
    assert sample(logits, batch_of(params), fresh_generator(5)).token_ids == a
    assert sample(logits, batch_of(params), fresh_generator(6)).token_ids != a


def test_top_k_1_equals_greedy():
    logits = random_logits(16)
    greedy = sample(logits, batch_of([SamplingParams(temperature=0)] * 16), fresh_generator()).token_ids
    top1 = sample(logits, batch_of([SamplingParams(temperature=1.5, top_k=1)] * 16), fresh_generator()).token_ids
    assert top1 == greedy == logits.argmax(dim=1).tolist()


def test_greedy_and_random_rows_mix_in_one_batch():
    logits = random_logits(6)
    params = [SamplingParams(temperature=0 if i % 2 else 1.0, seed=i) for i in range(6)]
    tokens = sample(logits, batch_of(params), fresh_generator()).token_ids
    assert tokens[1::2] == logits.argmax(dim=1)[1::2].tolist()


def probs_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()  # [1, len(probs)]


def kept(logits: torch.Tensor, **params) -> list[int]:
    out = apply_filters(logits, [SamplingParams(**params)])
    return torch.nonzero(out[0] > float("-inf"))[:, 0].tolist()


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = probs_logits([0.15, 0.5, 0.05, 0.3])
    assert kept(logits, top_p=0.5) == [1]
    assert kept(logits, top_p=0.7) == [1, 3]
    assert kept(logits, top_p=0.81) == [0, 1, 3]
    assert kept(logits, top_p=1.0) == [0, 1, 2, 3]


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    logits = probs_logits([0.15, 0.5, 0.05, 0.3])
    assert kept(logits, min_p=0.5) == [1, 3]
    assert kept(logits, min_p=0.2) == [0, 1, 3]


def test_top_k_and_temperature():
    logits = probs_logits([0.15, 0.5, 0.05, 0.3])
    assert kept(logits, top_k=2) == [1, 3]
    scaled = apply_filters(logits, [SamplingParams(temperature=2.0)])
    torch.testing.assert_close(scaled.softmax(dim=1), (logits / 2).softmax(dim=1))  # (shifted: same distribution)


def test_sampling_follows_the_filtered_distribution():
    rows = 4000
    logits = probs_logits([0.5, 0.3, 0.15, 0.05]).expand(rows, 4)
    tokens = sample(logits, batch_of([SamplingParams(top_p=0.9)] * rows), fresh_generator()).token_ids
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / rows
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95, atol=0.03, rtol=0)


def test_repetition_penalty_covers_prompt_and_output_like_hf():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    batch = batch_of([SamplingParams(repetition_penalty=2.0)], [[0, 1, 4]], [2])  # prompt 0 1, output 4
    out = apply_penalties(logits, batch)
    torch.testing.assert_close(out, torch.tensor([[1.0, -4.0, 2.0, -2.0, 0.5]]))


def test_frequency_and_presence_penalties_cover_output_tokens_only():
    logits = torch.zeros(1, 5)
    tokens = [[3, 3, 0, 1, 1, 1, 2]]  # prompt 3 3; output 0, 1 1 1, 2
    out = apply_penalties(logits, batch_of([SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)], tokens, [2]))
    torch.testing.assert_close(out, -torch.tensor([[0.75, 1.75, 0.75, 0.0, 0.0]]))


def test_penalties_steer_greedy_away_from_repeats():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    history = [[0, 0]]  # prompt 0, output 0
    plain = sample(logits, batch_of([SamplingParams(temperature=0)], history, [1]), fresh_generator())
    penalty = SamplingParams(temperature=0, frequency_penalty=0.5)
    penalized = sample(logits, batch_of([penalty], history, [1]), fresh_generator())
    assert (plain.token_ids, penalized.token_ids) == ([0], [1])


def test_logprobs_of_sampled_token_and_top_alternatives():
    logits = random_logits(3)
    params = [
        SamplingParams(temperature=1.0, seed=1, logprobs=5),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logprobs=0),
    ]
    out = sample(logits, batch_of(params), fresh_generator())
    expected = logits.log_softmax(dim=1)
    first, second, third = out.logprobs
    assert second is None
    assert first.logprob == pytest.approx(expected[0, out.token_ids[0]].item(), abs=1e-5)
    assert first.top_token_ids == expected[0].topk(5).indices.tolist()
    assert first.top_logprobs == pytest.approx(expected[0].topk(5).values.tolist(), abs=1e-5)
    assert (third.top_token_ids, third.top_logprobs) == ([], [])
    assert third.logprob == pytest.approx(expected[2].max().item(), abs=1e-5)
    assert sample(logits, batch_of([SamplingParams()] * 3), fresh_generator()).logprobs is None


TINY_FLOATS = [5e-324, 1e-320, 1e-45, 1e-39, 1e-38, 1e-30, 1e-7]


@settings(max_examples=150, deadline=None)
@given(
    temperature=st.sampled_from([*TINY_FLOATS, 1e-5, 0.5, 1.0, 100.0]),
    top_p=st.sampled_from([*TINY_FLOATS, 0.5, 1.0]),
    top_k=st.sampled_from([0, 1, 2, 2**31 - 1]),
    min_p=st.sampled_from([0.0, *TINY_FLOATS, 1.0]),
    repetition_penalty=st.sampled_from([*TINY_FLOATS, 1.0, 10.0]),
    frequency_penalty=st.sampled_from([-2.0, 0.0, 2.0]),
    presence_penalty=st.sampled_from([-2.0, 0.0, 2.0]),
    seed=st.integers(0, 2**63 - 1),
)
def test_every_accepted_extreme_samples_a_real_token_and_greedy_equivalents_give_the_greedy_one(
    temperature, top_p, top_k, min_p, repetition_penalty, frequency_penalty, presence_penalty, seed
):
    """Found: a temperature of 1e-38 made logits / temperature infinite and
    the softmax NaN, so every token came out as id 0; a top_p that rounds to
    0 in float32 dropped even the top token."""
    params = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        seed=seed,
    )
    logits = random_logits(1, seed=seed % 1000) * 8  # a spread like a model's
    batch = batch_of([params], token_ids=[[3, 5, 3, 9]], num_prompt=[2])
    penalized = apply_penalties(logits.float(), batch)
    assert not penalized.isnan().any()
    filtered = apply_filters(penalized, [params])
    assert not filtered.isnan().any() and filtered.isfinite().any()
    (token,) = sample(logits, batch, fresh_generator()).token_ids
    if not params.greedy:  # (greedy rows take the argmax, unfiltered)
        assert filtered[0, token].isfinite()  # a token the filters kept, never a NaN's argmax
    if temperature < 1e-5 or top_k == 1 or top_p < 1e-7 or min_p == 1.0:
        assert penalized[0, token] == penalized.max()  # the greedy token (or one tied with it)
