"""The engine options: one set, the same in every command that runs an
engine (``engine_options.py``), and the config they build."""

from __future__ import annotations

import argparse
import dataclasses
import os

import pytest

from trioserve.cli import build_parser
from trioserve.config import EngineConfig
from trioserve.engine_options import ENGINE_GROUPS, engine_config

ENGINE_COMMANDS = ("serve", "generate", "chat", "bench")


def subcommands() -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(actions) == 1
    return dict(actions[0].choices)


# serve's alone: vLLM's name for the engine's seed, which generate, chat and bench use for their own seeds.
SERVE_ONLY = {"--seed"}


def engine_option_set(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string in ``parser``'s engine groups (but ``SERVE_ONLY``)."""
    groups = [g for g in parser._action_groups if g.title in ENGINE_GROUPS]
    assert [g.title for g in groups] == list(ENGINE_GROUPS)
    options = {option for group in groups for action in group._group_actions for option in action.option_strings}
    return options - SERVE_ONLY


def differences(parsers: dict[str, argparse.ArgumentParser]) -> dict[str, set[str]]:
    """Each command's engine options that the first command lacks, and the first's that it lacks."""
    sets = {command: engine_option_set(parser) for command, parser in parsers.items()}
    first = next(iter(sets.values()))
    return {command: options ^ first for command, options in sets.items() if options != first}


def test_every_command_that_runs_an_engine_takes_the_same_engine_options():
    parsers = {command: subcommands()[command] for command in ENGINE_COMMANDS}
    assert {"--model", "--max-num-batched-tokens", "--max-model-len", "--engine-seed"} <= engine_option_set(
        parsers["serve"]
    )
    assert differences(parsers) == {}


def test_the_comparison_finds_an_engine_option_that_one_command_lacks():
    parsers = {command: subcommands()[command] for command in ENGINE_COMMANDS}
    engine = next(g for g in parsers["bench"]._action_groups if g.title == ENGINE_GROUPS[0])
    engine._group_actions = [a for a in engine._group_actions if "--max-model-len" not in a.option_strings]
    assert differences(parsers) == {"bench": {"--max-model-len"}}


@pytest.mark.parametrize("command", ["serve", "bench"])
def test_help_shows_every_engine_option(command):
    parser = subcommands()[command]
    shown = parser.format_help()
    hidden = {"--runner", "--fake-options"}  # the tests' own
    for option in engine_option_set(parser) - hidden:
        assert f"{option} " in shown or f"{option}," in shown or f"{option}\n" in shown, option


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_the_engine_options_defaults_are_the_configs_defaults(command):
    argv = {"generate": ["generate", "hi"]}.get(command, [command])
    args = build_parser().parse_args(argv)
    assert engine_config(args, "m") == EngineConfig(model="m")


def test_every_engine_option_reaches_its_field():
    argv = [
        "serve", "--device", "cuda", "--dtype", "float32", "--tokenizer", "t", "--chat-template", "{{ x }}",
        "--max-logprobs", "5", "--gpu-memory-utilization", "0.5", "--torch-threads", "3", "--kv-cache-mib", "7",
        "--num-kv-blocks", "9", "--block-size", "32", "--no-prefix-caching", "--max-num-seqs", "5",
        "--max-num-batched-tokens", "77", "--max-model-len", "99", "--max-waiting-requests", "11",
        "--max-request-entries", "1000", "--max-held-entries", "5000",
        "--max-steps-in-flight", "1", "--engine-seed", "13", "--compile", "--data-parallel-size", "2",
        "--tensor-parallel-size", "2", "--data-parallel-lockstep", "--runner", "fake",
        "--fake-options", '{"eos_every": 4}', "--max-restarts", "6", "--restart-window", "60",
        "--startup-timeout", "8", "--model-load-timeout", "40", "--step-timeout", "0", "--step-hang-min", "2",
        "--heartbeat-interval", "0.5", "--heartbeat-timeout", "3", "--task", "embed", "--pooling-type", "MEAN",
        "--no-normalize", "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "3",
        "--profiler-dir", "profiles", "--no-resume-requests", "--max-resumes", "5",
    ]  # fmt: skip
    config = engine_config(build_parser().parse_args(argv), "m")
    assert config.profiler_dir == os.path.abspath("profiles")  # every process writes there
    assert (config.task, config.pooling_type, config.normalize) == ("embed", "mean", False)
    assert (config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (2, 8, 3)
    lora = engine_config(build_parser().parse_args(["serve", "--enable-lora", "--lora-modules", "a=/x", "b=/y"]), "m")
    assert lora.enable_lora and lora.lora_modules == ("a=/x", "b=/y")
    changed = {f.name for f in dataclasses.fields(EngineConfig) if getattr(config, f.name) != f.default}
    unset = {f.name for f in dataclasses.fields(EngineConfig)} - changed
    # The hosts are serve's own options; the rest is set through the Python API only (engine_options.py says).
    assert unset == {
        "data_parallel_size_local", "data_parallel_address", "data_parallel_rpc_port", "curve_keys_dir",
        "insecure_tcp", "shutdown_grace_s", "step_hang_factor", "restart_backoff_s", "restart_backoff_max_s",
        "restart_wait_s", "control_timeout_s", "while_asleep", "enable_lora", "lora_modules",
        "data_parallel_backend", "ray_address",  # (not with lockstep: below)
        "quantization",  # (not with cuda, tensor parallelism or embeddings: below)
        "enforce_eager",  # (it also turns --compile off: below)
    }  # fmt: skip
    eager = engine_config(build_parser().parse_args(["serve", "--compile", "--enforce-eager"]), "m")
    assert eager.enforce_eager and not eager.compile
    assert engine_config(build_parser().parse_args(["serve", "-q", "int8"]), "m").quantization == "int8"
    ray = engine_config(
        build_parser().parse_args(["serve", "--data-parallel-backend", "ray", "--ray-address", "h:1"]), "m"
    )
    assert (ray.data_parallel_backend, ray.ray_address, ray.num_local_engines) == ("ray", "h:1", 0)
    assert config.step_timeout_s is None  # 0: no fixed limit
    assert (config.resume_requests, config.max_resumes) == (False, 5)
    assert config.kv_cache_memory_bytes == 7 * 2**20 and config.fake.eos_every == 4


def test_vllms_task_and_runner_names_choose_the_task():
    for argv, task in (
        (["--task", "embedding"], "embed"), (["--runner", "pooling"], "embed"), (["--runner", "generate"], "generate"),
        (["--task", "generate"], "generate"), ([], "auto"),
    ):  # fmt: skip
        config = engine_config(build_parser().parse_args(["serve", *argv]), "m")
        assert (config.task, config.runner) == (task, "hf"), argv
