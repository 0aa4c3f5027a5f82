"""Our chat-template renderer (``frontend/text/chat_template.py``) against transformers' own
(``transformers.utils.chat_template_utils.render_jinja_template``, which needs no torch): the same texts, what
each costs to import and to render, and what each does with a template that grows without bound.

    PYTHONPATH=src python scripts/compare_chat_templates.py [--model DIR] [--renders 2000]

--model defaults to the default model's directory (SmolLM2-135M-Instruct, converted on first use). Two
templates: that model's own, and a ChatML template with tools (tojson, namespace, loop controls and
raise_exception, as tool-calling templates use them). Conversations: short and long chats, with and without a
system message, with tools, and with the generation prompt on and off.

- equal: every conversation rendered by both, and the texts compared.
- import: a fresh interpreter importing each renderer's module; seconds and the resident memory it adds,
  median of 5.
- render: microseconds per render of each conversation, median over rounds that alternate the two renderers.
- unbounded: a template that doubles a message's text in a loop: ours stops it at a character bound, as the
  server does; transformers' is given 10 s in a child process (and its memory is capped at 4 GiB).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from trioserve.default_model import default_model_dir
from trioserve.errors import InvalidRequestError
from trioserve.frontend.text.chat_template import ChatTemplate

TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Answer a call as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- set ns = namespace(calls=0) %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% if not loop.first %}{{ raise_exception('system only first') }}{% endif %}
{%- continue %}{% endif %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}{% set ns.calls = ns.calls + 1 %}
<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

UNBOUNDED = (
    "{% set ns = namespace(s=messages[0].content) %}"
    "{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city — «today»",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def conversations() -> dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]:
    turn = [{"role": "user", "content": "What is the capital of France? Réponds en français."}]
    long_chat = [{"role": "system", "content": "You are terse."}]
    for i in range(20):
        long_chat += [
            {"role": "user", "content": f"Question {i}: what is {i} squared? " * 4},
            {"role": "assistant", "content": f"It is {i * i}. " * 4},
        ]
    long_chat.append({"role": "user", "content": "Thanks 🙂"})
    tool_chat = [
        {"role": "system", "content": "You help with the weather."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"temperature": 21}'},
    ]
    return {
        "one turn": (turn, None),
        "41 turns": (long_chat, None),
        "tools": (tool_chat, [WEATHER]),
    }


def import_cost(module: str) -> tuple[float, float]:
    """Seconds and MiB of resident memory that importing ``module`` adds to a fresh interpreter."""
    rss = "int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20"
    code = f"import time; r0 = {rss}; t = time.perf_counter(); import {module}; "
    code += f"print(time.perf_counter() - t, {rss} - r0)"
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True) for _ in range(5)]
    seconds, mib = zip(*(map(float, run.stdout.split()) for run in runs), strict=True)
    return statistics.median(seconds), statistics.median(mib)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--renders", type=int, default=2000)
    args = parser.parse_args()
    model_dir = args.model or default_model_dir(announce=False)
    from transformers.utils.chat_template_utils import render_jinja_template

    own = ChatTemplate.from_dir(model_dir)
    assert own is not None, f"{model_dir} has no chat template"
    templates = {"model's": own.source, "ChatML with tools": TOOLS_TEMPLATE}
    print(f"model: {model_dir}")

    def ours(source: str, messages: list[dict[str, Any]], tools: Any, gen: bool) -> str:
        return ChatTemplate(source).render(messages, add_generation_prompt=gen, tools=tools)

    def theirs(source: str, messages: list[dict[str, Any]], tools: Any, gen: bool) -> str:
        text, _ = render_jinja_template([messages], tools=tools, chat_template=source, add_generation_prompt=gen)
        return text[0]

    renderers = {"ours": ours, "transformers": theirs}
    cases = [
        (tname, cname, gen)
        for tname in templates
        for cname, (_, tools) in conversations().items()
        if (tools is None or tname != "model's")
        for gen in (True, False)
    ]
    equal = 0
    for tname, cname, gen in cases:
        messages, tools = conversations()[cname]
        texts = {name: render(templates[tname], messages, tools, gen) for name, render in renderers.items()}
        if texts["ours"] != texts["transformers"]:
            raise SystemExit(f"{tname} template, {cname}, generation prompt {gen}: the texts differ")
        equal += 1
    print(f"equal: {equal} of {len(cases)} renders give the same text")

    for name, module in (
        ("ours", "trioserve.frontend.text.chat_template"),
        ("transformers", "transformers.utils.chat_template_utils"),
    ):
        seconds, mib = import_cost(module)
        print(f"import {name:<13} {seconds:6.3f} s  +{mib:5.1f} MiB")

    print(f"{'render':<34} {'ours us':>9} {'transformers us':>16} {'ratio':>7}")
    compiled = {tname: ChatTemplate(source) for tname, source in templates.items()}
    for tname, cname, gen in cases:
        if not gen:
            continue
        messages, tools = conversations()[cname]
        times: dict[str, list[float]] = {"ours": [], "transformers": []}
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(args.renders // 5):
                compiled[tname].render(messages, tools=tools)
            times["ours"].append(time.perf_counter() - start)
            start = time.perf_counter()
            for _ in range(args.renders // 5):
                theirs(templates[tname], messages, tools, True)
            times["transformers"].append(time.perf_counter() - start)
        a, b = (statistics.median(t) / (args.renders // 5) * 1e6 for t in times.values())
        print(f"{tname + ', ' + cname:<34} {a:9.1f} {b:16.1f} {b / a:6.2f}x")

    start = time.perf_counter()
    try:
        ChatTemplate(UNBOUNDED).render([{"role": "user", "content": "x" * 100}], max_chars=1 << 20)
        outcome = "rendered"
    except InvalidRequestError as exc:
        outcome = f"refused ({exc})"
    print(f"unbounded, ours: {outcome} in {time.perf_counter() - start:.3f} s")
    child = (
        "import resource, json, sys; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)); "
        "from transformers.utils.chat_template_utils import render_jinja_template as r; "
        "t = r([[{'role': 'user', 'content': 'x' * 100}]], chat_template=json.loads(sys.argv[1]))[0][0]; "
        "print(len(t))"
    )
    start = time.perf_counter()
    try:
        run = subprocess.run(
            [sys.executable, "-c", child, json.dumps(UNBOUNDED)],
            check=False,
            capture_output=True,
            text=True,
            timeout=10,
        )
        last = (run.stdout.strip() or run.stderr.strip().splitlines()[-1])[:120]
        outcome = f"exit {run.returncode}: {last}"
    except subprocess.TimeoutExpired:
        outcome = "still rendering after 10 s (killed)"
    print(f"unbounded, transformers: {outcome} in {time.perf_counter() - start:.3f} s")


if __name__ == "__main__":
    main()
