"""vLLM's command-line flags that trioserve does not take, each with why
and what to do instead: a ``vllm serve`` command line with one of them
fails with a line naming it, not argparse's bare "unrecognized arguments".
The flags it does take, under vLLM's names and aliases, are in
``engine_options.py`` and ``cli/server_options.py``
(docs/vllm-compatibility.md lists both)."""

from __future__ import annotations

from collections.abc import Sequence

_NOT_YET = "not supported yet"
UNSUPPORTED: dict[str, str] = {
    "--kv-cache-dtype": "the KV cache has the model's dtype (--dtype)",
    "--pipeline-parallel-size": "pipeline parallelism is not supported: use -tp and -dp",
    "-pp": "pipeline parallelism is not supported: use -tp and -dp",
    "--speculative-config": f"speculative decoding is {_NOT_YET}",
    "--reasoning-parser": f"reasoning parsers are {_NOT_YET}",
    "--structured-outputs-config": "structured outputs are served by llguidance, which takes no configuration",
    "--guided-decoding-backend": "structured outputs are served by llguidance, the one grammar engine here",
    "--distributed-executor-backend": "workers are the engine core's own processes; Ray can place whole engine "
    "cores instead (--data-parallel-backend ray)",
    "--swap-space": "preempted requests are recomputed, never swapped to the CPU",
    "--cpu-offload-gb": "weights are not offloaded",
    "--load-format": "weights load from safetensors or pytorch_model*.bin, or a .gguf model",
    "--tokenizer-mode": "the tokenizer is the model's tokenizer.json",
    "--max-seq-len-to-capture": "no CUDA graphs are captured",
    "--enable-sleep-mode": "sleep mode is always available (POST /v1/engine/sleep)",
}


def unsupported_flag(argv: Sequence[str]) -> str | None:
    """A line naming the first of vLLM's flags in ``argv`` that trioserve does not take, or None."""
    for arg in argv:
        if arg == "--":
            return None
        name = arg.split("=", 1)[0]
        if name in UNSUPPORTED:
            return f"trioserve: {name} is vLLM's flag, and trioserve does not take it: {UNSUPPORTED[name]}"
    return None
