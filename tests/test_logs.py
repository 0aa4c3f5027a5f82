"""What ``serve`` logs: every line with its date and time and level, INFO
by default; one access-log line per HTTP request; a stats line while it
works; ``--log-format json``, one JSON object a line, in every process."""

from __future__ import annotations

import json
import re
import signal
import urllib.error
import urllib.request

import pytest
import trio
from helpers.serving import serve_argv, spawned, wait_for_url
from helpers.waiting import in_thread

TEXT_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+\[\d+\] \S+: .*")


def requests(base: str) -> list[int]:
    """Two completions and a request for a path that does not exist; their statuses."""
    statuses = []
    for path, body in (("/v1/completions", {"model": "m", "prompt": "Hi", "max_tokens": 3}),) * 2 + (("/nope", {}),):
        request = urllib.request.Request(
            f"{base}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            statuses.append(urllib.request.urlopen(request, timeout=20).status)
        except urllib.error.HTTPError as exc:
            statuses.append(exc.code)
    return statuses


@pytest.mark.parametrize("log_format", ["text", "json"])
async def test_serve_logs_with_times_one_access_line_per_request_and_a_stats_line(tiny_model_dir, log_format):
    options = (
        "--runner",
        "fake",
        "--served-model-name",
        "m",
        "--log-format",
        log_format,
        "--log-stats-interval",
        "0.2",
    )
    with trio.fail_after(60), spawned(serve_argv(str(tiny_model_dir("llama")), *options)) as proc:
        url = await in_thread(wait_for_url, proc, 30)
        assert await in_thread(requests, url.replace("ws://", "http://")) == [200, 200, 404]
        await trio.sleep(0.6)  # a stats line or two
        proc.send_signal(signal.SIGTERM)
        assert await in_thread(proc.wait, 30) == 0
        assert proc.stderr is not None
        err = proc.stderr.read().splitlines()
    log_lines = [line for line in err if not line.startswith("trioserve: ")]  # (the command's own words)
    if log_format == "json":
        records = [json.loads(line) for line in log_lines]  # every line parses
        assert {"time", "level", "logger", "process", "pid", "message"} <= set(records[0])
        assert {r["process"] for r in records} >= {"serve", "engine-core", "worker"}  # the children's too
    else:
        assert log_lines and all(TEXT_LINE.fullmatch(line) for line in log_lines), log_lines
        records = [{"logger": line.split()[4].rstrip(":"), "message": line} for line in log_lines]
    access = [r for r in records if r["logger"] == "trioserve.access"]
    assert len(access) == 3  # one a request
    if log_format == "json":
        assert [(r["method"], r["path"], r["status"]) for r in access] == [
            ("POST", "/v1/completions", 200),
            ("POST", "/v1/completions", 200),
            ("POST", "/nope", 404),
        ]
        assert access[0]["generated_tokens"] == 3 and access[0]["prompt_tokens"] > 0 and access[0]["request_id"]
        assert all(r["duration_s"] >= 0 for r in access)
    else:
        assert '"POST /v1/completions" 200' in access[0]["message"] and "generated_tokens=3" in access[0]["message"]
        assert '"POST /nope" 404' in access[2]["message"]
    stats = [r for r in records if r["logger"] == "trioserve.stats"]
    assert stats and "KV cache usage" in stats[0]["message"]
    assert len(stats) <= 3  # only while something happened, not every 0.2 s of the idle time after


async def test_disable_log_requests_and_stats_turn_them_off(tiny_model_dir):
    options = ("--runner", "fake", "--served-model-name", "m", "--disable-log-requests", "--disable-log-stats")
    with trio.fail_after(60), spawned(serve_argv(str(tiny_model_dir("llama")), *options)) as proc:
        url = await in_thread(wait_for_url, proc, 30)
        await in_thread(requests, url.replace("ws://", "http://"))
        proc.send_signal(signal.SIGTERM)
        assert await in_thread(proc.wait, 30) == 0
        assert proc.stderr is not None
        err = proc.stderr.read()
    assert "trioserve.access" not in err and "trioserve.stats" not in err and "INFO serve" in err
