"""Tensor parallelism with the transformers runner on tiny models, 2 ranks on
the CPU (gloo), and the control calls (pause, sleep, collective_rpc) that
reach every rank.

The tests of control calls share one engine (``HostedEngine``): llama over 2
ranks, with a KV cache of 64 MiB per rank, so that freeing it shows in the
workers' resident memory.
"""

from __future__ import annotations

import glob
import math
import os
import signal
import time

import psutil
import pytest
import trio
from helpers.concurrent import run_concurrently, run_in_one_batch
from helpers.fakes import wait_no_children
from helpers.hosted import HostedEngine, held
from helpers.reference import before_a_near_tie, greedy_tokens_and_margins, make_prompts, reference_greedy
from helpers.serving import running

import trioserve
from trioserve import ControlCallError, DescribeShard, Echo, EchoReply, EngineConfig, SamplingParams, ShardInfo

pytestmark = pytest.mark.model

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


# --- the same tokens as one rank ------------------------------------------------


def two_ranks_config(model_dir, tmp_path, **options) -> tuple[EngineConfig, dict]:
    """Two ranks, with two LoRA adapters (on attention; on attention and MLP),
    and a cache of 80 blocks of 4 tokens: it holds the 8 prompts (3-47
    tokens) with 12 output tokens each, not with 48."""
    from helpers.lora import ATTENTION, ATTENTION_AND_MLP, write_adapter

    adapters = {
        "attn": write_adapter(model_dir, tmp_path / "attn", r=8, targets=ATTENTION, seed=3),
        "all": write_adapter(model_dir, tmp_path / "all", r=16, targets=ATTENTION_AND_MLP, seed=4),
    }
    config = EngineConfig(
        model=str(model_dir), tensor_parallel_size=2, block_size=4, num_kv_blocks=80, torch_threads=1,
        shutdown_grace_s=3.0, enable_lora=True, max_loras=2,
        lora_modules=tuple(f"{name}={path}" for name, path in adapters.items()), **options,
    )  # fmt: skip
    return config, adapters


async def check_the_greedy_tokens_of_one_also_with_preemption(engine, model_dir, adapters, tmp_path) -> None:
    """The tokens of one rank, also under preemption; with the base and both
    adapters in one batch, each request's tokens those of its adapter merged
    into the model."""
    from helpers.lora import merged_model

    prompts = make_prompts(engine.info.vocab_size)
    expected = await trio.to_thread.run_sync(reference_greedy, model_dir, prompts, 48)
    short = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert await run_concurrently(engine, prompts, short) == [e[:12] for e in expected]
    assert (await engine.stats()).num_preemptions == 0
    long = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    assert await run_in_one_batch(engine, prompts, long) == expected
    assert (await engine.stats()).num_preemptions > 0
    # The base and both adapters in one batch.
    jobs = [(prompt, lora) for prompt in prompts[:4] for lora in (None, *adapters)]
    want = {None: [e[:12] for e in expected[:4]]}
    for name, path in adapters.items():
        merged = await trio.to_thread.run_sync(merged_model, model_dir, path, tmp_path / f"{name}-merged")
        want[name] = await trio.to_thread.run_sync(reference_greedy, merged, prompts[:4], 12)

    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, lora=lora) for _, lora in jobs]
    got = await run_concurrently(engine, [prompt for prompt, _ in jobs], params)
    for i, (prompt, lora) in enumerate(jobs):
        assert got[i] == want[lora][prompts.index(prompt)], (lora, i)


async def test_two_ranks_give_the_greedy_tokens_of_one_also_with_preemption(tiny_model_dir, tmp_path):
    """The tokens of one rank are transformers' own greedy generate() of the
    whole model, one prompt at a time: what the engine gives with one rank
    (test_engine_models checks that, on these prompts). Qwen3 here, for its
    per-head q/k norms; Llama in the kill -9 test below, whose engine checks
    this first (one start of two ranks less); Qwen2 (Llama's layout with q, k,
    v biases, which split as the weights' rows do) is left to the one-rank
    tests. With LoRA adapters (on attention; on attention and MLP), each
    request's tokens are those of its adapter merged into the model, as with
    one rank (test_lora_models)."""
    model_dir = tiny_model_dir("qwen3")
    config, adapters = two_ranks_config(model_dir, tmp_path)
    with trio.fail_after(150):
        async with trioserve.open_engine(config=config) as engine:
            await check_the_greedy_tokens_of_one_also_with_preemption(engine, model_dir, adapters, tmp_path)


NEAR_TIE = 3e-3  # logits: a lead below this may go either way between sums in another order (int8 over ranks)


@pytest.mark.parametrize("source", ["--quantization int8", "a W8A8 checkpoint"])
async def test_int8_over_two_ranks_gives_the_unsharded_int8_models_greedy_tokens(tiny_model_dir, tmp_path, source):
    """int8 with two ranks, quantized at load from a float checkpoint or read from a compressed-tensors W8A8 one
    (``trioserve quantize``'s): column-parallel layers (Qwen2's q, k, v with their biases; gate, up) hold their
    rank's output channels, row-parallel ones (o, down) their share of the inputs, with the whole layer's scales
    (and smoothing): the greedy tokens of the unsharded model with the same int8 layers in plain torch
    (test_gpu_int8's and test_w8a8's references), also under preemption, up to a near tie: the ranks' float
    sums of their shares can move one activation of a later layer by a quantization step, which moves the
    logits by about 1e-3 (one step of the reference led by 6e-4 and went the other way)."""
    from test_gpu_int8 import reference_int8_greedy
    from test_w8a8 import reference_w8a8_greedy
    from trioserve.gpu.w8a8 import write_w8a8

    model_dir = tiny_model_dir("qwen2")
    if source == "a W8A8 checkpoint":
        model_dir = tmp_path / "w8a8"
        await trio.to_thread.run_sync(write_w8a8, tiny_model_dir("qwen2"), model_dir)
    reference = reference_w8a8_greedy if source == "a W8A8 checkpoint" else reference_int8_greedy
    config = EngineConfig(
        model=str(model_dir), tensor_parallel_size=2, quantization="int8" if source.startswith("--") else None,
        block_size=4, num_kv_blocks=40, torch_threads=1, shutdown_grace_s=3.0,
    )  # fmt: skip
    with trio.fail_after(150):
        async with trioserve.open_engine(config=config) as engine:
            prompts = make_prompts(engine.info.vocab_size)
            expected = await trio.to_thread.run_sync(reference, model_dir, prompts, 16, greedy_tokens_and_margins)
            params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
            got = await run_in_one_batch(engine, prompts, params)
            compared = [before_a_near_tie(tokens, margins, NEAR_TIE) for tokens, margins in expected]
            assert [mine[: len(sure)] for mine, sure in zip(got, compared, strict=True)] == compared
            assert sum(map(len, compared)) >= 16 * len(prompts) // 2  # at least half the steps compared
            assert (await engine.stats()).num_preemptions > 0


def write_tiny_gpt2(path):
    """A tiny GPT-2 (no tensor-parallel plan in transformers) with the tiny test tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from trioserve.gpu.tiny_models import VOCAB_SIZE, build_tokenizer

    GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB_SIZE, n_positions=64, n_embd=32, n_layer=1, n_head=2)).save_pretrained(
        path
    )
    build_tokenizer(path)
    return path


async def test_a_model_without_a_tensor_parallel_plan_is_refused_at_start_naming_its_architecture(tmp_path):
    model_dir = await trio.to_thread.run_sync(write_tiny_gpt2, tmp_path / "gpt2")
    config = EngineConfig(model=str(model_dir), tensor_parallel_size=2, torch_threads=1, shutdown_grace_s=3.0)
    with trio.fail_after(60):
        with pytest.raises(trioserve.EngineStartupError, match=r"GPT2LMHeadModel .*cannot be sharded") as failed:
            async with trioserve.open_engine(config=config):
                pass
    assert failed.value.stage == "model-load"


def test_heads_that_do_not_split_evenly_are_refused(tiny_model_dir):
    from trioserve.gpu.sharding import NotShardableError, check_shardable

    check_shardable(str(tiny_model_dir("llama")), 2)
    with pytest.raises(NotShardableError, match=r"LlamaForCausalLM has 4 attention heads and 2 KV heads, .* into 4"):
        check_shardable(str(tiny_model_dir("llama")), 4)


# --- control calls, on one shared engine ------------------------------------------


@pytest.fixture(scope="module")
def tp_engine(tiny_model_dir):
    config = EngineConfig(
        model=str(tiny_model_dir("llama")),
        tensor_parallel_size=2,
        block_size=16,
        num_kv_blocks=16384,  # 64 MiB per rank: 2 layers x K and V x 1 KV head x 16 x 4 bytes x 16 tokens
        torch_threads=1,
        shutdown_grace_s=3.0,
    )
    yield from held(HostedEngine(config))


def whole_model_parameters(model_dir) -> tuple[int, int]:
    """Elements of the whole model's weights, and of those that every rank keeps whole (the norms)."""
    from safetensors import safe_open

    total = replicated = 0
    with safe_open(os.path.join(model_dir, "model.safetensors"), framework="pt") as weights:
        for name in weights.keys():  # noqa: SIM118 - safe_open is not a dict
            n = math.prod(weights.get_slice(name).get_shape())
            total += n
            replicated += n if "norm" in name else 0
    return total, replicated


def test_each_rank_holds_its_share_of_the_weights_and_of_the_kv_cache(tp_engine, tiny_model_dir):
    shards = tp_engine.call(lambda engine: engine.collective_rpc(DescribeShard()))
    assert [type(s) for s in shards] == [ShardInfo, ShardInfo]
    assert [(s.rank, s.world_size) for s in shards] == [(0, 2), (1, 2)]
    assert len({s.pid for s in shards}) == 2
    total, replicated = whole_model_parameters(tiny_model_dir("llama"))
    # The sharded weights split in two (the vocabulary's odd row goes to rank 0); the norms are on both.
    assert sum(s.num_parameters for s in shards) == total + replicated
    assert all(abs(s.num_parameters - (total + replicated) / 2) <= 64 for s in shards)
    # 2 KV heads in the model: one each, and a cache of one head's size.
    assert [s.num_kv_heads for s in shards] == [1, 1]
    assert all(s.kv_cache_bytes == 2 * 2 * 1 * 16 * 4 * 16 * 16384 for s in shards)
    stats = tp_engine.call(lambda engine: engine.stats())
    assert [w.rank for w in stats.workers] == [0, 1]


async def _stream_all(engine, prompt, params, results, key, first_token: trio.Event | None = None):
    """Stream a request; its outputs' tokens and finish reason go to ``results[key]``."""
    tokens: list[int] = []
    async with engine.stream(prompt, params) as stream:
        async for out in stream:
            tokens += out.token_ids
            if first_token is not None:
                first_token.set()
    results[key] = (tokens, out.finish_reason)


def test_pause_waits_for_running_requests_or_aborts_them_and_resume_starts_the_waiting(tp_engine):
    long = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)

    async def scenario(engine: trioserve.Engine) -> None:
        expected = (await engine.generate([5, 6, 7], long)).token_ids
        for mode in ("wait", "abort"):
            results: dict[str, tuple[list[int], str | None]] = {}
            async with trio.open_nursery() as nursery:
                started = [trio.Event(), trio.Event()]
                for i in range(2):
                    nursery.start_soon(_stream_all, engine, [5, 6, 7], long, results, f"running-{i}", started[i])
                for event in started:
                    await event.wait()
                await engine.pause(mode=mode)
                assert engine.health == "paused"
                # Both ended by now: all their tokens, or aborted part way.
                ends = {results[f"running-{i}"][1] for i in range(2)}
                assert ends == ({"length"} if mode == "wait" else {"abort"})
                if mode == "abort":
                    assert all(0 < len(results[f"running-{i}"][0]) < 64 for i in range(2))
                async with engine.stream([5, 6, 7], long) as waiting:  # submitted: held while paused
                    stats = await engine.stats()
                    assert (stats.num_running, stats.num_waiting) == (0, 1)
                    await engine.resume()
                    assert engine.health == "ready"
                    tokens = [t async for out in waiting for t in out.token_ids]
                assert tokens == expected
            if mode == "wait":
                assert results["running-0"][0] == results["running-1"][0] == expected

    tp_engine.call(scenario)


def test_sleep_gives_the_kv_cache_back_and_wake_up_serves_the_same_tokens(tp_engine):
    # 40 tokens: two whole blocks of 16 that the prefix cache keeps, unless the engine sleeps (found:
    # a prompt hitting them after a wake-up read the zeroed KV cache and gave other tokens).
    prompt = list(range(9, 49))

    async def scenario(engine: trioserve.Engine) -> None:
        expected = (await engine.generate(prompt, GREEDY)).token_ids
        assert (await engine.generate(prompt, GREEDY)).num_cached_tokens == 32
        awake = (await engine.stats()).workers
        await engine.sleep(level=1)
        assert engine.health == "sleeping"
        asleep = (await engine.stats()).workers
        for before, after in zip(awake, asleep, strict=True):
            assert after.kv_cache_bytes == 0 and after.sleep_level == 1
            assert before.rss_bytes - after.rss_bytes >= before.kv_cache_bytes / 2, (before, after)
        # A request made while asleep waits for the wake-up.
        async with engine.stream(prompt, GREEDY) as waiting:
            assert (await engine.stats()).num_waiting == 1
            await engine.wake_up()
            assert engine.health == "ready"
            outs = [out async for out in waiting]
            assert [t for out in outs for t in out.token_ids] == expected
            assert outs[-1].num_cached_tokens == 0
        # Level 2 frees the weights too; they are loaded again from the model directory.
        await engine.sleep(level=2)
        assert all(w.num_parameters == 0 for w in (await engine.stats()).workers)
        await engine.wake_up()
        assert all(w.num_parameters > 0 and w.kv_cache_bytes > 0 for w in (await engine.stats()).workers)
        assert (await engine.generate(prompt, GREEDY)).token_ids == expected

    tp_engine.call(scenario, bound_s=90)


def test_a_control_call_that_raises_on_one_rank_names_it_and_the_engine_serves_on(tp_engine):
    async def scenario(engine: trioserve.Engine) -> None:
        with pytest.raises(ControlCallError, match=r"engine-core-0: worker-1 \(rank 1\) failed Echo: .*fail_on_rank=1"):
            await engine.collective_rpc(Echo("hello", fail_on_rank=1))
        replies = await engine.collective_rpc(Echo("hello"))
        assert [(r.rank, r.text) for r in replies if isinstance(r, EchoReply)] == [(0, "hello"), (1, "hello")]
        assert len((await engine.generate([3, 4, 5], GREEDY)).token_ids) == 24
        assert engine.num_restarts == 0

    tp_engine.call(scenario)


# --- a rank killed --------------------------------------------------------------


def _workers_of_rank(rank: int, exclude: set[int]) -> list[psutil.Process]:
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.pid not in exclude and proc.environ().get("TRIOSERVE_WORKER_RANK") == str(rank):
                found.append(proc)
        except psutil.Error:
            pass  # gone meanwhile
    return found


def _rendezvous_files(worker: psutil.Process) -> list[str]:
    """The files where the ranks of ``worker``'s group meet (in its engine core's private directory)."""
    address = psutil.Process(worker.ppid()).environ()["TRIOSERVE_HANDSHAKE_ADDRESS"]
    return glob.glob(os.path.join(os.path.dirname(address.removeprefix("ipc://")), "tp-*"))


async def _generate_into(engine: trioserve.Engine, results: list[trioserve.RequestOutput]) -> None:
    results.append(await engine.generate([5, 6, 7], GREEDY))


async def _gone_within(pids: list[int], seconds: float) -> bool:
    with trio.move_on_after(seconds):
        while any(running(p) for p in pids):
            await trio.sleep(0.02)
        return True
    return False


async def test_llama_on_two_ranks_gives_the_tokens_of_one_then_kill_9_of_rank_1_in_a_step_or_at_load_restarts_the_group(
    tiny_model_dir, tmp_path, caplog, capfd
):
    """First test_two_ranks_give_the_greedy_tokens_of_one_also_with_preemption's
    checks on Llama (the same engine: one start of two ranks less). Then
    kill -9 of rank 1 in a step ends every request in flight at once, and
    again at the restart's load; the group restarts and serves."""
    model_dir = tiny_model_dir("llama")
    config, adapters = two_ranks_config(
        model_dir,
        tmp_path,
        restart_backoff_s=0.1,
        resume_requests=False,  # the requests in flight end (test_resumption.py: they are resumed by default)
    )
    # Longer than the 80 blocks of 4 hold (they stop at 321 tokens): running, preempting each other, at the kill.
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    others = {p.pid for p in psutil.Process().children(recursive=True)}  # an engine another test shares
    with trio.fail_after(300):  # 150 s for each part
        async with trioserve.open_engine(config=config) as engine:
            with trio.fail_after(150):
                await check_the_greedy_tokens_of_one_also_with_preemption(engine, model_dir, adapters, tmp_path)
            first_pids = list(engine.info.worker_pids)
            # Not the processes of an engine another test shares, nor this one's first.
            known = {p.pid for p in psutil.Process().children(recursive=True)}
            ended_at: list[float] = []

            async def doomed(started: trio.Event) -> None:
                with pytest.raises(trioserve.EngineDeadError, match=r"worker-1 .* killed by SIGKILL during step"):
                    async with engine.stream([5, 6, 7], long) as stream:
                        async for _ in stream:
                            started.set()
                ended_at.append(time.monotonic())

            # 1. During a step: every request in flight ends within a second, and rank 0 is gone as fast.
            async with trio.open_nursery() as nursery:
                events = [trio.Event() for _ in range(4)]
                for event in events:
                    nursery.start_soon(doomed, event)
                for event in events:
                    await event.wait()
                killed_at = time.monotonic()
                os.kill(first_pids[1], signal.SIGKILL)
            assert len(ended_at) == 4 and max(ended_at) - killed_at < 1.0
            assert await _gone_within(first_pids, 1.0)

            # 2. During the restart's model load, once the ranks meet: that start fails, its rank 0
            #    (perhaps waiting for rank 1 in the rendezvous) is gone within a second. A request
            #    made meanwhile waits for the group that comes up next.
            while not (rank1 := _workers_of_rank(1, known)) or not _rendezvous_files(rank1[0]):
                await trio.sleep(0.02)
            rank0 = _workers_of_rank(0, known)
            assert engine.health == "restarting"
            async with trio.open_nursery() as nursery:
                waiting: list[trioserve.RequestOutput] = []
                nursery.start_soon(lambda: _generate_into(engine, waiting))
                rank1[0].kill()
                assert await _gone_within([p.pid for p in rank0], 1.0)

            # 3. The group starts again, as one, and serves.
            assert engine.health == "ready" and engine.num_restarts == 2
            assert len(set(engine.info.worker_pids) & {*first_pids, rank1[0].pid}) == 0
            assert len(waiting[0].token_ids) == 24
        assert any("restart 1 failed" in r.message and "during model-load" in r.message for r in caplog.records)
        # Rank 0 was killed as hung both times (it may wait in a collective), not asked to stop with a grace.
        engine_cores_said = capfd.readouterr().err
        for pid in (first_pids[0], rank0[0].pid):
            assert f"worker-0 (pid {pid}) declared hung: SIGKILL" in engine_cores_said
        assert [p for p in await wait_no_children() if p.pid not in others] == []


def test_constrained_and_unconstrained_requests_share_a_batch_across_both_ranks(tp_engine):
    """Both ranks get each step's grammar bitmask and sample the same tokens
    (the executor checks that every step); the unconstrained requests give
    the tokens they give alone."""
    import json

    import jsonschema

    from trioserve.structured import JsonSchema

    schema = {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["a", "b"]}},
        "required": ["id", "tag"],
        "additionalProperties": False,
    }
    plain = [SamplingParams(max_tokens=12, seed=s, ignore_eos=True) for s in (1, 2)]
    plain.append(SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    constrained = [SamplingParams(max_tokens=60, seed=s, structured=JsonSchema(schema=schema)) for s in (3, 4)]

    async def generate_all(engine, params_list):
        results: list = [None] * len(params_list)

        async def one(i, params):
            results[i] = await engine.generate([5, 6, 7, 8, 9], params)

        async with trio.open_nursery() as nursery:
            for i, params in enumerate(params_list):
                nursery.start_soon(one, i, params)
        return results

    alone = tp_engine.call(lambda engine: generate_all(engine, plain))
    mixed = tp_engine.call(lambda engine: generate_all(engine, plain + constrained))
    assert [r.token_ids for r in mixed[: len(plain)]] == [r.token_ids for r in alone]
    for result in mixed[len(plain) :]:
        assert result.finish_reason == "stop"
        jsonschema.validate(json.loads(result.text), schema)
