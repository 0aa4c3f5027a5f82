"""The LoRA adapters an engine core serves (``trioserve.lora``): their
names, what the prefix cache keys their blocks by, and how many may run
in one step.

Each adapter served has a key, unique to its loading (``lora:{n}:{name}``),
that goes into the hash of every block its requests compute
(``core/block_hash.py``'s ``extra_key``): two requests with the same prompt
and different adapters (or the base model) never share KV blocks, and an
adapter removed and loaded again under its name never meets the blocks of
the first one.

Invariants: every running request's adapter is served; at most
``max_loras`` distinct adapters among the running requests (so in any step,
whose requests are running ones); an adapter being removed takes no new
request, and is dropped once no request names it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from trioserve.core.request import Request
from trioserve.rpc import LoraInfo


@dataclass
class Served:
    name: str
    path: str
    rank: int
    key: bytes
    pinned: bool = False
    removing: bool = False

    @property
    def info(self) -> LoraInfo:
        return LoraInfo(name=self.name, path=self.path, rank=self.rank, pinned=self.pinned)


class Adapters:
    """The adapters one engine core serves (see the module's docstring)."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.served: dict[str, Served] = {}
        self._loads = 0

    def add(self, name: str, path: str, rank: int) -> Served:
        """Serve a loaded adapter; ``ValueError`` if the name is taken."""
        self.check_new(name)
        self._loads += 1
        served = Served(name, path, rank, f"lora:{self._loads}:{name}".encode())
        self.served[name] = served
        return served

    def check_new(self, name: str) -> None:
        """``ValueError`` if adapter ``name`` may not be added now (its name is taken)."""
        if name in self.served:
            raise ValueError(f"lora_name: an adapter named {name!r} is served already (remove it first)")

    def key_of(self, name: str | None) -> bytes:
        """A new request's key: empty for the base model; ``ValueError``
        naming ``lora`` for an adapter not served (or being removed)."""
        if name is None:
            return b""
        served = self.served.get(name)
        if served is None or served.removing:
            names = ", ".join(repr(n) for n, s in self.served.items() if not s.removing) or "none"
            raise ValueError(f"lora: no adapter named {name!r} is served here (served: {names})")
        return served.key

    def get(self, name: str) -> Served:
        served = self.served.get(name)
        if served is None:
            raise ValueError(f"lora_name: no adapter named {name!r} is served here")
        return served

    def fits(self, req: Request, running: Iterable[Request]) -> bool:
        """Whether ``req`` may run beside ``running`` without more than
        ``max_loras`` distinct adapters among them."""
        if not req.lora_key:
            return True
        keys = {r.lora_key for r in running if r.lora_key}
        return req.lora_key in keys or len(keys) < self.max_loras

    def in_use(self, name: str, requests: Iterable[Request]) -> bool:
        served = self.served.get(name)
        return served is not None and any(r.lora_key == served.key for r in requests)

    def infos(self) -> list[LoraInfo]:
        return [s.info for s in self.served.values() if not s.removing]
