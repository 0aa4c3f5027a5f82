"""Chat templates (rendered as transformers renders them, without it), ``n``
samples of one prompt (``Engine.stream_n``), and logprobs through the
OpenAI API on a real (tiny) model."""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys
import time

import openai
import psutil
import pytest
import trio
from helpers.server import raw_request, serving, wait_blocks_free
from helpers.serving import spawned
from helpers.waiting import in_thread, wait_until

import trioserve
from trioserve import EngineConfig, InvalidRequestError, SamplingParams
from trioserve.frontend.requests.parallel_sampling import child_params
from trioserve.frontend.text.chat_template import ChatTemplate, TemplatedText

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France? Ünïcode ✓"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def transformers_render(model_dir, messages, add_generation_prompt=True) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_tiny_models_template_renders_as_transformers_renders_it(tiny_model_dir, add_generation_prompt):
    template = ChatTemplate.from_dir(tiny_model_dir("llama"))
    assert template is not None
    ours = template.render(MESSAGES, add_generation_prompt=add_generation_prompt)
    assert isinstance(ours, TemplatedText)
    assert ours == transformers_render(tiny_model_dir("llama"), MESSAGES, add_generation_prompt)


def test_a_template_in_tokenizer_config_renders_as_transformers_renders_it(tiny_model_dir, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model)
    (model / "chat_template.jinja").unlink()
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = SMOLLM2_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    template = ChatTemplate.from_dir(model)
    assert template is not None
    for messages in (MESSAGES, MESSAGES[1:]):
        assert template.render(messages) == transformers_render(model, messages)


def test_a_template_runs_sandboxed_and_its_refusals_name_messages():
    with pytest.raises(InvalidRequestError, match=r"^messages: .*refused them: no assistant first"):
        ChatTemplate(
            "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('no assistant first') }}{% endif %}"
        ).render([{"role": "assistant", "content": "hi"}])
    with pytest.raises(InvalidRequestError, match=r"^messages: "):  # the sandbox refuses to reach Python internals
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(InvalidRequestError, match=r"^messages: "):  # and to mutate its inputs
        ChatTemplate("{{ messages.append(1) }}").render([{"role": "user", "content": "x"}])


USER = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    "source",
    ["{{ 1 / 0 }}", "{{ range(10**9) | list }}", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
     "{{ messages[0].content + 1 }}", "{{ 'x' * 300000000 }}", "{{ [0] * 10**9 }}", "{{ 2 ** (10**9) }}"],
)  # fmt: skip
def test_whatever_a_template_raises_or_builds_too_large_is_a_failure_naming_messages(source):
    """Found: a template that raised anything but a few jinja errors
    (ZeroDivisionError, OverflowError, RecursionError) got no HTTP response,
    and ended ``trioserve chat`` with a traceback; ``'x' * 300000000`` built
    its 300 MB before anything looked at its size."""
    with pytest.raises(InvalidRequestError, match=r"^messages: the model's chat template failed on them: \S"):
        ChatTemplate(source).render(USER)


def test_a_template_is_stopped_at_its_deadline_and_its_thread_runs_on_unharmed():
    slow = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x")
    started = time.monotonic()
    with pytest.raises(InvalidRequestError, match=r"^messages: the model's chat template took longer than 0.2 s"):
        slow.render(USER, timeout_s=0.2)
    assert time.monotonic() - started < 2
    # Nothing is left pending for this thread: Python code run on past a finished rendering's
    # deadline is not interrupted (a timer left armed would raise its timeout in it).
    assert ChatTemplate("{{ messages[0].content }}").render(USER, timeout_s=0.05) == "x"
    interrupted: list[BaseException] = []
    past_deadline = time.monotonic() + 0.2
    try:
        while time.monotonic() < past_deadline:  # Python instructions all along: where such an exception lands
            pass
    except Exception as exc:  # whatever arrived, to name it
        interrupted.append(exc)
    assert interrupted == [], f"{interrupted[0]!r} reached the thread after its rendering had ended"


def test_renders_ending_as_their_deadlines_pass_leave_no_lock_taken_and_no_exception_behind():
    """Deadlines about as long as the renders, in several threads: each
    render either ends or times out, and nothing else happens (before the
    watchdog's rendering threads took no lock, one interrupted just after
    taking it left every later render, and the watchdog, waiting for ever)."""
    import concurrent.futures

    template = ChatTemplate("{% for i in range(3000) %}{{ messages[0].content }}{% endfor %}")

    def renders(timeout_s: float) -> tuple[int, int]:
        ended = timed_out = 0
        for _ in range(60):
            try:
                template.render(USER, timeout_s=timeout_s)
                ended += 1
            except InvalidRequestError as exc:
                assert "took longer than" in str(exc)
                timed_out += 1
        return ended, timed_out

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        counts = [f.result(timeout=60) for f in [pool.submit(renders, t) for t in (0.005, 0.01, 0.02, 0.04)]]
    assert all(ended + timed_out == 60 for ended, timed_out in counts)
    assert sum(timed_out for _, timed_out in counts) > 0  # the race was run


def test_renders_in_several_threads_each_stop_at_their_own_deadline_and_the_fast_ones_are_untouched():
    """One watchdog thread serves every render: a deadline armed after a later
    one, and earlier than it, still fires on time; renders that end in time
    are never interrupted."""
    import concurrent.futures

    slow = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x")
    fast = ChatTemplate("{{ messages[0].content }}")

    def timed(template: ChatTemplate, timeout_s: float) -> tuple[str, float]:
        started = time.monotonic()
        try:
            return template.render(USER, timeout_s=timeout_s), time.monotonic() - started
        except InvalidRequestError as exc:
            return str(exc), time.monotonic() - started

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        late = pool.submit(timed, slow, 1.5)
        time.sleep(0.1)  # armed after the late one, with an earlier deadline
        early = pool.submit(timed, slow, 0.3)
        # The fast renders' own deadline is long: two slow renders hold the GIL in turns, so
        # a render of microseconds may wait many switch intervals for it on a loaded machine.
        fasts = [pool.submit(lambda: [timed(fast, 1.0) for _ in range(200)]) for _ in range(2)]
        early_text, early_s = early.result(timeout=10)
        late_text, late_s = late.result(timeout=10)
        fast_texts = {text for f in fasts for text, _ in f.result(timeout=10)}
    assert "took longer than 0.3 s" in early_text and 0.3 <= early_s < 1.0  # not at the late one's 1.5 s
    assert "took longer than 1.5 s" in late_text and 1.5 <= late_s < 4.5
    assert fast_texts == {"x"}


def test_a_template_whose_text_outgrows_the_context_is_stopped_there_and_one_rendering_nothing_says_so():
    from trioserve.errors import PromptTooLongError

    endless = ChatTemplate("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}")
    with pytest.raises(PromptTooLongError, match=r"^messages: the model's chat template makes more than 5000 "):
        endless.render(USER, max_chars=5000)
    with pytest.raises(InvalidRequestError, match=r"^messages: the model's chat template renders nothing for them"):
        ChatTemplate("{% if false %}x{% endif %}").render(USER)


def test_generation_blocks_and_tojson_options_render_as_transformers_renders_them(tiny_model_dir, tmp_path):
    """Found: ``{% generation %}`` (chat templates for training) did not
    compile, so such a model was refused; ``tojson(separators=...)`` failed."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}"
        "{{ m.content }}{% endgeneration %}{% else %}{{ m | tojson(separators=(',', ':'), sort_keys=true) }}"
        "{% endif %}{% endfor %}{{ messages[0] | tojson(indent=2) }}"
    )
    template = ChatTemplate.from_dir(model)
    assert template is not None
    assert template.render(MESSAGES) == transformers_render(model, MESSAGES)


async def test_a_slow_template_holds_up_neither_the_server_nor_other_requests(fake_config, tmp_path, monkeypatch):
    """Found: templates were rendered on the event loop: one slow render held
    every connection (``/health`` included) until it ended."""
    import shutil

    from trioserve.frontend.text import chat_template

    monkeypatch.setattr(chat_template, "RENDER_TIMEOUT_S", 3.0)
    model = tmp_path / "model"
    shutil.copytree(fake_config().model, model)
    (model / "chat_template.jinja").write_text(
        "{% if messages[0].content == 'slow' %}{% for i in range(100000) %}{% for j in range(100000) %}"
        "{% endfor %}{% endfor %}{% endif %}{{ messages[0].content }}"
    )
    config = fake_config().replace(model=str(model))
    with trio.fail_after(60):
        async with serving(config, model_name="m") as server:

            def chat(content: str) -> tuple[int, dict]:
                body = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": content}]}
                status, _, reply = raw_request(server, "POST", "/v1/chat/completions", json.dumps(body).encode())
                return status, json.loads(reply)

            async def slow() -> None:
                status, reply = await in_thread(chat, "slow")
                assert status == 400 and reply["error"]["param"] == "messages", reply
                assert "took longer than 3 s" in reply["error"]["message"]

            async with trio.open_nursery() as nursery:
                # One slow render (a second would take the other of the engine's RENDER_THREADS, and
                # the fast request would rightly wait for a free one).
                nursery.start_soon(slow)
                engine = server.engine
                assert engine is not None
                await wait_until(lambda: engine._render_threads.borrowed_tokens == 1, 10, "the slow render under way")
                started = trio.current_time()
                assert (await in_thread(raw_request, server, "GET", "/health"))[0] == 200
                status, reply = await in_thread(chat, "fast")
                assert status == 200 and reply["choices"][0]["finish_reason"] == "length", reply
                assert trio.current_time() - started < 2.0  # well before the slow one's deadline
            await wait_blocks_free(server)


def test_a_child_gets_seed_plus_its_index_and_no_seed_stays_none():
    seeded = SamplingParams(seed=2**63 - 2, max_tokens=3)
    assert [child_params(seeded, i).seed for i in range(3)] == [2**63 - 2, 2**63 - 1, 0]
    assert child_params(seeded, 2).max_tokens == 3
    assert child_params(SamplingParams(), 5).seed is None


# --- stream_n on the fake runner ---------------------------------------------------------


async def test_n_samples_stream_together_and_leaving_early_aborts_every_one(fake_config):
    config = fake_config(num_kv_blocks=256, step_delay_s=0.005)
    with trio.fail_after(60):
        async with trioserve.open_engine(config=config) as engine:
            texts: dict[int, str] = {}
            async with engine.stream_n("Same prompt", SamplingParams(max_tokens=6), n=3) as stream:
                async for out in stream:
                    texts[out.index] = texts.get(out.index, "") + out.text
            alone = await engine.generate("Same prompt", SamplingParams(max_tokens=6))
            assert texts == {0: alone.text, 1: alone.text, 2: alone.text}  # the fake runner ignores seeds

            async with engine.stream_n("Long", SamplingParams(max_tokens=5000, ignore_eos=True), n=4) as stream:
                async for _ in stream:
                    stats = await engine.stats()
                    if stats.num_running == 4:
                        break
            assert engine.num_requests_in_flight() == 0
            for _ in range(250):  # at most 5 s
                stats = await engine.stats()
                if stats.num_free_blocks == stats.num_total_blocks:
                    break
                await trio.sleep(0.02)
            assert stats.num_free_blocks == stats.num_total_blocks
            with pytest.raises(InvalidRequestError, match=r"^n: "):
                engine.stream_n("x", n=0)


# --- logprobs on a real tiny model, through the API -------------------------------------


@pytest.mark.model
async def test_logprobs_come_back_through_the_api_for_completions_and_chat(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir("llama")), num_kv_blocks=64, block_size=16)
    with trio.fail_after(120):
        async with serving(config, model_name="tiny") as server:
            api = openai.OpenAI(base_url=server.http_url, api_key="x", max_retries=0, timeout=60)
            run = functools.partial(in_thread)
            completion = await run(
                api.completions.create, model="tiny", prompt="Hello", max_tokens=5, temperature=0, logprobs=3
            )
            chat = await run(
                api.chat.completions.create,
                model="tiny",
                messages=MESSAGES[:2],
                max_tokens=4,
                temperature=0,
                logprobs=True,
                top_logprobs=2,
            )
            streamed = await run(
                api.chat.completions.create,
                model="tiny",
                messages=MESSAGES[:2],
                max_tokens=4,
                temperature=0,
                logprobs=True,
                top_logprobs=2,
                stream=True,
            )
            chunks = await in_thread(list, streamed)
            await wait_blocks_free(server)
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == completion.choices[0].text
    # Keyed by token text, tokens that decode alike (byte pieces as U+FFFD) share one entry.
    assert all(p <= 0 and 1 <= len(top) <= 3 for p, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True))
    assert all(p >= max(top.values()) - 1e-6 for p, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True))
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert all(c.logprob == c.top_logprobs[0].logprob for c in content)
    streamed_content = [
        c for chunk in chunks for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content
    ]
    assert [c.token for c in streamed_content] == [c.token for c in content]


# --- trioserve chat ---------------------------------------------------------------------


async def test_chat_carries_on_when_the_engine_core_dies_during_a_reply(fake_config, monkeypatch):
    """Found: ``trioserve chat`` let the ``EngineDeadError`` of one reply end
    the whole session (exit 4, "the engine died and was not recovered") while
    the engine was restarting (restart 1 of 3). Each reply here takes two
    steps; the worker dies at its third, so the second reply dies and the
    third is answered by the restarted engine."""
    import io

    from trioserve import chat

    lines = iter(["one", "two", "three", None])

    async def read_line() -> str | None:
        await trio.lowlevel.checkpoint()
        return next(lines)

    monkeypatch.setattr(chat, "_read_line", read_line)
    out = io.StringIO()
    config = fake_config(die_at_step=3, restart_backoff_s=0.1, resume_requests=False)  # the reply ends
    with trio.fail_after(60):
        await chat.run_chat(config, SamplingParams(max_tokens=2, ignore_eos=True), out=out)
    replies = [line for line in out.getvalue().splitlines()[1:] if line]  # after the help line
    assert len(replies) == 3 and "died" in replies[1] and replies[1].startswith("["), replies
    assert "died" not in replies[2] and replies[2].strip(), replies


async def test_chat_refuses_a_model_without_a_chat_template_before_loading_it(tiny_model_dir, tmp_path):
    """Found: it loaded the model, then answered every line with the error."""
    import shutil

    from helpers.fakes import children, make_fake_config

    from trioserve import chat

    model = tmp_path / "plain"
    shutil.copytree(tiny_model_dir("llama"), model)
    (model / "chat_template.jinja").unlink()
    with trio.fail_after(10), pytest.raises(ValueError, match="has no chat template"):
        await chat.run_chat(make_fake_config(str(model)), SamplingParams(max_tokens=2))
    assert children() == []  # no engine was started


async def test_chat_whose_engine_is_out_of_restarts_exits_4_in_one_line(tiny_model_dir):
    """The engine's death leaves the chat's own nursery as an exception group:
    the command line takes it apart (it printed a group's traceback, exit 1)."""
    argv = [sys.executable, "-m", "trioserve.cli", "chat", "--model", str(tiny_model_dir("llama")),
            "--runner", "fake", "--fake-options", '{"die_at_step": 1}', "--max-restarts", "0"]  # fmt: skip
    with trio.fail_after(60):
        done = await trio.run_process(argv, stdin=b"hi\nthere\n", capture_stdout=True, capture_stderr=True, check=False)
    err = done.stderr.decode()
    assert done.returncode == 4 and "the engine died and was not recovered" in err and "Traceback" not in err, err


async def test_when_the_engine_dies_under_n_samples_each_counts_as_an_error_not_an_abort(fake_config):
    """Found: the first sample to see the ``EngineDeadError`` ended as
    ``error`` and the parent aborted the others, which the request observers
    (and so ``vllm:request_success_total``) counted as ``abort``: "the client
    left or cancelled" in docs/metrics.md, though the engine died under them."""
    config = fake_config(num_kv_blocks=256, step_delay_s=0.005, die_at_step=5)
    reasons: list[str] = []
    with trio.fail_after(60):
        async with trioserve.open_engine(config=config) as engine:
            engine.add_request_observer(lambda metrics: reasons.append(metrics.finish_reason))
            with pytest.raises(trioserve.EngineDeadError):
                async with engine.stream_n("Same prompt", SamplingParams(max_tokens=50, ignore_eos=True), n=3) as s:
                    async for _ in s:
                        pass
    assert reasons == ["error"] * 3


@pytest.mark.parametrize(
    ("command", "signum"),
    [("generate", signal.SIGTERM), ("chat", signal.SIGTERM), ("chat", signal.SIGHUP)],
    ids=["generate-SIGTERM", "chat-SIGTERM", "chat-SIGHUP"],
)
async def test_a_stop_signal_stops_generate_and_chat_with_their_engine_in_order_exit_128_plus_it(
    tiny_model_dir, command, signum
):
    """Found: SIGTERM killed the command at once; its engine core saw its
    parent die ("the parent is gone: stopping") and the exit was -15. So did
    SIGHUP (the terminal closed), exit -1. Now 143 and 129, in order."""
    argv = [sys.executable, "-m", "trioserve.cli", command, "--model", str(tiny_model_dir("llama")),
            "--runner", "fake", "--fake-options", '{"step_delay_s": 0.05}', "--max-tokens", "1000",
            "--ignore-eos", *(["hello"] if command == "generate" else [])]  # fmt: skip
    with trio.fail_after(60), spawned(argv, stdin=subprocess.PIPE) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        if command == "chat":
            proc.stdin.write("hello\n")
            proc.stdin.flush()
        await in_thread(proc.stdout.read, 1)  # the reply streams: the engine is up
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert tree
        proc.send_signal(signum)
        _, err = await in_thread(proc.communicate)
        assert proc.returncode == 128 + signum, err
        assert err.strip().splitlines()[-1] == f"trioserve: {signum.name}: stopped"
        assert "parent is gone" not in err and "Traceback" not in err
        _, alive = await in_thread(psutil.wait_procs, tree, 5)
        assert alive == []
