"""Profiling (``Engine.start_profile`` / ``stop_profile``, ``POST /start_profile`` and ``/stop_profile``): one
Chrome trace per engine core and rank, and one of each engine core's step-loop spans; off without ``profiler_dir``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import trio
from helpers.concurrent import run_concurrently
from helpers.fakes import fake_tokens
from helpers.server import raw_request, serving
from helpers.waiting import in_thread

import trioserve
from trioserve import SamplingParams
from trioserve.errors import ControlCallError

CORE_SPANS = {"schedule", "send", "wait", "postprocess"}


def trace_names(path: str) -> set[str]:
    """The names of a trace file's complete events (it must load as Chrome trace JSON)."""
    with open(path, encoding="utf-8") as file:
        document = json.load(file)
    return {e["name"] for e in document["traceEvents"] if e.get("ph") == "X"}


async def test_a_recording_writes_a_trace_per_engine_and_rank_and_the_engine_cores_spans(fake_config, tmp_path):
    config = fake_config(data_parallel_size=2, tensor_parallel_size=2, profiler_dir=str(tmp_path / "profiles"))
    with trio.fail_after(60):
        async with trioserve.open_engine(config=config) as engine:
            await run_concurrently(engine, [[5, i] for i in range(6)], SamplingParams(max_tokens=4))  # not recorded
            await engine.start_profile()
            with pytest.raises(ControlCallError, match="a profile is already being recorded"):
                await engine.start_profile()
            outputs = await run_concurrently(engine, [[7, i] for i in range(8)], SamplingParams(max_tokens=5))
            assert outputs == [fake_tokens([7, i], 5) for i in range(8)]
            traces = await engine.stop_profile()
            with pytest.raises(ControlCallError, match="no profile is being recorded"):
                await engine.stop_profile()
            assert (await engine.generate([5, 6], SamplingParams(max_tokens=3))).token_ids == fake_tokens([5, 6], 3)
            assert (engine.health, engine.num_restarts) == ("ready", 0)
    written = sorted(os.listdir(tmp_path / "profiles"))
    assert [str(tmp_path / "profiles" / name) for name in written] == sorted(traces)
    session = written[0].removeprefix("trioserve-").split("-engine-")[0]
    assert written == sorted(
        f"trioserve-{session}-engine-{e}-{part}.trace.json" for e in (0, 1) for part in ("core", "rank-0", "rank-1")
    )
    steps = 0
    for name in written:
        names = trace_names(str(tmp_path / "profiles" / name))
        if name.endswith("-core.trace.json"):
            assert names >= CORE_SPANS, name
        else:
            assert names == {"fake_step"}, name  # the fake runner's own steps (it has no torch)
            with open(tmp_path / "profiles" / name, encoding="utf-8") as file:
                steps += sum(e.get("ph") == "X" for e in json.load(file)["traceEvents"])
    assert steps >= 4 * 5  # every rank of both engines stepped while recorded (5 tokens each)


async def test_without_a_profiler_dir_profiling_is_off_and_its_paths_are_not_found(fake_config, tmp_path):
    with trio.fail_after(30):
        async with serving(fake_config(), api_key="sesame") as server:
            engine = server.engine
            assert engine is not None
            for call in (engine.start_profile, engine.stop_profile):
                with pytest.raises(ControlCallError, match=r"profiling is off: start the engine with --profiler-dir"):
                    await call()
            bearer = {"Authorization": "Bearer sesame"}
            status, _, body = await in_thread(raw_request, server, "POST", "/start_profile", headers=bearer)
            assert status == 404 and b"--profiler-dir" in body


async def test_the_profiling_paths_answer_behind_the_api_key(fake_config, tmp_path):
    config = fake_config(profiler_dir=str(tmp_path))
    with trio.fail_after(30):
        async with serving(config, api_key="sesame") as server:
            bearer = {"Authorization": "Bearer sesame"}
            assert (await in_thread(raw_request, server, "POST", "/start_profile"))[0] == 401
            status, _, body = await in_thread(raw_request, server, "POST", "/start_profile", headers=bearer)
            assert (status, json.loads(body)) == (200, {"profiling": True})
            status, _, body = await in_thread(raw_request, server, "POST", "/start_profile", headers=bearer)
            assert status == 409 and "already being recorded" in json.loads(body)["error"]["message"]
            status, _, body = await in_thread(raw_request, server, "POST", "/stop_profile", headers=bearer)
            assert status == 200
            traces = json.loads(body)["traces"]
            assert sorted(Path(t).name.split("-engine-")[1] for t in traces) == [
                "0-core.trace.json",
                "0-rank-0.trace.json",
            ]
            assert all(Path(t).parent == tmp_path for t in traces)


ATEN_PRODUCTS = {"aten::mm", "aten::addmm", "aten::linear"}


@pytest.mark.model
async def test_a_real_models_worker_trace_names_its_matrix_products(tiny_model_dir, tmp_path, monkeypatch):
    # The body's linear layers through F.linear (torch's own products), the LM head through our packed CPU
    # GEMM (gpu/cpu_kernels/linear.py), which a profile must name too.
    monkeypatch.setenv("TRIOSERVE_PACKED_LINEAR", "lm_head")
    config = trioserve.EngineConfig(model=str(tiny_model_dir("llama")), block_size=4, profiler_dir=str(tmp_path))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with trio.fail_after(120):
        async with trioserve.open_engine(config=config) as engine:
            await engine.start_profile()
            await run_concurrently(engine, [[5, 6, 7], [8, 9]], params)
            traces = await engine.stop_profile()
    worker = [t for t in traces if t.endswith("-rank-0.trace.json")]
    core = [t for t in traces if t.endswith("-core.trace.json")]
    assert len(worker) == 1 and len(core) == 1 and len(traces) == 2
    names = trace_names(worker[0])
    assert names & ATEN_PRODUCTS, sorted(names)[:80]
    if not torch_cuda():
        assert "trioserve::panel_linear" in names, sorted(n for n in names if not n.startswith("aten::"))
    assert trace_names(core[0]) >= CORE_SPANS


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
