"""``trioserve bench``: a quick form of the benchmark, so that it cannot rot.

The engine runs with the torch-free fake runner on the tiny test model's
tokenizer; one test runs the whole command with the tiny real Llama and the
model-only baseline, another runs transformers' baselines in-process on it
(each baseline in a process of its own, as the command runs them, costs a
torch import each).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import psutil
import pytest
import trio
from helpers.fakes import VOCAB
from helpers.serving import running, spawned, tree_of

from trioserve import EngineConfig
from trioserve.bench import cli as bench_cli
from trioserve.bench.drivers import Progress, connections_for
from trioserve.bench.flops import ModelShape, utilisation, workload_flops
from trioserve.bench.report import _flops_lines, build_result, flops_figures, flops_targets, format_table, write_json
from trioserve.bench.run import run_against_openai, run_against_server, run_in_process
from trioserve.bench.stats import RequestRecord, percentile, summarize
from trioserve.bench.steps import in_run_figures, step_log_env
from trioserve.bench.workload import MAX_NUM_REQUESTS, WorkloadSpec, build_requests, parse_range
from trioserve.cli import EXIT_USAGE, main
from trioserve.runners.steplog import STEP_LOG_ENV, StepRecord, format_step, read_step_log


def spec(**changes) -> WorkloadSpec:
    options = dict(num_requests=12, prompt_len=(4, 40), output_len=(3, 9), vocab_size=VOCAB, seed=3, concurrency=4)
    return WorkloadSpec(**{**options, **changes})


pytestmark = pytest.mark.fake_config(step_delay_s=0.002)


def check_figures(result: dict, workload: WorkloadSpec, records: list) -> None:
    """Every figure is there and sane, and each request got what it asked for."""
    run = result["results"]
    asked = sum(r.max_tokens for r in build_requests(workload))
    assert run["num_completed"] == workload.num_requests
    assert run["num_errors"] == run["num_short"] == 0
    assert run["output_tokens"] == asked
    assert run["duration_s"] > 0 and run["requests_per_s"] > 0 and run["output_tokens_per_s"] > 0
    for key in ("ttft_s", "itl_s", "e2e_s"):
        d = run[key]
        assert 0 < d["p50"] <= d["p99"] <= d["max"], key
    assert run["ttft_s"]["p50"] <= run["e2e_s"]["p50"]
    # Every token but those of a request's first delivery ends an inter-token
    # gap (a client that lags can get its first two tokens in one delivery).
    assert run["itl_s"]["count"] == asked - sum(r.deliveries[0][1] for r in records)
    table = format_table(result)
    for label in (
        "requests/s",
        "output tokens/s",
        "time to first token",
        "inter-token latency",
        "end-to-end",
        "peak RSS",
    ):
        assert label in table


def no_children_left() -> bool:
    return not psutil.Process().children(recursive=True)


async def test_in_process_run_reports_every_figure(fake_config, tmp_path):
    workload = spec()
    with trio.fail_after(30):
        outcome = await run_in_process(fake_config(), workload, Progress(workload.num_requests, enabled=False))
    assert [r.num_output_tokens for r in outcome.records] == [r.max_tokens for r in build_requests(workload)]
    assert set(outcome.peak_rss_bytes) == {"front-end + bench", "engine-core", "worker-0"}
    assert all(size > 1024 * 1024 for size in outcome.peak_rss_bytes.values())
    assert set(outcome.cpu_seconds) == set(outcome.peak_rss_bytes)
    assert all(seconds >= 0 for seconds in outcome.cpu_seconds.values())
    run = summarize(outcome.records) | {"cpu_seconds": outcome.cpu_seconds}
    result = build_result(run, outcome.peak_rss_bytes, {}, _meta(workload))
    check_figures(result, workload, outcome.records)
    assert "CPU time engine-core" in format_table(result)
    write_json(result, tmp_path / "bench.json")
    assert (
        json.loads((tmp_path / "bench.json").read_text())["results"]["output_tokens"]
        == result["results"]["output_tokens"]
    )
    assert no_children_left()


async def test_request_rate_paces_the_requests(fake_config):
    workload = spec(num_requests=6, concurrency=None, request_rate=200.0)
    with trio.fail_after(30):
        outcome = await run_in_process(fake_config(), workload, Progress(6, enabled=False))
    sent = [r.sent_s - outcome.records[0].sent_s for r in outcome.records]
    arrivals = [r.arrival_s for r in build_requests(workload)]
    assert all(s >= a - 0.005 for s, a in zip(sent, arrivals, strict=True))
    assert no_children_left()


@pytest.mark.parametrize("driver", ["websocket", "openai"])
async def test_a_driver_against_a_running_server_gets_every_token(fake_config, driver):
    """The same workload over the WebSocket protocol and over the OpenAI API
    (streamed completions, as a vLLM server is measured): the same figures."""
    from trioserve.server import Server, ServerConfig

    workload = spec(num_requests=8)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            server = Server(fake_config(), ServerConfig(port=0, shutdown_grace_s=0.5))
            nursery.start_soon(server.run)
            assert await server.wait_ready()
            run, url = (
                (run_against_server, server.url) if driver == "websocket" else (run_against_openai, server.http_url)
            )
            outcome = await run(url, None, workload, Progress(8, enabled=False))
            server.shutdown()
    assert all(r.ok and r.finish_reason == "length" for r in outcome.records)
    assert [r.num_output_tokens for r in outcome.records] == [r.max_tokens for r in build_requests(workload)]
    assert {"bench client", "server", "engine-core-0", "worker-0"} <= set(outcome.peak_rss_bytes)
    result = build_result(summarize(outcome.records), outcome.peak_rss_bytes, {}, _meta(workload))
    check_figures(result, workload, outcome.records)
    assert no_children_left()


def test_a_server_without_running_usage_has_a_token_per_chunk_and_its_last_usage_settles_the_count():
    """llama.cpp's server streams a chunk per token and reports usage only at
    the end: each chunk with text is one token, the final usage adds what a
    chunk held beyond one (an incomplete character sent with the next)."""
    from trioserve.bench.openai_driver import OpenAIServer

    def event(chunk: dict) -> bytes:
        return b"data: " + json.dumps(chunk).encode()

    record, made = RequestRecord(0, 4, 5, sent_s=0.0), 0
    for text in ["a", "", "bc", "d"]:
        made = OpenAIServer._event(event({"choices": [{"text": text, "finish_reason": None}]}), record, made)
    assert [n for _, n in record.deliveries] == [1, 1, 1] and made == 3
    final = {"choices": [{"text": "", "finish_reason": "length"}], "usage": {"completion_tokens": 5}}
    made = OpenAIServer._event(event(final), record, made)
    made = OpenAIServer._event(b"data: [DONE]", record, made)
    assert made == 5 and record.num_output_tokens == 5 and record.finish_reason == "length"


def test_the_plot_draws_every_system_of_the_run(tmp_path):
    """Our latency distributions, each baseline's ITL p50 and every system's tokens/s, in one PNG."""
    from trioserve.bench.report import plot_latencies

    records = []
    for i in range(6):
        record = RequestRecord(i, 5, 4, sent_s=10.0 + i * 0.01)
        for k in range(4):
            record.deliver(10.1 + i * 0.01 + k * 0.02, 1)
        record.finished_s, record.finish_reason = 10.2 + i * 0.01, "length"
        records.append(record)
    baselines = {
        "model-only": {"output_tokens_per_s": 300.0, "itl_p50_s": 0.015},
        "vllm": {"output_tokens_per_s": 250.0},
        "generate": {"error": "it failed"},  # left out
    }
    path = tmp_path / "run.png"
    plot_latencies(records, path, "a run", baselines, "trioserve at http://127.0.0.1:8000")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


def test_the_table_shows_the_first_errors_of_a_run_that_had_some():
    """Found: "0/4 completed, 4 errors" and nan figures, with no reason anywhere."""
    workload = spec(num_requests=2)
    records = [RequestRecord(i, 3, 4, error=f"too_long: request {i} is too long") for i in range(2)]
    table = format_table(build_result(summarize(records), {}, {}, _meta(workload)))
    assert "0/2 completed, 2 errors" in table
    assert "first errors" in table and "too_long: request 0 is too long" in table and "request 1" in table


async def test_with_url_the_workload_is_checked_against_the_servers_own_context(
    fake_config, tiny_model_dir, monkeypatch, capsys
):
    """Found: against `serve --max-model-len 64`, 100-token prompts all failed
    (nan figures, no reason given) and 50+30 had their outputs cut short."""
    from trioserve.server import Server, ServerConfig

    def forbidden(*args, **kwargs):
        raise AssertionError("nothing may start")

    monkeypatch.setattr(bench_cli, "run_against_server", forbidden)
    monkeypatch.setenv("TRIOSERVE_LOG_LEVEL", "WARNING")  # main() sets it; undone after the test
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            server = Server(fake_config(max_model_len=64), ServerConfig(port=0, shutdown_grace_s=0.5))
            nursery.start_soon(server.run)
            assert await server.wait_ready()
            argv = ["bench", "--url", server.url, "--model", str(tiny_model_dir("llama")), "--baselines", "none"]
            argv += ["--num-requests", "2", "--no-progress", "--prompt-len", "50", "--output-len", "30"]
            assert await trio.to_thread.run_sync(main, argv) == EXIT_USAGE
            server.shutdown()
    port = server.url.rsplit(":", 1)[1]
    err = capsys.readouterr().err
    assert "= 80 tokens does not fit the model's context of 64 tokens " in err
    assert f"(max_model_len at http://127.0.0.1:{port}/v1/models)\n" in err


@pytest.mark.model
def test_bench_command_with_a_real_model_and_the_model_only_baseline(tiny_model_dir, tmp_path):
    out = tmp_path / "bench.json"
    command = [
        sys.executable,
        "-m",
        "trioserve.bench.cli",
        "--model",
        str(tiny_model_dir("llama")),
        "--num-requests",
        "4",
        "--concurrency",
        "2",
        "--prompt-len",
        "8-24",
        "--output-len",
        "6",
        "--json",
        str(out),
        "--no-progress",
        "--baselines",
        "model-only",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert set(result["baselines"]) == {"model-only"}
    for kind, baseline in result["baselines"].items():
        assert "error" not in baseline, (kind, baseline)
        assert baseline["output_tokens"] == 24 and baseline["output_tokens_per_s"] > 0
        assert result["throughput_ratio"][kind] > 0
    assert result["baselines"]["model-only"]["itl_p50_s"] > 0
    in_run = result["model_steps_in_run"]  # the worker's own step log
    assert in_run["num_steps"] > 0 and 0 < in_run["model_busy_fraction"] <= 1 and in_run["itl_p50_s"] > 0
    assert {
        "tokens/s >= 0.7x model-only",
        "ITL p50 <= model steps' (same run) + 1 ms",
        "ITL p50 <= model-only ITL p50 + 1 ms",
    } <= set(result["targets"])
    assert "model-only bound" in done.stdout and "model busy" in done.stdout
    flops = result["model_flops"]  # measured on this machine before the run
    assert flops["peak_gemm"]["flops_per_s"] > 0 and flops["peak_gemm"]["dtype"] == "float32"
    assert flops["workload_flops"] > 0
    assert set(flops["utilisation"]) == {"ours", "model-only"}
    assert all(0 < u < 1 for u in flops["utilisation"].values())
    assert "model FLOP utilisation, ours" in done.stdout
    assert "model FLOP utilisation >= 0.7 (issue 13)" in result["targets"]


@pytest.mark.model
@pytest.mark.parametrize("kind", ["generate-batch", "generate"])
def test_transformers_baselines_generate_every_requested_token_on_a_real_model(tiny_model_dir, kind):
    from trioserve.bench.baselines import KINDS

    config = EngineConfig(model=str(tiny_model_dir("llama")), torch_threads=1)
    workload = WorkloadSpec(
        num_requests=4, prompt_len=(8, 24), output_len=(6, 6), vocab_size=config_vocab(config), seed=0, concurrency=2
    )
    figures = KINDS[kind](config, workload)
    assert figures["output_tokens"] == 24 and figures["output_tokens_per_s"] > 0
    assert figures["requests_per_s"] > 0 and figures["torch_threads"] >= 1


def config_vocab(config: EngineConfig) -> int:
    return int(json.loads((Path(config.model) / "config.json").read_text())["vocab_size"])


def test_workload_flops_count_dense_attention_and_sampled_lm_head():
    shape = ModelShape(hidden=4, layers=2, heads=2, kv_heads=1, head_dim=2, mlp=8, vocab=10)
    # Per layer: 2 x 4 x (2*2*2 + 2*1*2) for q, k, v, o and 2 x 3 x 4 x 8 for the MLP.
    assert shape.dense_flops_per_token == 2 * (2 * 4 * 12 + 2 * 3 * 4 * 8)
    # A prompt of 3 and 2 outputs: 4 tokens computed (the last output is never fed back),
    # attending over 1, 2, 3, 4 positions; the LM head runs for the 2 sampled tokens.
    expected = 4 * shape.dense_flops_per_token + 2 * 4 * 2 * 2 * (1 + 2 + 3 + 4) + 2 * 2 * 4 * 10
    assert workload_flops(shape, [(3, 2)]) == expected
    assert utilisation(expected, 2.0, expected) == 0.5
    smollm2 = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
               "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152}  # fmt: skip
    # 134.5M parameters, of which 28.3M are the tied embedding: 2 x 106.2M per token.
    assert ModelShape.from_config(smollm2).dense_flops_per_token == 2 * 106_168_320


def test_step_log_round_trips_and_skips_a_cut_line(tmp_path):
    steps = [StepRecord(10.0, 10.5, 300, 3, 2, 2), StepRecord(10.5125, 10.6, 3, 3, 3, 0)]
    path = tmp_path / "steps.0"
    path.write_text("".join(format_step(s) for s in steps) + "11.0 11.1 3")
    assert read_step_log(path) == steps
    assert read_step_log(tmp_path / "none.0") == []


def test_in_run_figures_count_each_step_once_per_gap_it_ends():
    steps = [
        StepRecord(0.0, 1.0, 500, 4, 0, 0),  # warm-up: before the window
        StepRecord(2.0, 3.0, 400, 4, 4, 4),  # prefill: first tokens only, no gaps
        StepRecord(3.5, 3.6, 4, 4, 4, 0),  # decodes: 4 gaps of 0.1 s
        StepRecord(3.7, 3.9, 4, 4, 4, 0),  # 4 gaps of 0.2 s
        StepRecord(4.0, 4.3, 5, 2, 1, 0),  # a long step with one gap
    ]
    figures = in_run_figures(steps, 1.5, 4.5)
    assert figures["num_steps"] == 4
    assert math.isclose(figures["model_busy_s"], 1.6) and math.isclose(figures["model_busy_fraction"], 1.6 / 3)
    assert math.isclose(figures["itl_p50_s"], 0.2)  # gaps: 4 of 0.1 s, 4 of 0.2 s, 1 of 0.3 s
    assert math.isclose(figures["idle_between_steps_p50_s"], 0.1)
    assert in_run_figures(steps, 5.0, 6.0) is None


def test_step_log_env_is_set_inside_and_restored_after(monkeypatch):
    monkeypatch.delenv(STEP_LOG_ENV, raising=False)
    with step_log_env("/tmp/x"):
        assert os.environ[STEP_LOG_ENV] == "/tmp/x"
    assert STEP_LOG_ENV not in os.environ


def test_itl_spreads_a_merged_delivery_over_its_tokens():
    record = RequestRecord(0, 5, 5, sent_s=0.0)
    for now, n in ((1.0, 1), (1.5, 1), (2.5, 2), (2.75, 1)):
        record.deliver(now, n)
    assert record.ttft == 1.0 and record.e2e == 2.75
    assert record.itls() == [0.5, 0.5, 0.5, 0.25]


def test_percentiles_interpolate_and_summary_of_nothing_is_nan():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(summarize([RequestRecord(0, 1, 1)])["requests_per_s"])


def test_workload_is_a_function_of_its_spec():
    a, b = build_requests(spec()), build_requests(spec())
    assert a == b and a != build_requests(spec(seed=4))
    assert all(4 <= len(r.prompt_token_ids) <= 40 and min(r.prompt_token_ids) >= 3 for r in a)
    assert parse_range("64") == (64, 64) and parse_range("32-256") == (32, 256)
    with pytest.raises(ValueError, match="length range"):
        parse_range("9-3")
    with pytest.raises(ValueError, match="--prompt-len: 'abc' is not N or LO-HI"):
        parse_range("abc", "--prompt-len")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--json", "/nonexistent/dir/x.json"], "--json: cannot write /nonexistent/dir/x.json"),
        (["--plot", "/nonexistent/dir/x.png"], "--plot: cannot write /nonexistent/dir/x.png"),
        (["--url", "ftp://x"], "--url: 'ftp://x' is neither a WebSocket URL"),
        (["--url", "ws://127.0.0.1:1"], "--url: cannot reach a server at ws://127.0.0.1:1: "),
        (["--url", "http://127.0.0.1:1"], "--url: cannot read the served model at http://127.0.0.1:1/v1/models: "),
    ],
)
def test_options_that_would_fail_only_after_the_run_fail_before_it_in_one_line(tiny_model_dir, options, message):
    command = [sys.executable, "-m", "trioserve.bench.cli", "--runner", "fake", "--model", str(tiny_model_dir("llama")),
               "--baselines", "none", "--num-requests", "2", "--no-progress", *options]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"trioserve: invalid input: {message}" in done.stderr and done.stdout == ""  # nothing ran


LONG = "a" * 300  # a file name over NAME_MAX (255): ENAMETOOLONG


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--json", f"{{tmp}}/{LONG}/x.json"], f"--json: cannot write {{tmp}}/{LONG}/x.json: File name too long"),
        (["--plot", f"{{tmp}}/{LONG}.png"], f"--plot: cannot write {{tmp}}/{LONG}.png: File name too long"),
        (["--json", "{tmp}"], "--json: cannot write {tmp}: it is a directory"),
        (["--model", f"{{tmp}}/{LONG}"], f"model: cannot use '{{tmp}}/{LONG}': File name too long"),
        (["--model", "{tmp}"], "model: cannot read {tmp}/config.json: No such file or directory"),
        (["--num-requests", str(10**18)], f"--num-requests: must be in [1, 1000000] (got {10**18})"),
        (
            ["--prompt-len", "5000", "--output-len", "2"],
            "a request of --prompt-len up to 5000 + --output-len up to 2 = 5002 tokens does not fit the "
            "model's context of 2048 tokens (the fake runner's max_model_len)",
        ),
        (
            ["--shared-prefix-len", str(10**18)],
            f"a request of --shared-prefix-len {10**18} + --prompt-len up to 256 + --output-len up to 64 = "
            f"{10**18 + 320} tokens does not fit the model's context of 2048 tokens (the fake runner's max_model_len)",
        ),
        (
            ["--num-requests", "1000000", "--prompt-len", "100", "--output-len", "2"],
            "--num-requests 1000000 x prompts of up to 100 tokens (--prompt-len) = 100000000 prompt tokens: "
            "at most 50000000 (every prompt is built before the run)",
        ),
        (
            ["--num-requests", "4", "--request-rate", "1e-9"],
            "--request-rate 1e-09: 4 requests would take about 3e+09 s to arrive, more than a day",
        ),
        (
            ["--runner", "hf", "--prompt-len", "400", "--output-len", "200"],
            "a request of --prompt-len up to 400 + --output-len up to 200 = 600 tokens does not fit the "
            "model's context of 512 tokens (max_position_embeddings in {model}/config.json)",
        ),
    ],
)
def test_workloads_and_paths_that_cannot_work_fail_before_anything_starts_in_one_line(
    tiny_model_dir, tmp_path, capsys, monkeypatch, options, message
):
    """Found: a path too long gave a traceback (ENAMETOOLONG); a workload
    longer than the context ran, every request failing, nan figures; and
    --num-requests (or --shared-prefix-len) 10**18 built requests until
    memory ran out."""
    model = str(tiny_model_dir("llama"))
    capsys.readouterr()  # what writing the model said, the first time

    def fill(text: str) -> str:
        return text.format(tmp=tmp_path, model=model)

    def forbidden(*args, **kwargs):
        raise AssertionError("nothing may start")

    monkeypatch.setattr(bench_cli, "run_in_process", forbidden)
    monkeypatch.setattr(bench_cli, "run_baseline", forbidden)
    monkeypatch.setenv("TRIOSERVE_LOG_LEVEL", "WARNING")  # main() sets it; undone after the test
    args = [
        "bench",
        "--runner",
        "fake",
        "--model",
        model,
        "--baselines",
        "none",
        "--num-requests",
        "2",
        "--no-progress",
    ]
    assert main([*args, *map(fill, options)]) == EXIT_USAGE
    assert capsys.readouterr().err == f"trioserve: invalid input: {fill(message)}\n"


def test_a_workload_is_bounded_and_never_opens_more_connections_than_requests():
    with pytest.raises(ValueError, match=r"num_requests: must be in \[1, 1000000\] \(got 1000001\)"):
        spec(num_requests=MAX_NUM_REQUESTS + 1)
    assert connections_for(spec(num_requests=40, concurrency=10**18)) == 2  # 32 requests a connection


def _meta(workload: WorkloadSpec) -> dict:
    return {"driver": "test", "model": "tiny", "workload": workload.to_dict(), "workload_text": "test"}


def test_no_utilisation_for_a_system_that_served_prompt_tokens_from_its_cache(tmp_path):
    """FLOPs skipped by prefix-cache hits are not the workload's: such a system
    gets the count of its cached tokens, not a utilisation (once above 100%)."""
    shape = {
        "hidden_size": 8,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 16,
        "vocab_size": 32,
    }
    (tmp_path / "config.json").write_text(json.dumps(shape))
    spec = WorkloadSpec(num_requests=4, prompt_len=(4, 8), output_len=(3, 3), vocab_size=32, shared_prefix_len=16)
    peak = {"flops_per_s": 1e6, "dtype": "float32", "torch_threads": 1, "path": "F.linear"}
    run = {"duration_s": 2.0, "engine": {"prefix_cache_hits": 48}}
    baselines = {
        "no-prefix-caching": {"seconds": 4.0},  # our engine's figures: nothing cached
        "vllm": {"seconds": 1.0, "cached_prompt_tokens": 32},
        "model-only": {"seconds": 3.0, "cached_prompt_tokens": 0},
    }
    figures = flops_figures(tmp_path, spec, peak, run, baselines)
    assert figures["not_computed"] == {"ours": 48, "vllm": 32}
    assert figures["utilisation"] == {
        "no-prefix-caching": figures["workload_flops"] / 4.0 / 1e6,
        "model-only": figures["workload_flops"] / 3.0 / 1e6,
    }
    assert flops_targets(figures) == {}  # issue 13's target is not judged on skipped work
    lines = "\n".join(_flops_lines(figures))
    assert "model FLOP utilisation, ours" in lines and "not computed (48 prompt tokens cached)" in lines
    figures = flops_figures(
        tmp_path, spec, peak, {"duration_s": 2.0}, {"vllm": {"seconds": 1.0, "cached_prompt_tokens": None}}
    )
    assert set(figures["utilisation"]) == {"ours"} and figures["not_computed"] == {"vllm": None}


def test_the_model_only_bound_says_what_its_requests_took_from_the_prefix_cache(tiny_model_dir):
    """So that no utilisation is computed for it on a shared-prefix workload."""
    pytest.importorskip("torch")
    from trioserve.bench.baselines import run_model_only
    from trioserve.config import EngineConfig
    from trioserve.gpu.tiny_models import VOCAB_SIZE

    config = EngineConfig(model=str(tiny_model_dir("llama")), block_size=4, torch_threads=1)
    plain = WorkloadSpec(num_requests=4, prompt_len=(4, 8), output_len=(2, 2), vocab_size=VOCAB_SIZE, concurrency=1)
    shared = WorkloadSpec.from_dict({**plain.to_dict(), "shared_prefix_len": 16})
    assert run_model_only(config, shared)["cached_prompt_tokens"] == 3 * 16  # one at a time: the last three hit
    assert run_model_only(config, plain)["cached_prompt_tokens"] == 0


BASELINE_SCRIPT = """
import json, sys
from trioserve.bench.run import run_baseline
from trioserve.bench.workload import WorkloadSpec
from trioserve.config import EngineConfig
from trioserve.errors import StoppedBySignal
model = sys.argv[1]
vocab = json.load(open(model + "/config.json"))["vocab_size"]
spec = WorkloadSpec(num_requests=512, prompt_len=(32, 32), output_len=(64, 64), vocab_size=vocab)
try:
    run_baseline("generate", EngineConfig(model=model), spec)
except StoppedBySignal as exc:
    print(exc, file=sys.stderr)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
async def test_a_baseline_process_ends_with_the_bench_that_started_it(tiny_model_dir, signum):
    """Found: ``trioserve bench`` stopped by SIGTERM (or kill -9) left its
    baseline process running to the end of its workload."""
    argv = [sys.executable, "-c", BASELINE_SCRIPT, str(tiny_model_dir("llama"))]
    with trio.fail_after(60), spawned(argv) as proc:
        while not (baseline := [p for p in tree_of(proc.pid) if "trioserve.bench.baselines" in _cmdline(p)]):
            assert proc.poll() is None, proc.communicate()
            await trio.sleep(0.05)
        await trio.sleep(1.0)  # a while into its run: not a wait for an event, the stop must act alike at any point
        proc.send_signal(signum)
        _, err = await trio.to_thread.run_sync(partial(proc.communicate, timeout=30))
        if signum == signal.SIGTERM:
            assert proc.returncode == 0 and err.strip() == (
                "SIGTERM: stopped the generate baseline before it finished (nothing kept)"
            ), err
        with trio.fail_after(3):  # it sees its parent gone (the watch pipe), or was stopped and reaped
            while running(baseline[0]):
                await trio.sleep(0.02)


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def test_bench_whose_standard_error_cannot_be_written_runs_and_reports_on_stdout(tiny_model_dir):
    """Found: its progress lines were printed to stderr directly; with stderr
    on a full disk (``2>/dev/full``) the first one raised, and bench exited 1
    before it ran anything. They go through ``stdio.say`` now, as every
    other command's lines do."""
    command = [sys.executable, "-m", "trioserve.bench.cli", "--model", str(tiny_model_dir("llama")),
               "--runner", "fake", "--num-requests", "4", "--concurrency", "2", "--prompt-len", "8",
               "--output-len", "4", "--baselines", "none", "--no-progress"]  # fmt: skip
    with open("/dev/full", "w") as full:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=full, text=True, timeout=60, check=False)
    assert done.returncode == 0
    assert "4/4 completed, 0 errors" in done.stdout


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
async def test_a_stop_signal_while_bench_runs_its_engine_stops_the_engine_in_order_exit_128_plus_it(
    tiny_model_dir, signum
):
    """Found: a SIGTERM or SIGHUP while bench ran its in-process engine ended
    bench at once; its engine core saw its parent gone ("the parent is gone:
    stopping") and the exit was -15 or -1."""
    argv = [sys.executable, "-m", "trioserve.cli", "bench", "--model", str(tiny_model_dir("llama")),
            "--runner", "fake", "--fake-options", '{"step_delay_s": 0.05}', "--num-requests", "64",
            "--concurrency", "4", "--prompt-len", "8", "--output-len", "200", "--no-progress"]  # fmt: skip
    with trio.fail_after(60), spawned(argv) as proc:
        while len(tree := tree_of(proc.pid)) < 2:  # its engine core and worker: it runs
            assert proc.poll() is None, proc.communicate()
            await trio.sleep(0.05)
        await trio.sleep(0.5)  # a while into its run: not a wait for an event, the stop must act alike at any point
        proc.send_signal(signum)
        _, err = await trio.to_thread.run_sync(partial(proc.communicate, timeout=30))
        assert proc.returncode == 128 + signum, err
        assert err.strip().splitlines()[-1] == (
            f"trioserve: {signum.name}: stopped the benchmark run before it finished (nothing reported)"
        )
        assert "parent is gone" not in err and "Traceback" not in err
        with trio.fail_after(3):
            while any(running(pid) for pid in tree):
                await trio.sleep(0.02)


def test_an_engine_that_dies_in_the_warm_up_is_one_line_not_a_traceback(tiny_model_dir):
    """Found: bench's warm-up request failing (its engine died at once)
    ended in a RuntimeError traceback."""
    command = [sys.executable, "-m", "trioserve.cli", "bench", "--model", str(tiny_model_dir("llama")),
               "--runner", "fake", "--fake-options", '{"die_at_step": 1}',
               "--num-requests", "4", "--prompt-len", "8", "--output-len", "4", "--no-progress"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("trioserve: RequestError: the benchmark's warm-up request failed: EngineDeadError: "), last
    assert "worker-0" in last
