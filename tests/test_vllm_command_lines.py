"""``vllm serve`` command lines from vLLM's documentation run as
``trioserve serve`` command lines: the positional model, vLLM's flag names
and aliases; a Hugging Face id found in the local Hugging Face cache,
offline; vLLM's flags trioserve does not take, refused naming the flag."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import urllib.request
from pathlib import Path

import pytest
import trio
from helpers.serving import serve_argv, spawned, wait_for_url
from helpers.waiting import in_thread

from trioserve import default_model
from trioserve.cli import EXIT_STARTUP_FAILED, EXIT_USAGE, build_parser, main
from trioserve.cli.engine import command_engine_config
from trioserve.cli.server_options import server_config
from trioserve.nurseries.supervision.oneshot import Finished

TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}<s>assistant>"

# vLLM's documented command lines (its quickstart, serving and engine-arguments pages), MODEL for the model.
VLLM_COMMAND_LINES = [
    "vllm serve MODEL",
    "vllm serve MODEL -tp 1",
    "vllm serve MODEL --tensor-parallel-size 1 --data-parallel-size 1",
    "vllm serve MODEL --enable-prefix-caching",
    "vllm serve MODEL --no-enable-prefix-caching",
    "vllm serve MODEL --dtype half",
    "vllm serve MODEL --dtype float --max-model-len 256",
    "vllm serve MODEL --max-num-batched-tokens 512 --max-num-seqs 8",
    "vllm serve MODEL --seed 42",
    "vllm serve MODEL --served-model-name a b",
    "vllm serve MODEL --chat-template TEMPLATE_FILE",
    "vllm serve MODEL --enforce-eager --trust-remote-code --max-logprobs 5",
    "vllm serve MODEL --host 127.0.0.1 --port 8001 --api-key token-abc123",
    "vllm serve MODEL --tokenizer MODEL --revision main",
]


def parsed(line: str, model: Path, template: Path):
    argv = shlex.split(line.replace("MODEL", str(model)).replace("TEMPLATE_FILE", str(template)))
    assert argv[:2] == ["vllm", "serve"]
    args = build_parser().parse_args(["serve", *argv[2:]])
    return command_engine_config(args), server_config(args)


@pytest.mark.parametrize("line", VLLM_COMMAND_LINES)
def test_a_vllm_serve_command_line_is_a_trioserve_serve_command_line(line, tiny_model_dir, tmp_path):
    model = tiny_model_dir("llama")
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    engine, server = parsed(line, model, template)
    assert engine.model == str(model)
    expected = {
        "-tp 1": ("tensor_parallel_size", 1),
        "--enable-prefix-caching": ("enable_prefix_caching", True),
        "--no-enable-prefix-caching": ("enable_prefix_caching", False),
        "--dtype half": ("dtype", "float16"),
        "--dtype float": ("dtype", "float32"),
        "--max-num-batched-tokens 512": ("max_num_batched_tokens", 512),
        "--seed 42": ("seed", 42),
        "--chat-template": ("chat_template", TEMPLATE),
        "--enforce-eager": ("compile", False),
        "--max-logprobs 5": ("max_logprobs", 5),
        "--tokenizer": ("tokenizer", str(model)),
    }
    for flag, (field, value) in expected.items():
        if flag in line:
            assert getattr(engine, field) == value, flag
    if "--served-model-name" in line:
        assert (server.model_name, server.model_aliases) == ("a", ("b",))
    if "--api-key" in line:
        assert (server.api_key, server.port) == ("token-abc123", 8001)


@pytest.mark.parametrize(
    ("flag", "said"),
    [
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype is vLLM's flag"),
        (["-pp", "2"], "pipeline parallelism is not supported"),
        (["--speculative-config", "{}"], "speculative decoding"),
    ],
)
def test_a_vllm_flag_trioserve_does_not_take_is_named_in_one_line(flag, said, tiny_model_dir, capsys):
    model = str(tiny_model_dir("llama"))  # built before (its first build writes progress bars)
    capsys.readouterr()
    assert main(["serve", model, *flag]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err


def test_a_quantization_trioserve_does_not_run_is_refused_naming_the_one_it_does(tiny_model_dir, capsys):
    with pytest.raises(SystemExit) as exit:  # argparse's own usage error
        main(["serve", str(tiny_model_dir("llama")), "--quantization=awq"])
    assert exit.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert "invalid choice: 'awq'" in err and "int8" in err


def test_the_model_given_twice_differently_is_a_usage_error(tiny_model_dir, capsys):
    assert main(["serve", str(tiny_model_dir("llama")), "--model", "/elsewhere"]) == EXIT_USAGE
    assert "the model is given twice" in capsys.readouterr().err


def test_gpu_memory_utilization_on_the_cpu_is_refused_naming_the_cpu_option(tiny_model_dir, capsys):
    argv = ["serve", str(tiny_model_dir("llama")), "--device", "cpu", "--gpu-memory-utilization", "0.9"]
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "gpu_memory_utilization" in err and "--kv-cache-mib" in err


def hub_cache(root: Path, repo_id: str, model: Path, commit: str = "0123456789abcdef") -> Path:
    """A Hugging Face cache holding ``model`` as ``repo_id`` at ``main``, laid out as huggingface_hub lays it out."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(model, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


async def test_a_hub_id_in_the_local_cache_serves_offline_under_its_id(tiny_model_dir, tmp_path):
    snapshot = hub_cache(tmp_path / "hub", "tiny-org/tiny-llama", tiny_model_dir("llama"))
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    argv = serve_argv("tiny-org/tiny-llama", "--runner", "fake", "--served-model-name", "tiny", "alias")
    with trio.fail_after(60), spawned(argv, env) as proc:
        url = await in_thread(wait_for_url, proc, 30)
        base = url.replace("ws://", "http://")

        def complete(model: str) -> dict:
            body = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 3}).encode()
            request = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
            return json.loads(urllib.request.urlopen(request, timeout=20).read())

        answer = await in_thread(complete, "alias")  # any of the served names
        assert answer["model"] == "tiny" and answer["usage"]["completion_tokens"] == 3
        models = await in_thread(lambda: json.loads(urllib.request.urlopen(f"{base}/v1/models").read()))
        assert [m["id"] for m in models["data"]] == ["tiny", "alias"]
        proc.terminate()
        assert await in_thread(proc.wait, 30) == 0
    assert snapshot.is_dir()


def test_a_hub_id_not_in_the_cache_offline_is_a_startup_error_naming_it_and_the_cache(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert main(["serve", "no-org/no-model", "--runner", "fake"]) == EXIT_STARTUP_FAILED
    err = capsys.readouterr().err
    assert "'no-org/no-model' is not in the Hugging Face cache" in err and str(tmp_path / "hub") in err


def test_bench_takes_a_hub_id_from_the_local_cache_as_serve_does(tiny_model_dir, tmp_path, monkeypatch):
    import huggingface_hub.constants

    from trioserve.bench.models import resolve_model

    snapshot = hub_cache(tmp_path / "hub", "tiny-org/tiny-llama", tiny_model_dir("llama"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert resolve_model("tiny-org/tiny-llama") == snapshot
    with pytest.raises(ValueError, match=r"^model: 'no-org/no-model' is not in the Hugging Face cache"):
        resolve_model("no-org/no-model")
    with pytest.raises(ValueError, match=r"^model: 'missing\.gguf' is neither a directory, a \.gguf file"):
        resolve_model("missing.gguf")


def test_a_gguf_file_is_converted_once_into_the_cache_and_again_when_it_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("TRIOSERVE_CACHE_DIR", str(tmp_path / "cache"))
    builds: list[list[str]] = []

    def builder(module, args, **options):
        builds.append([module, *args[:-1]])
        out = Path(args[-1])
        out.mkdir()
        (out / "config.json").write_text("{}")
        return Finished(0)

    monkeypatch.setattr(default_model, "run_oneshot", builder)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF one")
    first = default_model.gguf_model_dir(gguf, announce=False)
    assert default_model.gguf_model_dir(gguf, announce=False) == first  # converted once
    assert builds == [["trioserve.gpu.gguf_convert", str(gguf.resolve())]]
    gguf.write_bytes(b"GGUF two, longer")
    second = default_model.gguf_model_dir(gguf, announce=False)
    assert second != first and len(builds) == 2 and default_model.is_complete(second)


@pytest.mark.parametrize("argv", [["serve", ""], ["serve", "--model", "  "], ["generate", "--model", "", "hi"]])
def test_an_empty_model_is_refused_by_name_not_taken_for_the_working_directory(argv, capsys):
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["trioserve: invalid input: MODEL: empty; give a model directory, a .gguf file or a Hugging Face id "
                   "(or none)"]  # fmt: skip
