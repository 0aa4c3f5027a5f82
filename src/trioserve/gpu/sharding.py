"""Tensor parallelism: the ranks' process group, and the model loaded as this rank's shard.

The sharding itself is transformers' (``from_pretrained(...,
distributed_config=DistributedConfig(tp_size=N))``): it applies the model's
own tensor-parallel plan (``base_model_tp_plan`` in its config, plus the
model class's plan for the embeddings and the LM head). For Llama, Qwen2
and Qwen3 that plan makes ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``
and ``up_proj`` column-parallel (each rank computes its share of the heads
and MLP columns), ``o_proj`` and ``down_proj`` row-parallel (each rank's
partial product, then one all-reduce), the embedding vocabulary-parallel
(an all-reduce) and the LM head column-parallel with its output gathered,
so every rank gets the whole logits and samples the same token. Each rank's
attention layers see only its own heads, so our paged attention function
works unchanged, over a KV cache that holds this rank's KV heads.

Checked on the CPU with gloo in transformers 5.23 (docs/architecture.md):
the sharded model's logits match the whole model's within 5e-6.

The process group meets through a file in the engine core's private 0700
directory (``file://`` rendezvous: no port at all for that), and its
collectives (gloo's TCP pairs, NCCL's bootstrap) are bound to the loopback
interface: nothing listens beyond this machine.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from trioserve.gpu.tensor_shards import local_tensor

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger("trioserve.gpu.sharding")


class NotShardableError(ValueError):
    """The model cannot be split across this many ranks; the message names
    its architecture and why."""


def loopback_interface() -> str:
    """The name of the loopback network interface (``lo`` on Linux)."""
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    return "lo"


def kv_heads_per_rank(plan: dict[str, str], num_kv_heads: int, world_size: int) -> int | None:
    """How many KV heads each rank holds under ``plan`` (all of them when the
    keys are not split), or None when they do not divide evenly."""
    from transformers.distributed.tensor_parallel import get_kv_heads_per_rank

    heads = get_kv_heads_per_rank(plan, num_kv_heads, world_size)
    return heads if isinstance(heads, int) else None


def check_shardable(model_dir: str, world_size: int) -> None:
    """Raise ``NotShardableError`` naming the architecture when the model in
    ``model_dir`` has no tensor-parallel plan, or heads that do not split
    into ``world_size`` equal shares. Reads only the config: every rank
    fails the same way, before any collective."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    text = config.get_text_config()
    arch = ", ".join(getattr(config, "architectures", None) or [config.model_type])
    plan = getattr(text, "base_model_tp_plan", None)
    if not plan:
        raise NotShardableError(
            f"tensor_parallel_size={world_size}: {arch} (model type {config.model_type!r}) cannot be sharded: "
            "transformers has no tensor-parallel plan for it (base_model_tp_plan). Use tensor_parallel_size=1, "
            "or a model that has one (Llama, Qwen2, Qwen3, Mistral, Gemma, ...; see the README)"
        )
    num_heads = text.num_attention_heads
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    if num_heads % world_size or kv_heads_per_rank(plan, num_kv_heads, world_size) is None:
        raise NotShardableError(
            f"tensor_parallel_size={world_size}: {arch} has {num_heads} attention heads and {num_kv_heads} KV "
            f"heads, which do not split into {world_size} equal shares"
        )


def init_process_group(rank: int, world_size: int, init_file: str, device: torch.device, timeout_s: float) -> None:
    """Join this engine core's process group: gloo on the CPU, NCCL on CUDA.

    Blocks until every rank has joined (at most ``timeout_s``, which also
    bounds each collective later). Sets the variables transformers reads
    (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``)."""
    import torch.distributed as dist

    loopback = loopback_interface()
    os.environ["GLOO_SOCKET_IFNAME"] = loopback
    os.environ["NCCL_SOCKET_IFNAME"] = loopback
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    cuda = device.type == "cuda"
    dist.init_process_group(
        backend=process_group_backend(device),
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if cuda else None,
    )


def process_group_backend(device: torch.device) -> str:
    """The collectives' backend of a tensor-parallel group on ``device``: NCCL
    among CUDA devices (each rank on its own, ``gpu/device.py``), gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


MISSING_NAMED = 5  # missing weights named in the error (then a count of the rest)


def load_model(
    model_dir: str, world_size: int, *, base: bool = False, w8a8: bool = False, **kwargs: Any
) -> PreTrainedModel:
    """``from_pretrained``: the whole model, or with ``world_size`` > 1 (in a
    process group) this rank's shard of it; with ``base``, the model without
    its language-model head (``AutoModel``: an embedding model's hidden
    states; an encoder's pooling head, unused, is dropped, and may be absent
    from the checkpoint). Raises ``ValueError`` naming the weights the model needs that
    the checkpoint lacks (transformers would fill them with random values
    and only log it); weights the model does not use are logged. With
    ``w8a8``, a compressed-tensors int8 checkpoint loaded as a float one
    (``gpu/w8a8.py``: ``kwargs`` hold its config without its
    ``quantization_config``; its int8 weights land in float tensors, exactly,
    and its scales, not used here, are left for ``load_w8a8``)."""
    from transformers import AutoModel, AutoModelForCausalLM

    if world_size > 1:
        from transformers.distributed.configuration_utils import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(tp_size=world_size)
    auto: Any = AutoModel if base else AutoModelForCausalLM
    loaded: Any = auto.from_pretrained(model_dir, output_loading_info=True, **kwargs)
    model: PreTrainedModel = loaded[0]
    loading: dict[str, Any] = loaded[1]
    missing = sorted(loading.get("missing_keys") or ())
    if base and isinstance(getattr(model, "pooler", None), torch.nn.Module):
        model.pooler = None  # type: ignore[assignment]  # an encoder's pooling head: embeddings pool its hidden states, not through it
        missing = [key for key in missing if not key.startswith("pooler.")]
    if missing:
        named = ", ".join(missing[:MISSING_NAMED]) + (
            f" and {len(missing) - MISSING_NAMED} more" if len(missing) > MISSING_NAMED else ""
        )
        raise ValueError(
            f"{model_dir}: the checkpoint lacks {len(missing)} weights that {type(model).__name__} needs "
            f"({named}): its config.json and its weights do not agree"
        )
    unexpected = sorted(key for key in loading.get("unexpected_keys") or () if not (w8a8 and key.endswith("_scale")))
    if unexpected:
        log.warning(
            "%s: %d weights in the checkpoint are not used (%s, ...)", model_dir, len(unexpected), unexpected[0]
        )
    return model


def local_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """Elements and bytes of this rank's own weights."""
    from trioserve.gpu.cpu_kernels.linear import packed_parameters

    tensors = [local_tensor(p) for p in model.parameters()]
    packed_numel, packed_bytes = packed_parameters(model)
    return (
        sum(t.numel() for t in tensors) + packed_numel,
        sum(t.numel() * t.element_size() for t in tensors) + packed_bytes,
    )


def eos_token_ids(model: PreTrainedModel) -> list[int]:
    """EOS ids from the generation config, then the model config (int or list)."""
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), model.config.get_text_config()):
        value = getattr(source, "eos_token_id", None)
        for token in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return ids
