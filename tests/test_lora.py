"""LoRA adapters' life cycle through the whole engine, on the fake runner
(which checks an adapter's config, and shifts the tokens of a request with
an adapter by its rank, so that each adapter's outputs are its own): adding,
listing, pinning and removing while requests run; bad adapters refused
naming the file and the problem while a request beside them completes;
never more than ``max_loras`` adapters in one step (the fake runner fails
a step with more); adapters loaded again after a worker's ``kill -9``; the
OpenAI surface (``model`` naming an adapter, ``/v1/models``, vLLM's load
and unload paths)."""

from __future__ import annotations

import json
import os
import signal

import pytest
import trio

import trioserve
from trioserve import ControlCallError, InvalidRequestError, RequestError, SamplingParams

pytestmark = pytest.mark.fake_config(num_kv_blocks=128, step_delay_s=0.002)

PROMPT = [5, 6, 7]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def write_adapter(path, r: int = 8, **config) -> str:
    """An adapter directory: PEFT's config and a weights file (the fake runner reads only the config)."""
    path.mkdir(parents=True, exist_ok=True)
    body = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": ["q_proj", "v_proj"], **config}
    (path / "adapter_config.json").write_text(json.dumps(body))
    (path / "adapter_model.safetensors").write_bytes(b"")
    return str(path)


def with_lora(name: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, lora=name)


async def test_adapters_added_used_pinned_and_removed_while_requests_run(fake_config, tmp_path):
    a = write_adapter(tmp_path / "a", r=8)
    config = fake_config(enable_lora=True, max_loras=2, lora_modules=(f"a={a}",))
    with trio.fail_after(60):
        async with trioserve.open_engine(config=config) as engine:
            assert engine.lora_names == {"a"}
            assert [(i.name, i.rank) for i in await engine.list_loras()] == [("a", 8)]
            base = (await engine.generate(PROMPT, with_lora(None))).token_ids
            with_a = (await engine.generate(PROMPT, with_lora("a"))).token_ids
            assert with_a != base
            info = await engine.add_lora("b", write_adapter(tmp_path / "b", r=3))
            assert (info.name, info.rank, info.pinned) == ("b", 3, False)
            with_b = (await engine.generate(PROMPT, with_lora("b"))).token_ids
            assert with_b not in (base, with_a)
            await engine.pin_lora("b")
            assert {i.name: i.pinned for i in await engine.list_loras()} == {"a": False, "b": True}
            with pytest.raises(ControlCallError, match="'b' is served already"):
                await engine.add_lora("b", write_adapter(tmp_path / "b2"))

            # Removing "a" while a long request runs with it: new ones naming it fail at once, the running
            # one finishes with its own tokens, and the call returns after it.
            long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, lora="a")
            done: list[list[int]] = []
            async with trio.open_nursery() as nursery:

                async def run_long() -> None:
                    done.append((await engine.generate(PROMPT, long)).token_ids)

                nursery.start_soon(run_long)
                while (await engine.stats()).num_running == 0:
                    await trio.sleep(0.01)
                await engine.remove_lora("a")
                assert done and done[0][:6] == with_a  # it ended before remove_lora returned
            with pytest.raises(RequestError, match=r"lora: no adapter named 'a' is served here \(served: 'b'\)"):
                await engine.generate(PROMPT, with_lora("a"))
            assert engine.lora_names == {"b"} and [i.name for i in await engine.list_loras()] == ["b"]
            with pytest.raises(ControlCallError, match="no adapter named 'a'"):
                await engine.remove_lora("a")
            stats = await engine.stats()
            assert stats.num_free_blocks == stats.num_total_blocks


async def test_two_adds_of_one_name_taken_during_one_step_load_it_once_and_refuse_the_other(fake_config, tmp_path):
    """Both calls arrive while a (0.3 s) step runs, so both are taken before either runs: the second is refused
    when it runs, and the engine serves on."""
    path = write_adapter(tmp_path / "c", r=2)
    with trio.fail_after(60):
        async with trioserve.open_engine(config=fake_config(enable_lora=True, step_delay_s=0.3)) as engine:
            outcomes: list[str] = []

            async def add_c() -> None:
                try:
                    outcomes.append((await engine.add_lora("c", path)).name)
                except ControlCallError as exc:
                    outcomes.append(str(exc))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(engine.generate, PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
                while (await engine.stats()).num_running == 0:
                    await trio.sleep(0.01)
                nursery.start_soon(add_c)
                nursery.start_soon(add_c)
            assert sorted(outcomes)[0] == "c" and "'c' is served already" in sorted(outcomes)[1], outcomes
            assert (await engine.generate(PROMPT, with_lora("c"))).token_ids
            assert engine.num_restarts == 0


BAD_ADAPTERS = [
    (lambda d: str(d / "missing"), "not a directory"),
    (lambda d: write_adapter(d / "no-targets", target_modules=[]), "target_modules: must be a list"),
    (lambda d: write_adapter(d / "too-big", r=64), "rank 64 is over this server's limit of 16"),
    (lambda d: write_adapter(d / "dora", use_dora=True), "use_dora: DoRA not supported"),
    (lambda d: write_adapter(d / "prompt", peft_type="PROMPT_TUNING"), "peft_type: only LORA"),
]


async def test_each_bad_adapter_is_refused_naming_its_file_while_a_request_completes(fake_config, tmp_path):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text(json.dumps({"r": 4, "target_modules": ["q_proj"]}))
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04")
    bad = [*BAD_ADAPTERS, (lambda d: str(pickled), "a pickle, which trioserve never loads")]
    with trio.fail_after(60):
        async with trioserve.open_engine(config=fake_config(enable_lora=True)) as engine:
            for make, says in bad:
                path = make(tmp_path)
                beside: list[list[int]] = []
                async with trio.open_nursery() as nursery:

                    async def one(into: list[list[int]]) -> None:
                        into.append((await engine.generate(PROMPT, GREEDY)).token_ids)

                    nursery.start_soon(one, beside)
                    with pytest.raises(ControlCallError) as caught:
                        await engine.add_lora("x", path)
                assert says in str(caught.value) and os.path.basename(path) in str(caught.value), caught.value
                assert len(beside) == 1 and len(beside[0]) == 6
            assert engine.lora_names == frozenset() and await engine.list_loras() == []
            with pytest.raises(InvalidRequestError, match=r"^lora_name: an adapter's name"):
                await engine.add_lora("bad name", str(tmp_path))
        async with trioserve.open_engine(config=fake_config()) as plain:
            with pytest.raises(InvalidRequestError, match=r"^lora: this engine serves no LoRA adapters"):
                await plain.generate(PROMPT, with_lora("a"))
            with pytest.raises(InvalidRequestError, match="started without LoRA adapters"):
                await plain.add_lora("a", str(tmp_path))


async def test_at_most_max_loras_adapters_run_in_a_step(fake_config, tmp_path):
    """Three adapters and the base, many requests each, one adapter slot: every request completes with its
    adapter's tokens (the fake runner fails any step with two adapters)."""
    modules = tuple(f"{n}={write_adapter(tmp_path / n, r=r)}" for n, r in (("x", 2), ("y", 5), ("z", 9)))
    config = fake_config(enable_lora=True, max_loras=1, lora_modules=modules)
    names = [None, "x", "y", "z"]
    with trio.fail_after(60):
        async with trioserve.open_engine(config=config) as engine:
            alone = {name: (await engine.generate(PROMPT, with_lora(name))).token_ids for name in names}
            got: dict[tuple[int, str | None], list[int]] = {}

            async def one(i: int, name: str | None) -> None:
                got[i, name] = (await engine.generate(PROMPT, with_lora(name))).token_ids

            async with trio.open_nursery() as nursery:
                for i in range(6):
                    for name in names:
                        nursery.start_soon(one, i, name)
            assert all(tokens == alone[name] for (_, name), tokens in got.items())
            assert len({tuple(t) for t in alone.values()}) == 4
            assert engine.num_restarts == 0


@pytest.mark.fake_config(num_kv_blocks=64, restart_backoff_s=0.05)
async def test_an_adapter_added_while_serving_is_loaded_again_after_a_kill_9(fake_config, tmp_path):
    with trio.fail_after(60):
        async with trioserve.open_engine(config=fake_config(enable_lora=True)) as engine:
            await engine.add_lora("late", write_adapter(tmp_path / "late", r=6))
            want = (await engine.generate(PROMPT, with_lora("late"))).token_ids
            os.kill(engine.info.worker_pids[0], signal.SIGKILL)
            while engine.num_restarts == 0 or engine.health != "ready":
                await trio.sleep(0.02)
            assert [i.name for i in await engine.list_loras()] == ["late"]
            assert (await engine.generate(PROMPT, with_lora("late"))).token_ids == want


MODEL = "tiny"


async def test_the_openai_surface_serves_adapters_by_model_name(fake_config, tmp_path):
    import openai
    from helpers.server import post_json, raw_request, serving
    from helpers.waiting import in_thread

    a = write_adapter(tmp_path / "a", r=4)
    config = fake_config(enable_lora=True, lora_modules=(f"sql={a}",))
    with trio.fail_after(60):
        async with serving(config, model_name=MODEL, api_key="key") as server:

            def calls() -> None:
                client = openai.OpenAI(base_url=server.http_url, api_key="key", max_retries=0, timeout=20)
                models = {m.id: m for m in client.models.list().data}
                assert set(models) == {MODEL, "sql"} and models["sql"].parent == MODEL  # type: ignore[attr-defined]

                def complete(model: str) -> list[int]:
                    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0)
                    return server.engine.tokenizer.encode(out.choices[0].text)  # type: ignore[union-attr]

                assert complete("sql") != complete(MODEL)
                answer = client.completions.create(model="sql", prompt=PROMPT, max_tokens=2)
                assert answer.model == "sql"  # the adapter's name, as vLLM answers
                with pytest.raises(openai.NotFoundError, match="adapters 'sql'"):
                    complete("nope")

            await in_thread(calls)

            def post(path: str, body: dict) -> tuple[int, dict]:
                status, _, answer = raw_request(
                    server, "POST", path, json.dumps(body).encode(), headers={"Authorization": "Bearer key"}
                )
                return status, json.loads(answer)

            b = write_adapter(tmp_path / "b", r=7)
            status, answer = await in_thread(post, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": b})
            assert status == 200 and answer["rank"] == 7, answer
            status, answer = await in_thread(
                post, "/v1/completions", {"model": "b", "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
            )
            assert status == 200, answer
            status, answer = await in_thread(
                post, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(tmp_path / "none")}
            )
            assert status == 400 and "not a directory" in answer["error"]["message"], answer
            status, answer = await in_thread(post, "/v1/unload_lora_adapter", {"lora_name": "b"})
            assert status == 200 and answer["deleted"], answer
            status, answer = await in_thread(post, "/v1/unload_lora_adapter", {"lora_name": "b"})
            assert status == 404, answer
            status, _ = await in_thread(post_json, server, "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": b})
            assert status == 401  # behind the API key
