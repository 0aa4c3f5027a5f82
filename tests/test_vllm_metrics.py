"""``/metrics`` under vLLM's names: every metric vLLM's published Grafana
dashboard queries (examples/online_serving/prometheus_grafana/grafana.json
in vLLM's repository) is served with the ``model_name`` label, and with
``serve --api-server-count 2`` the totals count every request, whichever API
server served it and whichever answers the scrape."""

from __future__ import annotations

import json
import signal
import urllib.request

import trio
from helpers.serving import serve_argv, spawned, wait_for_url
from helpers.waiting import in_thread, wait_until
from prometheus_client.parser import text_string_to_metric_families

# The series vLLM's dashboard queries (histograms by their _bucket, _sum and _count series).
DASHBOARD = {
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:gpu_cache_usage_perc", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
}  # fmt: skip
# And what else an operator of vLLM reads.
MORE = {
    "vllm:inter_token_latency_seconds_count", "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:request_inference_time_seconds_sum",
    "vllm:cache_config_info", "vllm:request_params_max_tokens_sum", "vllm:iteration_tokens_total_bucket",
    "vllm:iteration_tokens_total_sum", "vllm:iteration_tokens_total_count",
}  # fmt: skip
NUM_REQUESTS = 12


def scrape(base: str) -> dict[str, list]:
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def iteration_tokens(samples: dict[str, list]) -> float:
    return sum(s.value for s in samples.get("vllm:iteration_tokens_total_sum", []))


def complete(base: str, i: int) -> None:
    body = json.dumps({"model": "m", "prompt": [5, 6, 7 + i], "max_tokens": 4, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=20) as response:  # a new connection each: both API servers serve
        assert json.loads(response.read())["usage"]["completion_tokens"] == 4


async def test_the_dashboards_metrics_are_served_and_count_every_request_across_two_api_servers(tiny_model_dir):
    argv = serve_argv(str(tiny_model_dir("llama")), "--runner", "fake", "--served-model-name", "m")
    with trio.fail_after(90), spawned([*argv, "--api-server-count", "2"]) as proc:
        base = (await in_thread(wait_for_url, proc, 60)).replace("ws://", "http://")
        for i in range(NUM_REQUESTS):
            await in_thread(complete, base, i)

        # The engine cores' counters reach the shared metrics at API server 0's next refresh (every 2 s).
        async def counted() -> bool:
            return iteration_tokens(await in_thread(scrape, base)) == 6 * NUM_REQUESTS

        await wait_until(counted, 15, "the engine's steps in the metrics", interval=0.5)
        scrapes = [await in_thread(scrape, base) for _ in range(6)]  # answered by either API server
        proc.send_signal(signal.SIGTERM)
        assert await in_thread(proc.wait, 30) == 0
    for samples in scrapes:
        assert set(samples) >= DASHBOARD | MORE, sorted(DASHBOARD | MORE - set(samples))
        assert all(s.labels["model_name"] == "m" for name in DASHBOARD for s in samples[name])
        ended = {s.labels["finished_reason"]: s.value for s in samples["vllm:request_success_total"]}
        assert ended["length"] == NUM_REQUESTS  # every request, whichever API server served it
        assert sum(s.value for s in samples["vllm:generation_tokens_total"]) == 4 * NUM_REQUESTS
        assert sum(s.value for s in samples["vllm:e2e_request_latency_seconds_count"]) == NUM_REQUESTS
        assert sum(s.value for s in samples["vllm:request_queue_time_seconds_count"]) == NUM_REQUESTS
        # Each request computes its 3 prompt tokens and 3 of its 4 outputs (the last is sampled, not computed).
        assert iteration_tokens(samples) == 6 * NUM_REQUESTS
        steps = sum(s.value for s in samples["vllm:iteration_tokens_total_count"])
        assert NUM_REQUESTS * 4 / 2 <= steps <= NUM_REQUESTS * 4  # at least one token a step, at most two requests


def test_iteration_tokens_take_each_steps_count_and_count_a_restarted_engines_steps_again():
    from prometheus_client.exposition import generate_latest

    from trioserve.messages import ITERATION_TOKEN_BUCKETS, EngineStats
    from trioserve.server.metrics import ServerMetrics

    metrics = ServerMetrics(model_name="m")
    buckets = len(ITERATION_TOKEN_BUCKETS) + 1

    def scrape(num_restarts: int, steps: dict[int, int], tokens: int) -> dict[str, float]:
        counts = [0] * buckets
        for bucket, n in steps.items():
            counts[bucket] = n
        metrics.update_restarts([num_restarts])
        metrics.update_from_stats(EngineStats(0, 0, 8, 8, 0, 50, num_scheduled_tokens=tokens, iteration_tokens=counts))
        histogram = {}
        for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
            for sample in family.samples:
                if sample.name.startswith("vllm:iteration_tokens_total"):
                    histogram[sample.name.removeprefix("vllm:iteration_tokens_total") + sample.labels.get("le", "")] = (
                        sample.value
                    )
        return histogram

    # 3 steps of one token, 2 of 9 to 16 tokens (le 16.0), one of 20,000 (only in +Inf): 3 + 25 + 20,000 tokens.
    first = scrape(0, {0: 3, 2: 2, buckets - 1: 1}, 20028)
    assert (first["_bucket1.0"], first["_bucket8.0"], first["_bucket16.0"], first["_bucket16384.0"]) == (3, 3, 5, 5)
    assert (first["_bucket+Inf"], first["_count"], first["_sum"]) == (6, 6, 20028)
    again = scrape(0, {0: 4, 2: 2, buckets - 1: 1}, 20029)  # one more step of one token
    assert (again["_bucket1.0"], again["_count"], again["_sum"]) == (4, 7, 20029)
    restarted = scrape(1, {0: 2}, 2)  # a new life: its own two steps are added
    assert (restarted["_bucket1.0"], restarted["_count"], restarted["_sum"]) == (6, 9, 20031)
