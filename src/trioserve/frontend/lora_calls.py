"""``Engine``'s LoRA adapter calls: ``add_lora``, ``remove_lora``,
``pin_lora``, ``list_loras`` (``trioserve.lora``; the engine core's side is
``nurseries/engine_core/control.py``, the worker's ``gpu/lora.py``).

A request runs with an adapter by naming it (``SamplingParams.lora``). An
adapter is added on every engine core at once, and loaded again by every
later life of an engine core (a restart) until it is removed. The
front-end keeps the names it knows (those it started with and those added
or listed since) so that the OpenAI server can tell an adapter's name
from an unknown model without asking the engines each time.
"""

from __future__ import annotations

import os

from trioserve.errors import InvalidRequestError
from trioserve.frontend.engines.group import EngineGroup
from trioserve.lora import check_lora_name, parse_lora_module
from trioserve.rpc import AddLora, ControlCall, ControlReply, ListLoras, LoraInfo, PinLora, RemoveLora


class LoraCalls:
    """``Engine``'s adapter calls (``Engine`` supplies ``_control``, its group and config)."""

    _group: EngineGroup
    _lora_names: set[str]

    async def _control(
        self, call: ControlCall, timeout_s: float | None, on_workers: bool = False
    ) -> list[ControlReply]:
        raise NotImplementedError

    def _init_loras(self) -> None:
        self._lora_names = {parse_lora_module(spec)[0] for spec in self._group.config.lora_modules}

    @property
    def lora_names(self) -> frozenset[str]:
        """The adapters this front-end knows the engines serve."""
        return frozenset(self._lora_names)

    def _check(self, name: object) -> str:
        if not self._group.config.enable_lora:
            raise InvalidRequestError("lora", "this engine was started without LoRA adapters (--enable-lora)")
        try:
            return check_lora_name(name)
        except ValueError as exc:
            raise InvalidRequestError("lora_name", str(exc)) from None

    async def add_lora(self, name: str, path: str | os.PathLike[str], *, timeout_s: float | None = None) -> LoraInfo:
        """Load the adapter in directory ``path`` (on the engines' hosts) as
        ``name`` on every engine core; its ``LoraInfo``. A bad adapter raises
        ``ControlCallError`` naming the file and the problem, and nothing
        else changes; so does a name already served."""
        name = self._check(name)
        if not isinstance(path, str | os.PathLike):
            raise InvalidRequestError("lora_path", f"must be a directory path (got {type(path).__name__})")
        call = AddLora(name=name, path=os.fspath(path))
        replies = await self._control(call, timeout_s, on_workers=True)
        for supervisor in self._group.supervisors:
            supervisor.loras[name] = call
        self._lora_names.add(name)
        infos = [r for reply in replies for r in reply.results if isinstance(r, LoraInfo)]
        return infos[0] if infos else LoraInfo(name=name, path=call.path, rank=0)

    async def remove_lora(self, name: str, *, timeout_s: float | None = None) -> None:
        """Stop serving adapter ``name``: requests naming it from now on
        fail; returns once those running with it have finished (within
        ``timeout_s``, default ``config.control_timeout_s``: past it,
        ``ControlCallError``, and the adapter is removed once they end)."""
        name = self._check(name)
        self._lora_names.discard(name)
        for supervisor in self._group.supervisors:
            supervisor.loras.pop(name, None)
        await self._control(RemoveLora(name=name), timeout_s, on_workers=True)

    async def pin_lora(self, name: str, *, timeout_s: float | None = None) -> None:
        """Keep adapter ``name`` in the workers' memory whatever ``max_cpu_loras`` says."""
        await self._control(PinLora(name=self._check(name)), timeout_s, on_workers=True)

    async def list_loras(self) -> list[LoraInfo]:
        """The adapters the engines serve (the first engine core's word)."""
        if not self._group.config.enable_lora:
            return []
        replies = await self._control(ListLoras(), None)
        infos = [r for r in replies[0].results if isinstance(r, LoraInfo)] if replies else []
        self._lora_names = {info.name for info in infos}
        return infos
