"""Every linear layer of a model, once each in order (so that each weight is
read cold from memory, as in a model step), through our float32 GEMM on
panels, oneDNN's packed weights, ``F.linear`` and (at float32) our int8
layers (``--quantization int8``: int8 weights, activations quantized per
row in the call; on AVX2 with 7-bit weights, and with 8-bit ones beside),
alternated pass by pass in one process::

    PYTHONPATH=src python scripts/bench_gemm.py --model bench-llama-40m --torch-threads 2 --rows 1,8,32,128,512
        [--dtype bfloat16]

Shapes from the model's config (q, k, v, o, gate, up, down per layer, then
the LM head; random weights). oneDNN is left out where it cannot pack the
dtype (bfloat16 without native support). Prints, per row count, each path's
median time per pass and its GFLOP/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from trioserve.bench.models import resolve_model
from trioserve.gpu.cpu_kernels.int8 import Int8Linear, int8_build, weight_top
from trioserve.gpu.cpu_kernels.linear import PackedLinear, PanelLinear, onednn_packs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bench-llama-40m")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--rows", default="1,8,32,128,512")
    p.add_argument("--passes", type=int, default=10)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.torch_threads)
    config = json.loads((resolve_model(args.model) / "config.json").read_text())
    hidden, mlp, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    per_layer = [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden), (hidden, mlp), (hidden, mlp), (mlp, hidden)]
    shapes = per_layer * layers + [(hidden, config["vocab_size"])]
    linears = [torch.nn.Linear(i, o, bias=False).to(dtype).requires_grad_(False) for i, o in shapes]
    paths: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {
        "our GEMM": [PanelLinear(linear) for linear in linears],
        "F.linear": [(lambda x, w=linear.weight: F.linear(x, w)) for linear in linears],
    }
    if onednn_packs(dtype):
        paths["oneDNN packed"] = [PackedLinear(linear) for linear in linears]
    if dtype == torch.float32:
        paths[f"int8 ({int8_build()})"] = [Int8Linear(lin.weight, None) for lin in linears]
        if weight_top() != 127:  # AVX2: 7-bit weights by default; 8-bit ones (a W8A8 checkpoint's) too
            paths["int8, 8-bit weights"] = [Int8Linear(lin.weight, None, top=127) for lin in linears]
    flops_per_row = sum(2 * i * o for i, o in shapes)
    size = sum(i * o for i, o in shapes) * linears[0].weight.element_size() / 2**20
    print(f"{args.model}: {len(shapes)} linears, {size:.0f} MiB of {args.dtype} weights")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {n: torch.randn(rows, n).to(dtype) for n in {i for i, _ in shapes}}
        times: dict[str, list[float]] = {name: [] for name in paths}
        with torch.inference_mode():
            for _ in range(args.passes):
                for name, mods in paths.items():
                    started = time.perf_counter()
                    for (n_in, _), mod in zip(shapes, mods, strict=True):
                        mod(xs[n_in])
                    times[name].append(time.perf_counter() - started)
        medians = {name: statistics.median(ts) for name, ts in times.items()}
        line = "  ".join(
            f"{name}: {t * 1e3:.1f} ms ({flops_per_row * rows / t / 1e9:.0f} GFLOP/s)" for name, t in medians.items()
        )
        print(f"{rows} rows  {line}", flush=True)


if __name__ == "__main__":
    main()
