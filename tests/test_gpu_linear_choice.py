"""The kernel of each linear layer, chosen at the worker's start by timing
(``gpu/cpu_kernels/choice.py``): a slowed kernel is not chosen, the choice
is cached per host and model and reused, a layer whose regimes differ holds
both layouts and gives ``F.linear``'s products either way, and
``TRIOSERVE_PACKED_LINEAR`` still forces one kernel."""

from __future__ import annotations

import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from trioserve.gpu.cpu_kernels import choice  # noqa: E402
from trioserve.gpu.cpu_kernels import linear as cpu_linear  # noqa: E402

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"),
]

SHAPES = [(24, 40), (40, 24)]
HEADS = [(24, 96)]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test's choices in its own directory (the kernels' builds stay in the shared cache)."""
    monkeypatch.setattr(choice, "inductor_cache_dir", lambda: tmp_path)


def slowed(factory: Any, seconds: float = 0.005) -> Any:
    def make(linear: torch.nn.Linear) -> Any:
        fn = factory(linear)

        def call(x: torch.Tensor) -> torch.Tensor:
            time.sleep(seconds)
            return fn(x)

        return call

    return make


def plain(linear: torch.nn.Linear) -> Any:
    return linear


@pytest.mark.parametrize("slow", ["ours", "mkl"])
def test_a_slowed_kernel_is_not_chosen_and_the_second_start_times_nothing(slow, monkeypatch):
    factories = {"ours": cpu_linear.PanelLinear, "mkl": plain}
    factories[slow] = slowed(factories[slow])
    other = "mkl" if slow == "ours" else "ours"
    picked = choice.choose_kernels(SHAPES, HEADS, torch.float32, (8, 64), factories, default="ours")
    assert picked == {shape: {"decode": other, "prefill": other} for shape in [*SHAPES, *HEADS]}

    def timed(*args: Any) -> str:
        raise AssertionError("timed again")

    monkeypatch.setattr(choice, "_fastest", timed)
    assert choice.choose_kernels(SHAPES, HEADS, torch.float32, (8, 64), factories, default="ours") == picked
    with pytest.raises(AssertionError, match="timed again"):  # another case: another entry
        choice.choose_kernels(SHAPES, HEADS, torch.float32, (16, 64), factories, default="ours")


@pytest.mark.parametrize(("speedup", "picked"), [(1 + choice.MARGIN / 2, "ours"), (1 + 2 * choice.MARGIN, "mkl")])
def test_the_default_keeps_a_regime_unless_another_is_faster_by_the_margin(speedup, picked, monkeypatch):
    now = [0.0]
    seconds = {"ours": 1.0, "mkl": 1.0 / speedup}

    def taking(kind: str) -> Any:
        def make(linear: torch.nn.Linear) -> Any:
            def call(x: torch.Tensor) -> None:
                now[0] += seconds[kind]

            return call

        return make

    monkeypatch.setattr(choice.time, "perf_counter", lambda: now[0])
    factories = {"mkl": taking("mkl"), "ours": taking("ours")}
    assert choice._fastest((8, 8), torch.float32, [4], factories, "ours") == [picked]


@pytest.mark.parametrize(("small", "large"), [("ours", "mkl"), ("mkl", "onednn"), ("onednn", "ours")])
@pytest.mark.parametrize("bias", [False, True])
def test_a_split_layer_gives_f_linears_products_on_either_side_of_its_threshold(small, large, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 40, bias=bias).requires_grad_(False)
    split = cpu_linear.SplitLinear(linear, small, large, threshold=6)
    for rows in [0, 1, 6, 7, 30]:
        x = torch.randn(rows, 24)
        torch.testing.assert_close(split(x), linear(x), rtol=1e-5, atol=1e-5)
        op = torch.ops.trioserve.split_linear(x, small, split.small_weight, large, split.large_weight,
                                              linear.bias, 40, 6)  # fmt: skip
        torch.testing.assert_close(op, linear(x), rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 5, 24)
    torch.testing.assert_close(split(x), linear(x), rtol=1e-5, atol=1e-5)
    assert split.weight_bytes == 2 * 24 * 40 * 4


def test_a_split_layers_kernel_follows_the_row_count(monkeypatch):
    calls: list[tuple[str, int]] = []
    real = cpu_linear.kernel_linear

    def spy(x: torch.Tensor, kind: str, *args: Any) -> torch.Tensor:
        calls.append((kind, x.shape[0]))
        return real(x, kind, *args)

    monkeypatch.setattr(cpu_linear, "kernel_linear", spy)
    split = cpu_linear.SplitLinear(torch.nn.Linear(8, 8).requires_grad_(False), "ours", "mkl", threshold=4)
    for rows in [1, 4, 5, 9]:
        split(torch.randn(rows, 8))
    assert calls == [("ours", 1), ("ours", 4), ("mkl", 5), ("mkl", 9)]


def model_of_three() -> torch.nn.Module:
    torch.manual_seed(1)
    embed = torch.nn.Embedding(96, 24)
    model = torch.nn.ModuleDict(
        {"up": torch.nn.Linear(24, 40), "down": torch.nn.Linear(40, 24), "lm_head": torch.nn.Linear(24, 96, bias=False)}
    )
    model["embed"] = embed
    model["lm_head"].weight = embed.weight  # tied
    return model.requires_grad_(False)


def test_pack_linears_swaps_each_layer_for_its_choice_within_the_memory_budget(monkeypatch):
    picks = {(24, 40): ("ours", "mkl"), (40, 24): ("mkl", "mkl"), (24, 96): ("onednn", "onednn")}
    seen: list[Any] = []

    def choose(layers: Any, heads: Any, dtype: Any, rows: Any, factories: Any, default: str) -> Any:
        seen.append((sorted(layers), heads, rows, sorted(factories), default))
        return {shape: {"decode": d, "prefill": p} for shape, (d, p) in picks.items()}

    monkeypatch.setattr(cpu_linear, "choose_kernels", choose)
    model = model_of_three()
    x = torch.randn(10, 24)
    expected = model["down"](model["up"](x))
    assert cpu_linear.pack_linears(model, rows=(4, 64)) == 2  # "down" stays on MKL's F.linear, as it is
    assert seen == [([(24, 40), (40, 24)], [(24, 96)], (4, 64), ["mkl", "onednn", "ours"], "ours")]
    assert type(model["up"]) is cpu_linear.SplitLinear and (model["up"].small, model["up"].large) == ("ours", "mkl")
    assert type(model["down"]) is torch.nn.Linear
    assert type(model["lm_head"]) is cpu_linear.PackedLinear and model["lm_head"].tied
    for rows in (3, 10):
        torch.testing.assert_close(model["down"](model["up"](x[:rows])), expected[:rows], rtol=1e-5, atol=1e-5)

    monkeypatch.setattr(cpu_linear, "split_budget_bytes", lambda: 24 * 40 * 4 - 1)  # no room for a second copy
    model = model_of_three()
    cpu_linear.pack_linears(model, rows=(4, 64))
    assert type(model["up"]) is cpu_linear.PanelLinear  # the decode's pick for every row count


@pytest.mark.parametrize(("forced", "kind"), [("ours", "PanelLinear"), ("onednn", "PackedLinear")])
def test_the_environment_still_forces_one_kernel(forced, kind, monkeypatch):
    def choose(*args: Any) -> Any:
        raise AssertionError("timed despite a forced kernel")

    monkeypatch.setattr(cpu_linear, "choose_kernels", choose)
    monkeypatch.setenv(cpu_linear.PACKED_LINEAR_ENV, forced)
    model = model_of_three()
    assert cpu_linear.pack_linears(model, rows=(4, 64)) == 3
    assert {type(model[name]).__name__ for name in ("up", "down", "lm_head")} == {kind}


def test_a_real_choice_on_a_tiny_models_shapes_is_timed_once_and_runs(monkeypatch):
    model = model_of_three()
    x = torch.randn(10, 24)
    expected = model["down"](model["up"](x))
    cpu_linear.pack_linears(model, rows=(4, 64))
    for rows in (3, 10):
        torch.testing.assert_close(model["down"](model["up"](x[:rows])), expected[:rows], rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(choice, "_fastest", lambda *args: (_ for _ in ()).throw(AssertionError("timed again")))
    again = model_of_three()
    cpu_linear.pack_linears(again, rows=(4, 64))
    assert [type(again[n]) for n in ("up", "down", "lm_head")] == [type(model[n]) for n in ("up", "down", "lm_head")]


def test_lora_takes_a_split_layer_as_a_linear_one():
    from trioserve.gpu.lora import _is_linear

    assert _is_linear(cpu_linear.SplitLinear(torch.nn.Linear(8, 8).requires_grad_(False), "ours", "mkl", threshold=4))


def test_a_kernel_that_fails_on_a_shape_is_not_chosen_and_none_left_means_f_linear():
    def broken(linear: torch.nn.Linear) -> Any:
        raise RuntimeError("cannot take this shape")

    assert choice._fastest((8, 8), torch.float32, [4], {"ours": broken, "mkl": plain}, "ours") == ["mkl"]
    assert choice._fastest((8, 8), torch.float32, [4], {"ours": broken}, "ours") == ["mkl"]
