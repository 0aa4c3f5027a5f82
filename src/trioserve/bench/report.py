"""A benchmark's result as a table, a JSON file and a plot.

The result is one plain dict (``build_result``): the run's figures, the
peak memory of each process, each baseline's figures, our throughput (and,
where a baseline measures it, our time to first token) as a ratio of each
baseline's, and the issues' targets checked against them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from trioserve.bench.flops import ModelShape, utilisation, workload_flops
from trioserve.bench.stats import RequestRecord
from trioserve.bench.workload import WorkloadSpec, build_requests
from trioserve.messages import EngineStats

MIB = 1024 * 1024
BASELINE_NAMES = {
    "model-only": "model-only bound (our runner, one process)",
    "generate-batch": "transformers generate_batch (continuous)",
    "generate": "transformers generate() (static batches)",
    "no-prefix-caching": "our engine, prefix caching off",
    "vllm": "vLLM offline engine (same limits)",
}


def engine_figures(stats: EngineStats) -> dict[str, Any]:
    """The in-process engine's counters after the run (warm-up included)."""
    return {
        "prefix_caching": stats.prefix_caching,
        "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "prefix_cache_queries": stats.prefix_cache_queries,
        "num_scheduled_tokens": stats.num_scheduled_tokens,
        "num_preemptions": stats.num_preemptions,
    }


def engine_baseline(kind: str, run: dict[str, Any]) -> dict[str, Any]:
    """Another run of our engine (``summarize``'s figures) as a baseline."""
    return {
        "kind": kind,
        "seconds": run["duration_s"],
        "output_tokens": run["output_tokens"],
        "output_tokens_per_s": run["output_tokens_per_s"],
        "requests_per_s": run["requests_per_s"],
        "ttft_p50_s": run["ttft_s"]["p50"],
        "ttft_p99_s": run["ttft_s"]["p99"],
        "itl_p50_s": run["itl_s"]["p50"],
        "itl_p99_s": run["itl_s"]["p99"],
    }


def build_result(
    run: dict[str, Any],
    memory: dict[str, int],
    baselines: dict[str, dict[str, Any]],
    meta: dict[str, Any],
    in_run: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``in_run``: the worker's own step figures of this run (``bench.steps.in_run_figures``)."""
    ours = run["output_tokens_per_s"]
    ratios = {kind: ours / b["output_tokens_per_s"] for kind, b in baselines.items() if b.get("output_tokens_per_s")}
    ttft = run["ttft_s"]["p50"]
    ttft_ratios = {kind: ttft / b["ttft_p50_s"] for kind, b in baselines.items() if b.get("ttft_p50_s")}
    return {
        **meta,
        "results": run,
        "peak_rss_bytes": memory,
        "model_steps_in_run": in_run,
        "baselines": baselines,
        "throughput_ratio": ratios,
        "ttft_p50_ratio": ttft_ratios,
        "targets": check_targets(run, baselines, ratios, in_run) | prefix_targets(run, ratios, ttft_ratios),
    }


def flops_figures(
    model_dir: Path, spec: WorkloadSpec, peak: dict[str, Any], run: dict[str, Any], baselines: dict[str, Any]
) -> dict[str, Any]:
    """The workload's model FLOPs (``bench.flops``) and each system's model FLOP
    utilisation: those FLOPs over its run time, as a fraction of ``peak``
    (the ``peak-gemm`` kind: this machine's best GEMM rate, same dtype and threads).

    A system that served prompt tokens from a prefix cache did not compute
    the workload's FLOPs (and which ones it skipped depends on each request's
    hit), so it gets no utilisation, only the count of its cached tokens
    (``not_computed``); nor does one that does not say (vLLM's older results)."""
    shape = ModelShape.from_config(json.loads((Path(model_dir) / "config.json").read_text()))
    flops = workload_flops(shape, [(len(r.prompt_token_ids), r.max_tokens) for r in build_requests(spec)])
    figures: dict[str, Any] = {"workload_flops": flops, "peak_gemm": peak, "utilisation": {}, "not_computed": {}}
    rate = peak.get("flops_per_s")
    if not rate:
        return figures
    systems = {"ours": (run.get("duration_s"), run.get("engine", {}).get("prefix_cache_hits", 0))}
    for kind, b in baselines.items():
        systems[kind] = (b.get("seconds"), b.get("cached_prompt_tokens", 0))
    for system, (seconds, cached) in systems.items():
        if not seconds:
            continue
        if cached is None or cached > 0:
            figures["not_computed"][system] = cached
        else:
            figures["utilisation"][system] = utilisation(flops, seconds, rate)
    return figures


def prefix_targets(run: dict[str, Any], ratios: dict[str, float], ttft_ratios: dict[str, float]) -> dict[str, Any]:
    """Issue 15's targets: with prefix caching, TTFT p50 at least 3x lower
    than without; and throughput no lower than vLLM's."""
    targets: dict[str, dict[str, Any]] = {}
    if "no-prefix-caching" in ttft_ratios and ttft_ratios["no-prefix-caching"] > 0:
        targets["TTFT p50 >= 3x lower than without caching"] = _target(1 / ttft_ratios["no-prefix-caching"], ">=", 3.0)
    if "vllm" in ratios:
        targets["tokens/s >= 1.0x vLLM"] = _target(ratios["vllm"], ">=", 1.0)
        targets["tokens/s >= 1.2x vLLM (issue 13)"] = _target(ratios["vllm"], ">=", 1.2)
    return targets


def flops_targets(figures: dict[str, Any]) -> dict[str, Any]:
    """Issue 13's: model FLOP utilisation at least 70% of the measured peak GEMM rate."""
    ours = figures.get("utilisation", {}).get("ours")
    return {} if ours is None else {"model FLOP utilisation >= 0.7 (issue 13)": _target(ours, ">=", 0.7)}


def check_targets(
    run: dict[str, Any],
    baselines: dict[str, dict[str, Any]],
    ratios: dict[str, float],
    in_run: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Issue 5's targets, each with the figure, the bar, and whether it is met.

    The ITL target is checked twice, against the same figure (the ITL this
    workload's batch shapes have with zero overhead) measured two ways: by
    the worker during this run, and by the model-only baseline minutes
    later. The first sees exactly the same steps at the same moment; the
    second also sees the machine change in between.
    """
    targets: dict[str, dict[str, Any]] = {}
    itl = run["itl_s"]["p50"]
    if "generate-batch" in ratios:
        targets["tokens/s >= 1.5x generate_batch"] = _target(ratios["generate-batch"], ">=", 1.5)
    if "model-only" in ratios:
        targets["tokens/s >= 0.7x model-only"] = _target(ratios["model-only"], ">=", 0.7)
    if in_run is not None and not math.isnan(in_run["itl_p50_s"]):
        over_ms = (itl - in_run["itl_p50_s"]) * 1000
        targets["ITL p50 <= model steps' (same run) + 1 ms"] = _target(over_ms, "<=", 1.0, unit="ms over")
    if "model-only" in ratios and baselines["model-only"].get("itl_p50_s") is not None:
        over_ms = (itl - baselines["model-only"]["itl_p50_s"]) * 1000
        targets["ITL p50 <= model-only ITL p50 + 1 ms"] = _target(over_ms, "<=", 1.0, unit="ms over")
    ttft = run["ttft_s"]
    if ttft["p50"] > 0:
        targets["TTFT p99 < 4x p50"] = _target(ttft["p99"] / ttft["p50"], "<", 4.0)
    return targets


def _target(value: float, op: str, bar: float, unit: str = "x") -> dict[str, Any]:
    met = {">=": value >= bar, "<=": value <= bar, "<": value < bar}[op]
    return {"value": value, "op": op, "bar": bar, "unit": unit, "met": bool(met)}


def _ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1000:.1f} ms"


def format_table(result: dict[str, Any]) -> str:
    """The result as the text table ``trioserve bench`` prints."""
    r = result["results"]
    lines = [
        f"trioserve bench ({result['driver']}): {result['workload_text']}",
        f"  model {result['model']}",
        "",
        f"  {'requests':<32}{r['num_completed']}/{r['num_requests']} completed, {r['num_errors']} errors",
        *(f"  {'  first errors' if i == 0 else '':<32}{e:.200}" for i, e in enumerate(r.get("first_errors", []))),
        f"  {'duration':<32}{r['duration_s']:.2f} s",
        f"  {'requests/s':<32}{r['requests_per_s']:.3f}",
        f"  {'output tokens/s':<32}{r['output_tokens_per_s']:.1f}",
    ]
    for key, label in (
        ("ttft_s", "time to first token"),
        ("itl_s", "inter-token latency"),
        ("e2e_s", "end-to-end latency"),
    ):
        d = r[key]
        lines.append(f"  {label + ' p50 / p99':<32}{_ms(d['p50'])} / {_ms(d['p99'])}")
    if "requests_per_engine" in r:
        lines.append(f"  {'requests per engine':<32}{' / '.join(map(str, r['requests_per_engine']))}")
    engine = r.get("engine")
    if engine is not None:
        rate = f"{engine['prefix_cache_hit_rate'] * 100:.1f}%" if engine["prefix_caching"] else "off"
        lines.append(f"  {'prefix cache hit rate':<32}{rate} of prompt tokens")
    for name, size in result["peak_rss_bytes"].items():
        lines.append(f"  {'peak RSS ' + name:<32}{size / MIB:.0f} MiB")
    for name, seconds in r.get("cpu_seconds", {}).items():  # and its share of one core over the run
        share = f" ({seconds / r['duration_s'] * 100:.0f}% of a core)" if r["duration_s"] > 0 else ""
        lines.append(f"  {'CPU time ' + name:<32}{seconds:.1f} s{share}")
    lines += _in_run_lines(result.get("model_steps_in_run"))
    lines += _flops_lines(result.get("model_flops"))
    lines += _baseline_lines(result)
    if result["targets"]:
        lines += ["", "  targets (issues 5, 13 and 15):"]
        for name, t in result["targets"].items():
            verdict = "met" if t["met"] else "MISSED"
            lines.append(f"    {name:<46}{t['value']:.2f} {t['unit']} ({t['op']} {t['bar']:g}): {verdict}")
    return "\n".join(lines)


def _in_run_lines(in_run: dict[str, Any] | None) -> list[str]:
    if not in_run:
        return []
    return [
        "",
        f"  model steps in this run (the worker's own timing, {in_run['num_steps']} steps)",
        f"  {'  model busy':<46}{in_run['model_busy_fraction'] * 100:>8.1f}% of the run",
        f"  {'  ITL with zero overhead, p50':<46}{_ms(in_run['itl_p50_s']):>9}",
        f"  {'  worker idle between steps, p50 / mean':<46}"
        f"{_ms(in_run['idle_between_steps_p50_s'])} / {_ms(in_run['idle_between_steps_mean_s'])}",
    ]


def _flops_lines(figures: dict[str, Any] | None) -> list[str]:
    if not figures:
        return []
    peak = figures["peak_gemm"]
    if "error" in peak:
        return ["", f"  {'peak GEMM rate':<46}failed: {peak['error']}"]
    lines = [
        "",
        f"  {'workload model FLOPs':<46}{figures['workload_flops'] / 1e12:>8.2f} TFLOP",
        f"  {'peak GEMM rate (' + peak['dtype'] + ', ' + str(peak['torch_threads']) + ' threads)':<46}"
        f"{peak['flops_per_s'] / 1e9:>8.1f} GFLOP/s ({peak['path']})",
    ]
    for system, value in figures["utilisation"].items():
        name = "ours" if system == "ours" else BASELINE_NAMES.get(system, system)
        lines.append(f"  {'  model FLOP utilisation, ' + name:<46}{value * 100:>8.1f}%")
    for system, cached in figures.get("not_computed", {}).items():
        name = "ours" if system == "ours" else BASELINE_NAMES.get(system, system)
        why = "it does not say which prompt tokens it cached" if cached is None else f"{cached} prompt tokens cached"
        lines.append(f"  {'  model FLOP utilisation, ' + name:<46}not computed ({why})")
    return lines


def _baseline_lines(result: dict[str, Any]) -> list[str]:
    baselines = result["baselines"]
    if not baselines:
        return []
    lines = ["", f"  {'baseline (same model, same requests)':<46}{'tok/s':>9}{'ours/it':>9}{'peak RSS':>10}"]
    for kind, b in baselines.items():
        name = BASELINE_NAMES.get(kind, kind)
        if "error" in b:
            lines.append(f"  {name:<46}failed: {b['error']}")
            continue
        ratio = result["throughput_ratio"].get(kind, math.nan)
        rss = f"{b['peak_rss_bytes'] / MIB:.0f} MiB" if b.get("peak_rss_bytes") else "-"
        lines.append(f"  {name:<46}{b['output_tokens_per_s']:>9.1f}{ratio:>8.2f}x{rss:>10}")
        if kind == "model-only":
            lines.append(f"  {'  ITL with zero overhead, p50':<46}{_ms(b['itl_p50_s']):>9}")
        if b.get("ttft_p50_s"):
            ttft_ratio = result["ttft_p50_ratio"].get(kind, math.nan)
            lines.append(
                f"  {'  TTFT p50 / p99 (ours/it p50)':<46}{_ms(b['ttft_p50_s'])} / {_ms(b['ttft_p99_s'])} "
                f"({ttft_ratio:.2f}x)"
            )
    return lines


def write_json(result: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(result, indent=2, default=_nan_safe) + "\n")


def _nan_safe(value: Any) -> Any:
    return str(value)


def plot_latencies(
    records: list[RequestRecord],
    path: str | Path,
    title: str,
    baselines: dict[str, dict[str, Any]] | None = None,
    ours: str = "ours",
) -> None:
    """Every system of the run on one chart: our requests' TTFT, ITL and E2E
    distributions (empirical CDFs), each baseline's ITL p50 where it has one
    (a line on the ITL panel), and every system's output tokens/s (bars).
    Needs matplotlib (``pip install 'trioserve[bench]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'trioserve[bench]' (or matplotlib)") from None
    done = [r for r in records if r.ok]
    series = {
        "time to first token": [r.ttft for r in done],
        "inter-token latency": [g for r in done for g in r.itls()],
        "end-to-end latency": [r.e2e for r in done],
    }
    measured = {kind: b for kind, b in (baselines or {}).items() if "error" not in b}
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.4))
    for ax, (name, seconds) in zip(axes, series.items(), strict=False):
        values = sorted(v * 1000 for v in seconds)
        ys = [(i + 1) / len(values) for i in range(len(values))]
        ax.plot(values, ys, drawstyle="steps-post", label=ours)
        for q in (0.5, 0.99):
            ax.axhline(q, color="grey", linewidth=0.6, linestyle=":")
        if name == "inter-token latency":
            for i, (kind, figures) in enumerate(measured.items()):
                if figures.get("itl_p50_s") is not None:
                    ax.axvline(figures["itl_p50_s"] * 1000, color=f"C{i + 1}", linestyle="--",
                               label=f"{BASELINE_NAMES.get(kind, kind)}: p50")  # fmt: skip
            ax.legend(fontsize=7, loc="lower right")
        ax.set_title(name)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples <= x")
        ax.grid(alpha=0.3)
    window = [r for r in done if r.deliveries]
    if window:
        span = max(r.finished_s for r in window) - min(r.sent_s for r in window)
        rates = {ours: sum(r.num_output_tokens for r in window) / span if span > 0 else 0.0}
    else:
        rates = {ours: 0.0}
    rates |= {BASELINE_NAMES.get(k, k): float(b.get("output_tokens_per_s") or 0.0) for k, b in measured.items()}
    bars = axes[3]
    bars.barh(list(rates), list(rates.values()), color=[f"C{i}" for i in range(len(rates))])
    bars.invert_yaxis()
    bars.set_title("output tokens/s, same workload")
    bars.tick_params(axis="y", labelsize=7)
    bars.grid(alpha=0.3, axis="x")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
