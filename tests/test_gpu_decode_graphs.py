"""Decode steps through the CUDA graphs' path (gpu/decode_graphs.py), and the
CUDA KV cache's arithmetic (gpu/cuda_memory.py), checked on the CPU: the
graphs' static buffers, padding to a bucket and scratch block run eagerly
(``TRIOSERVE_DECODE_GRAPHS=eager``), against transformers' greedy generate.
The capture itself needs a CUDA device (tests/test_cuda.py)."""

from __future__ import annotations

import pytest
from helpers.reference import reference_greedy
from hypothesis import given
from hypothesis import strategies as st

from test_gpu_runner import GREEDY, MiniScheduler, make_prompts, make_runner
from trioserve.gpu.cuda_memory import kv_budget_bytes, profile_lengths
from trioserve.gpu.decode_graphs import GRAPHS_ENV, MAX_BUCKET, DecodeGraphs, bucket_for, graph_buckets
from trioserve.messages import NewRequestData

pytestmark = pytest.mark.model


@given(st.integers(1, 2000), st.integers(1, 2000))
def test_a_batch_goes_to_the_smallest_bucket_that_holds_it(max_num_seqs, batch):
    buckets = graph_buckets(max_num_seqs)
    assert buckets == sorted(set(buckets)) and buckets[0] == 1 and buckets[-1] <= MAX_BUCKET
    assert buckets[-1] >= min(max_num_seqs, MAX_BUCKET)  # every batch the scheduler sends, up to the cap
    assert all(b in (1, 2, 4) or b % 8 == 0 for b in buckets)
    assert len(buckets) == 1 or buckets[-2] < min(max_num_seqs, MAX_BUCKET)  # none past the one needed
    bucket = bucket_for(buckets, batch)
    if batch > buckets[-1]:
        assert bucket is None
    else:
        assert bucket is not None and bucket >= batch
        assert not [b for b in buckets if batch <= b < bucket]  # none smaller holds it


def test_buckets_of_small_and_odd_batch_limits():
    assert graph_buckets(1) == [1]
    assert graph_buckets(3) == [1, 2, 4]
    assert graph_buckets(5) == [1, 2, 4, 8]
    assert graph_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_buckets(33) == [1, 2, 4, 8, 16, 24, 32, 40]
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph_buckets(0)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: sliding windows and softcaps
def test_decodes_padded_to_buckets_over_static_buffers_match_generate(tiny_model_dir, arch, monkeypatch):
    monkeypatch.setenv(GRAPHS_ENV, "eager")
    model_dir = tiny_model_dir(arch)
    prompts = make_prompts([5, 23, 41, 2, 14], seed=7)
    expected = reference_greedy(model_dir, prompts, GREEDY.max_tokens)
    runner, _ = make_runner(model_dir, num_blocks=96, max_num_seqs=6)
    graphs = runner._graphs
    assert graphs is not None and graphs.buckets == [1, 2, 4, 8]
    assert runner.num_blocks == 96 and runner.kv_caches[0][0].shape[0] == 97  # the scratch block, past the rest
    assert graphs.scratch_block == 96
    ran: list[tuple[int, int]] = []  # (rows, the bucket's size)
    run = DecodeGraphs.run

    def counting(self, rows):
        logits = run(self, rows)
        ran.append((len(rows.input_ids), bucket_for(self.buckets, len(rows.input_ids))))
        return logits

    monkeypatch.setattr(DecodeGraphs, "run", counting)
    sched = MiniScheduler(runner, num_blocks=96, block_size=4, token_budget=24)
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt)
    outputs = sched.run(preempt_at={4: "r1", 9: "r3"})
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == expected
    assert ran and any(rows < bucket for rows, bucket in ran)  # steps padded, and their tokens still right
    with pytest.raises(ValueError, match="block_ids"):  # no request can name the scratch block
        runner._add_request(NewRequestData("x", [1, 2], GREEDY, [96], 0, 2))


def test_enforce_eager_runs_no_graphs(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(GRAPHS_ENV, "eager")
    runner, _ = make_runner(tiny_model_dir("llama"), num_blocks=32, enforce_eager=True)
    assert runner._graphs is None and runner.kv_caches[0][0].shape[0] == 32
    monkeypatch.delenv(GRAPHS_ENV)
    runner, _ = make_runner(tiny_model_dir("llama"), num_blocks=32)  # the CPU: no CUDA graphs
    assert runner._graphs is None


def test_a_runner_asleep_drops_its_graphs_and_captures_them_again_on_waking(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(GRAPHS_ENV, "eager")
    model_dir = tiny_model_dir("llama")
    prompts = make_prompts([9, 4])
    expected = reference_greedy(model_dir, prompts, GREEDY.max_tokens)
    runner, _ = make_runner(model_dir, num_blocks=32, max_num_seqs=4)
    runner.sleep(2)
    assert runner._graphs is None
    runner.wake_up()
    assert runner._graphs is not None and runner._graphs.kv_caches is runner.kv_caches
    sched = MiniScheduler(runner, num_blocks=32, block_size=4, token_budget=32)
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt)
    assert [sched.run()[f"r{i}"] for i in range(2)] == expected


def test_the_kv_budget_is_the_share_less_what_is_held_and_a_full_steps_activations():
    gib = 2**30
    # 80 GiB device, 0.9 of it: 72 GiB; 3 GiB held (weights, context); a full step's activations 1 GiB.
    assert kv_budget_bytes(0.9, 80 * gib, 77 * gib, 1 * gib) == int(0.9 * 80 * gib) - 3 * gib - gib
    # Another process holding most of the device leaves nothing (negative: the runner refuses to start).
    assert kv_budget_bytes(0.5, 80 * gib, 30 * gib, 0) < 0
    for bad in ((0.0, 1, 1, 0), (1.5, 1, 1, 0), (0.5, 10, 11, 0), (0.5, 10, 5, -1)):
        with pytest.raises(ValueError):
            kv_budget_bytes(*bad)


@given(st.integers(1, 20000), st.integers(1, 512), st.integers(1, 8192))
def test_the_profiling_step_is_the_largest_the_scheduler_can_send(tokens, seqs, model_len):
    lengths = profile_lengths(tokens, seqs, model_len)
    assert sum(lengths) == min(tokens, seqs * model_len)
    assert 1 <= len(lengths) <= seqs and max(lengths) <= model_len and max(lengths) - min(lengths) <= 1
