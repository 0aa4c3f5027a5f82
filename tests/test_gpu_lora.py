"""The worker's adapter slots (``gpu/lora.py``) on a tiny model, in this
process: a batch whose rows belong to two adapters and the base model gives
each row the logits of its adapter merged into the model by PEFT, by each
of the ways a step runs (one adapter on every row; for a few rows, our
kernel with each row's own adapter, or one masked product over the slots;
a product per adapter for many)."""

from __future__ import annotations

import pytest
import torch
from helpers.lora import ATTENTION, ATTENTION_AND_MLP, merged_model, write_adapter

from trioserve.gpu import lora

pytestmark = pytest.mark.model


@pytest.mark.parametrize("way", ["kernel", "masked", "per adapter"])
def test_each_row_gets_its_adapters_logits_whichever_way_the_step_runs(tiny_model_dir, tmp_path, monkeypatch, way):
    from transformers import AutoModelForCausalLM

    if way != "kernel":
        monkeypatch.setattr(lora, "KERNEL_MAX_ROWS", 0)
    if way == "per adapter":
        monkeypatch.setattr(lora, "MASKED_MAX_ROWS", 0)
    base_dir = tiny_model_dir("llama")
    paths = {
        "a": write_adapter(base_dir, tmp_path / "a", r=8, targets=ATTENTION, seed=1),
        "b": write_adapter(base_dir, tmp_path / "b", r=4, targets=ATTENTION_AND_MLP, seed=2, use_rslora=True),
    }
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47], [9, 8, 7, 6, 5, 4, 3, 2]])
    with torch.no_grad():
        want = {None: AutoModelForCausalLM.from_pretrained(base_dir)(ids).logits}
        for name, path in paths.items():
            merged = AutoModelForCausalLM.from_pretrained(merged_model(base_dir, path, tmp_path / f"{name}-m"))
            want[name] = merged(ids).logits
        model = AutoModelForCausalLM.from_pretrained(base_dir).eval()
        layers = lora.LoraLayers(
            model, max_loras=2, max_rank=16, max_cpu_loras=None, device=torch.device("cpu"), dtype=torch.float32
        )
        assert [layers.load(name, str(path)) for name, path in paths.items()] == [8, 4]
        for order in (["a", None, "b"], ["b", "a", None], [None, None, "a"]):
            layers.prepare([(name, ids.shape[1]) for name in order])
            assert (layers._slot_of is not None, layers._mask is not None) == (way == "kernel", way == "masked")
            got = model(ids).logits
            for row, name in enumerate(order):
                assert torch.allclose(got[row], want[name][row], atol=1e-4), (order, row)
        layers.prepare([("b", 3 * ids.shape[1])])  # one adapter on every row
        assert torch.allclose(model(ids).logits, want["b"], atol=1e-4)


@pytest.mark.parametrize(("rows", "k", "n"), [(1, 8, 8), (7, 37, 45), (33, 576, 192), (64, 200, 1536), (600, 64, 96)])
def test_the_kernel_gives_each_row_its_own_adapters_product(rows, k, n):
    """``apply_rows`` against the plain product per row: adapters of different
    ranks, rows of no adapter, an adapter's rows more and fewer than the four
    it takes at once, widths that are not whole vectors."""
    from trioserve.gpu.cpu_kernels.lora import apply_rows, lora_kernel_available

    if not lora_kernel_available(torch.device("cpu"), torch.float32, 16):
        pytest.skip("no C++ toolchain: the kernel is not built (torch's products serve)")
    gen = torch.Generator().manual_seed(rows * 1000 + k)
    slots, max_rank = 4, 16
    a = torch.randn(slots, max_rank, k, generator=gen)
    b = torch.randn(slots, max_rank, n, generator=gen)
    ranks = torch.tensor([16, 8, 0, 3])
    slot_of = torch.randint(-1, slots, (rows,), generator=gen)
    x = torch.randn(rows, k, generator=gen)
    out = torch.randn(rows, n, generator=gen)
    expected = out.clone()
    for m, s in enumerate(slot_of.tolist()):
        if s >= 0:
            r = int(ranks[s])
            expected[m] += (a[s, :r] @ x[m]) @ b[s, :r]
    apply_rows(x, out, a, b, slot_of, ranks)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
