"""LoRA adapters on real (tiny, random) models through the whole engine,
against PEFT: each request's greedy tokens equal those of the base model
with its adapter merged in (``merge_and_unload``), in one mixed batch of
three adapters and the base model, also under preemption; the same prompt
under different adapters shares no KV block, and the same adapter again
hits the prefix cache.

Adapters: rank 8 on the attention projections, rank 16 on attention and
MLP, rank 8 on attention and MLP with rsLoRA's scaling."""

from __future__ import annotations

import pytest
import trio
from helpers.concurrent import run_in_one_batch
from helpers.lora import ATTENTION, ATTENTION_AND_MLP, merged_model, write_adapter
from helpers.reference import make_prompts, reference_greedy

import trioserve
from trioserve import EngineConfig, SamplingParams
from trioserve.gpu.tiny_models import VOCAB_SIZE

pytestmark = pytest.mark.model

MAX_TOKENS = 10
ADAPTERS = {  # name: (rank, targets, rsLoRA)
    "attn-r8": (8, ATTENTION, False),
    "all-r16": (16, ATTENTION_AND_MLP, False),
    "all-r8-rs": (8, ATTENTION_AND_MLP, True),
}


def adapters_for(base_dir, tmp_path) -> tuple[dict[str, str], dict[str | None, object]]:
    """Each adapter's directory, and the model directory each name's tokens come from (None: the base)."""
    paths, models = {}, {None: base_dir}
    for seed, (name, (r, targets, rslora)) in enumerate(ADAPTERS.items()):
        path = write_adapter(base_dir, tmp_path / name, r=r, targets=targets, seed=seed, use_rslora=rslora)
        paths[name] = str(path)
        models[name] = merged_model(base_dir, path, tmp_path / f"{name}-merged")
    return paths, models


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
async def test_a_mixed_batch_of_adapters_gives_each_merged_models_tokens(tiny_model_dir, tmp_path, arch):
    base_dir = tiny_model_dir(arch)
    paths, models = adapters_for(base_dir, tmp_path)
    prompts = make_prompts(VOCAB_SIZE, 4)
    names: list[str | None] = [None, *ADAPTERS]
    jobs = [(prompt, name) for prompt in prompts for name in names]  # 16 requests, 4 adapters and the base
    want = {name: reference_greedy(models[name], prompts, MAX_TOKENS) for name in names}
    config = EngineConfig(
        model=str(base_dir),
        block_size=4,
        enable_lora=True,
        max_loras=3,
        lora_modules=tuple(f"{name}={path}" for name, path in paths.items()),
        # Under preemption (llama): 24 blocks of 4 tokens hold a few of these requests at once.
        num_kv_blocks=24 if arch == "llama" else None,
        shutdown_grace_s=3.0,
    )
    with trio.fail_after(180):
        async with trioserve.open_engine(config=config) as engine:
            params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, lora=n) for _, n in jobs]
            got = await run_in_one_batch(engine, [prompt for prompt, _ in jobs], params)
            stats = await engine.stats()
            if arch == "llama":
                # A new prompt under the base and two adapters: three outputs, no block shared.
                fresh = make_prompts(VOCAB_SIZE, 8)[6]
                outs = {}
                for name in (None, "attn-r8", "all-r16"):
                    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, lora=name)
                    outs[name] = await engine.generate(fresh, params)
                again = await engine.generate(
                    fresh, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, lora="all-r16")
                )
    for (prompt, name), tokens in zip(jobs, got, strict=True):
        assert tokens == want[name][prompts.index(prompt)], (name, prompt)
    assert len({tuple(t) for t in (want[n][0] for n in names)}) == len(names)  # every adapter changes the output
    if arch == "llama":
        assert stats.num_preemptions > 0
        assert len({tuple(out.token_ids) for out in outs.values()}) == 3
        # Each ran after the one before had cached this prompt's blocks: none hit across adapters; the same
        # adapter again hits its own (every whole block of the prompt but the last token's).
        assert [out.num_cached_tokens for out in outs.values()] == [0, 0, 0]
        assert again.token_ids == outs["all-r16"].token_ids
        assert again.num_cached_tokens == 4 * ((len(fresh) - 1) // 4)


def corrupt(adapter_dir, out, change) -> str:
    """A copy of an adapter whose weights ``change`` (a dict of tensors -> a dict of tensors) rewrote."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter_dir, out)
    weights = out / "adapter_model.safetensors"
    save_file(change(load_file(weights)), weights)
    return str(out)


async def test_adapters_loaded_evicted_and_refused_on_a_real_model(tiny_model_dir, tmp_path):
    """Adapters added while a request runs; one slot and one adapter in memory, so that each use of the other
    reads it again from its directory: the same tokens each time. Each bad adapter refused with an error naming
    its file and the problem, while a request beside it completes."""
    from helpers.lora import edit_config

    base_dir = tiny_model_dir("llama")
    p = write_adapter(base_dir, tmp_path / "p", r=8, targets=ATTENTION, seed=7)
    q = write_adapter(base_dir, tmp_path / "q", r=16, targets=ATTENTION_AND_MLP, seed=8)
    prompts = make_prompts(VOCAB_SIZE, 3)
    want_p = reference_greedy(merged_model(base_dir, p, tmp_path / "p-merged"), prompts, MAX_TOKENS)
    want_q = reference_greedy(merged_model(base_dir, q, tmp_path / "q-merged"), prompts, MAX_TOKENS)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    too_big = write_adapter(base_dir, tmp_path / "big", r=32, targets=ATTENTION, seed=9)
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "adapter_config.json").write_text((p / "adapter_config.json").read_text())
    unknown_target = corrupt(p, tmp_path / "unknown-target", lambda w: w)
    edit_config(tmp_path / "unknown-target", target_modules=["q_proj", "nonexistent_proj"])
    bad = [
        (str(no_weights), "adapter_model.safetensors: missing"),
        (corrupt(p, tmp_path / "shapes", lambda w: {**w, key: w[key][:, :-1].contiguous()}), "has shape [8, 63]"),
        (corrupt(p, tmp_path / "layer", lambda w: {k.replace("q_proj", "x_proj"): v for k, v in w.items()}), "x_proj"),
        (unknown_target, "no linear layer named 'nonexistent_proj'"),
        (str(too_big), "rank 32 is over this server's limit of 16"),
    ]
    params = {name: SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, lora=name) for name in "pq"}
    config = EngineConfig(model=str(base_dir), enable_lora=True, max_loras=1, max_cpu_loras=1, shutdown_grace_s=3.0)
    with trio.fail_after(180):
        async with trioserve.open_engine(config=config) as engine:
            await engine.add_lora("p", p)
            got_p = [(await engine.generate(prompt, params["p"])).token_ids for prompt in prompts]
            async with trio.open_nursery() as nursery:  # q added while p's requests run
                running: list[list[int]] = []

                async def run_p() -> None:
                    running.append((await engine.generate(prompts[2], params["p"])).token_ids)

                nursery.start_soon(run_p)
                await engine.add_lora("q", q)  # p leaves memory (max_cpu_loras=1) but not its slot
            got_q = [(await engine.generate(prompt, params["q"])).token_ids for prompt in prompts]
            again_p = [(await engine.generate(prompt, params["p"])).token_ids for prompt in prompts]  # read again
            for path, says in bad:
                beside: list[list[int]] = []
                async with trio.open_nursery() as nursery:

                    async def one(into: list[list[int]]) -> None:
                        into.append((await engine.generate(prompts[0], params["q"])).token_ids)

                    nursery.start_soon(one, beside)
                    with pytest.raises(trioserve.ControlCallError) as caught:
                        await engine.add_lora("bad", path)
                assert says in str(caught.value) and path in str(caught.value), caught.value
                assert beside == [want_q[0]]
            assert sorted(engine.lora_names) == ["p", "q"]
            stats = await engine.stats()
    assert got_p == want_p and again_p == want_p and running == [want_p[2]]
    assert got_q == want_q
    assert stats.num_free_blocks == stats.num_total_blocks
