"""A benchmark's requests through vLLM's offline engine, run by vLLM's own interpreter::

    /tmp/vllm-venv/bin/python vllm_driver.py JOB.json RESULT.json

Standalone on purpose (the standard library and vllm only): vLLM lives in a
virtual environment of its own (it pins another transformers), where
trioserve is not installed. ``bench/vllm_baseline.py`` writes the job and
reads the result (a file: vLLM logs to stdout, even as it exits).

The job holds the model directory, the requests (token-id prompts and their
output lengths) and the engine's limits. The engine is built as ``LLM``
builds it (``LLM(...)``, then its ``llm_engine``), with the tokenizer
skipped (prompts are token ids, outputs are not detokenized). The
requests go through the same closed loop as ``trioserve bench``'s: at most
``concurrency`` in flight, the next one added as soon as one finishes, each
greedy with EOS ignored, so that each makes exactly its output length. A
request's time to first token runs from its ``add_request`` to the
``step()`` that returns its first token, as ours runs from the moment the
bench client sends it. ``LLM.generate`` would add every request at once, so
that a request's wait for a slot counted as its TTFT; the loop here is the
one ``LLM.generate`` runs (add, then step until done), with the additions spread.
Two short warm-up requests run first, uncounted (vLLM compiles its model then).
The result also holds the peak resident memory of the driver and of each
process under it (vLLM's engine core runs in a child process): the kernel's
high-water marks (``VmHWM``), read on Linux while they all still run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def build_llm(job: dict[str, Any]) -> Any:
    from vllm import LLM

    return LLM(
        model=job["model"],
        skip_tokenizer_init=True,
        dtype=job["dtype"],
        seed=job["seed"],
        max_num_seqs=job["max_num_seqs"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
        max_model_len=job["max_model_len"],
        enable_prefix_caching=job["enable_prefix_caching"],
    )


def run(engine: Any, requests: list[list[Any]], concurrency: int | None) -> dict[str, Any]:
    """Drive ``engine`` through ``requests`` (``[prompt ids, max_tokens]``) in a closed loop."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sent: dict[str, float] = {}
    seen: dict[str, int] = {}  # output tokens received so far
    last: dict[str, float] = {}
    ttfts: list[float] = []
    itls: list[float] = []
    output_tokens, in_flight, next_index = 0, 0, 0
    cached_prompt_tokens = 0  # prompt tokens served from vLLM's prefix cache
    started = time.perf_counter()
    while next_index < len(requests) or engine.has_unfinished_requests():
        while next_index < len(requests) and (concurrency is None or in_flight < concurrency):
            prompt, max_tokens = requests[next_index]
            params = SamplingParams(
                max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False
            )
            req_id = f"r{next_index}"  # outputs carry this id (add_request returns an internal one)
            engine.add_request(req_id, TokensPrompt(prompt_token_ids=prompt), params)
            sent[req_id], seen[req_id] = time.perf_counter(), 0
            next_index += 1
            in_flight += 1
        for out in engine.step():
            now = time.perf_counter()
            count = len(out.outputs[0].token_ids)  # cumulative
            new = count - seen[out.request_id]
            if new > 0:
                if seen[out.request_id] == 0:
                    ttfts.append(now - sent[out.request_id])
                else:
                    itls.extend([(now - last[out.request_id]) / new] * new)
                seen[out.request_id], last[out.request_id] = count, now
            if out.finished:
                in_flight -= 1
                output_tokens += count
                cached_prompt_tokens += out.num_cached_tokens or 0
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "output_tokens": output_tokens, "num_requests": len(requests), "ttfts_s": ttfts,
            "itls_s": itls, "cached_prompt_tokens": cached_prompt_tokens}  # fmt: skip


def peak_rss_bytes() -> dict[str, int]:
    """``VmHWM`` of this process and of every live descendant, by pid (Linux; else empty)."""
    peaks: dict[str, int] = {}
    pending = [os.getpid()]
    while pending:
        pid = pending.pop()
        try:
            with open(f"/proc/{pid}/status") as f:
                hwm = [int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")]
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                pending.extend(int(child) for child in f.read().split())
        except (OSError, ValueError):
            continue
        if hwm:
            peaks[str(pid)] = hwm[0]
    return peaks


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    llm = build_llm(job)
    run(llm.llm_engine, job["warmup"], None)
    result = run(llm.llm_engine, job["requests"], job["concurrency"])
    import vllm

    result["vllm_version"] = getattr(vllm, "__version__", "unknown")
    result["peak_rss_bytes_by_pid"] = peak_rss_bytes()
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the guard is required
    main()
