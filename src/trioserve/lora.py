"""LoRA adapters: their names, how a server is told of them, and what their
``adapter_config.json`` (PEFT's format) may say. No torch here: the
worker reads the weights (``gpu/lora.py``); the engine core and the
front-end only name adapters (``core/lora.py``).

An adapter is a directory as PEFT saves one: ``adapter_config.json`` and
``adapter_model.safetensors`` (never ``adapter_model.bin``, a pickle). Each
targeted linear layer ``W`` gains ``x @ A.T @ B.T * scale``, with ``A``
``[r, in]``, ``B`` ``[out, r]`` and ``scale`` ``lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``); ``rank_pattern`` and
``alpha_pattern`` override ``r`` and ``lora_alpha`` for the layers whose
names match, as PEFT reads them.

What is refused, with ``AdapterError`` naming the file and the problem: a
missing or oversized file, a ``peft_type`` other than LORA, DoRA, trained
biases, ``modules_to_save`` (whole copies of layers), ``fan_in_fan_out``
(GPT-2's transposed layers), targets that are parameters rather than
layers, and a rank above the server's ``max_lora_rank``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_WEIGHTS_FILE = "adapter_model.bin"
MAX_CONFIG_BYTES = 1 << 20
MAX_NAME_CHARS = 256
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")


class AdapterError(ValueError):
    """An adapter that cannot be served: the message names its file and the problem."""


def check_lora_name(name: object) -> str:
    """``name`` as an adapter's name (letters, digits and ``._:/@+-``, at
    most ``MAX_NAME_CHARS``), else ``ValueError`` saying so."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS or not _NAME.fullmatch(name):
        raise ValueError(
            f"an adapter's name is 1 to {MAX_NAME_CHARS} letters, digits and ._:/@+- "
            f"starting with a letter or digit (got {name!r:.60})"
        )
    return name


def parse_lora_module(spec: str) -> tuple[str, str]:
    """``(name, path)`` of a ``--lora-modules`` entry: ``NAME=PATH``, or
    vLLM's JSON form ``{"name": ..., "path": ...}``."""
    if spec.lstrip().startswith("{"):
        try:
            given = json.loads(spec)
        except ValueError as exc:
            raise ValueError(f"lora_modules: {spec!r:.80} is not JSON: {exc}") from None
        if not isinstance(given, dict) or not isinstance(given.get("path"), str):
            raise ValueError(f'lora_modules: {spec!r:.80} must be {{"name": ..., "path": ...}}')
        name, path = given.get("name"), given["path"]
    else:
        name, sep, path = spec.partition("=")
        if not sep or not path:
            raise ValueError(f"lora_modules: {spec!r:.80} must be NAME=PATH")
    try:
        return check_lora_name(name), path
    except ValueError as exc:
        raise ValueError(f"lora_modules: {exc}") from None


@dataclass(frozen=True)
class AdapterConfig:
    """What an adapter's ``adapter_config.json`` says, checked."""

    path: Path
    r: int
    lora_alpha: float
    use_rslora: bool = False
    target_modules: tuple[str, ...] | str = ()  # names (the last parts of layer names), or one regex
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    def rank_of(self, module: str) -> int:
        return int(_pattern_value(self.rank_pattern, module, self.r))

    def scale_of(self, module: str, r: int) -> float:
        """The factor of layer ``module``'s product, whose ``A`` has ``r`` rows."""
        alpha = _pattern_value(self.alpha_pattern, module, self.lora_alpha)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def targets(self, module: str) -> bool:
        """Whether the config names the layer ``module`` (a full dotted name) as a target."""
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, module) is not None
        return any(module == t or module.endswith(f".{t}") for t in self.target_modules)


def _pattern_value(pattern: dict[str, Any], module: str, default: float) -> float:
    """PEFT's reading of ``rank_pattern``/``alpha_pattern``: the first key that matches the end of the name."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return float(value)
    return default


def read_adapter_config(directory: str | Path, max_lora_rank: int) -> AdapterConfig:
    """The checked config of the adapter in ``directory`` (see the module's
    docstring); ``AdapterError`` naming the file and the problem."""
    path = Path(directory)
    config_file = path / CONFIG_FILE
    if not path.is_dir():
        raise AdapterError(f"{path}: not a directory (an adapter is a directory as PEFT saves one)")
    if not config_file.is_file():
        raise AdapterError(f"{config_file}: missing (an adapter's directory holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    if not (path / WEIGHTS_FILE).is_file():
        pickled = (path / PICKLED_WEIGHTS_FILE).is_file()
        why = f"only {PICKLED_WEIGHTS_FILE}, a pickle, which trioserve never loads" if pickled else "missing"
        raise AdapterError(f"{path / WEIGHTS_FILE}: {why}")
    if config_file.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterError(f"{config_file}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        raw = json.loads(config_file.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{config_file}: not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{config_file}: must be a JSON object")

    def bad(key: str, why: str) -> AdapterError:
        return AdapterError(f"{config_file}: {key}: {why} (got {raw.get(key)!r:.60})")

    if raw.get("peft_type", "LORA") != "LORA":
        raise bad("peft_type", "only LORA adapters are served")
    for key, what in (("use_dora", "DoRA"), ("fan_in_fan_out", "transposed (Conv1D) layers")):
        if raw.get(key):
            raise bad(key, f"{what} not supported")
    if raw.get("bias", "none") != "none":
        raise bad("bias", "trained biases are not supported ('none' only)")
    if raw.get("modules_to_save"):
        raise bad("modules_to_save", "whole copies of layers are not supported")
    if raw.get("target_parameters"):
        raise bad("target_parameters", "adapters on parameters (not layers) are not supported")
    r, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise bad("r", "must be a positive integer")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise bad("lora_alpha", "must be a finite number")
    targets = raw.get("target_modules")
    if isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets):
        target_modules: tuple[str, ...] | str = tuple(targets)
    elif isinstance(targets, str) and targets:
        try:
            re.compile(targets)
        except re.error as exc:
            raise bad("target_modules", f"not a regular expression ({exc})") from None
        target_modules = targets
    else:
        raise bad("target_modules", "must be a list of layer names or a regular expression")
    patterns: dict[str, dict[str, Any]] = {}
    for key in ("rank_pattern", "alpha_pattern"):
        given = raw.get(key) or {}
        ok = isinstance(given, dict) and all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0
            for v in given.values()
        )
        if not ok:
            raise bad(key, "must map layer names to positive numbers")
        patterns[key] = given
    config = AdapterConfig(
        path=path,
        r=r,
        lora_alpha=float(alpha),
        use_rslora=bool(raw.get("use_rslora", False)),
        target_modules=target_modules,
        rank_pattern={k: int(v) for k, v in patterns["rank_pattern"].items()},
        alpha_pattern={k: float(v) for k, v in patterns["alpha_pattern"].items()},
    )
    highest = max([config.r, *config.rank_pattern.values()])
    if highest > max_lora_rank:
        raise AdapterError(
            f"{config_file}: rank {highest} is over this server's limit of {max_lora_rank} (--max-lora-rank)"
        )
    return config
