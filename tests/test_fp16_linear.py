"""The FBGEMM float16-weight linear (``cpu_kernels="fbgemm"``): exact weights or none at all.

The decoder-level promises (greedy identity on the same kernels, the model left as it was,
threads, repacking) are in ``test_cpu_kernels.py``, parametrised over both packed kinds. Here:
which weights float16 holds exactly (with the per-row power-of-two scaling), that what FBGEMM
stores is that weight bit for bit, and that the layer computes what the stock layer computes up to
the order of float32 additions, for every dtype it takes.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from specdraft import Decoder, PromptLookup
from specdraft.kernels.cpu_kernels import CpuKernelError, packed_model
from specdraft.kernels.fp16_linear import Fp16Linear, exact_fp16_weight, fbgemm_problem

from conftest import FAST, reference_greedy, tiny_model

pytestmark = [pytest.mark.usefixtures("single_thread"),
              pytest.mark.skipif(fbgemm_problem() is not None, reason=f"FBGEMM cannot run here: {fbgemm_problem()}")]


def _bf16_weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    """A bfloat16 weight with the awkward values a trained checkpoint has: tiny ones float16 can
    only hold after scaling, one above float16's range, zero rows."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
    w[0, 0] = 3e-9      # below float16's smallest step: exact only in a scaled row
    w[1] *= 4e6         # a row above float16's largest value (65504)
    w[2] = 0            # a row of zeros
    return w


#: A float32 value with 24 significant bits, alternating: more than two float16 numbers hold.
DENSE_BITS = 1.0 + sum(2.0 ** -i for i in range(1, 24, 2))


def test_exact_weights_need_no_scaling() -> None:
    w = torch.randn(16, 8).to(torch.float16).to(torch.float32)
    scaled, row_scale, terms = exact_fp16_weight(w)
    assert row_scale is None and terms == 1 and torch.equal(scaled, w)


def test_awkward_bfloat16_rows_are_scaled_by_powers_of_two_exactly() -> None:
    w = _bf16_weight(12, 40, seed=1)
    scaled, row_scale, terms = exact_fp16_weight(w)
    assert row_scale is not None and terms == 1
    mantissa, _ = torch.frexp(row_scale)
    assert torch.all(mantissa == 0.5)  # powers of two
    assert torch.equal(scaled.to(torch.float16).to(torch.float32), scaled)  # float16 holds it
    assert torch.equal(scaled / row_scale[:, None], w.to(torch.float32))  # and it is the weight


def _dequantized_weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    """What an 8-bit GGUF block dequantizes to in float32: an int8 times a float16 scale per block
    of 32 (up to 18 significant bits: more than float16 holds, less than two of them)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (rows, cols), generator=g).to(torch.float32)
    scale = (torch.rand(rows, (cols + 31) // 32, generator=g) * 1e-3 + 1e-4).to(torch.float16).to(torch.float32)
    return q * scale.repeat_interleave(32, dim=1)[:, :cols]


def test_float32_with_more_bits_is_split_into_two_float16_terms_exactly() -> None:
    w = _dequantized_weight(10, 64, seed=3)
    assert exact_fp16_weight(w, max_terms=1) is None  # float16 alone cannot hold it
    packed, row_scale, terms = exact_fp16_weight(w)
    assert terms == 2 and packed.shape == (10, 128)
    hi, lo = packed[:, :64], packed[:, 64:]
    assert torch.equal(packed.to(torch.float16).to(torch.float32), packed)
    assert torch.equal((hi + lo) / row_scale[:, None], w)


@pytest.mark.parametrize("weight, why", [
    (torch.full((2, 3), DENSE_BITS), "24 significant bits: more than two float16 numbers hold"),
    (torch.tensor([[1.0, 2.0 ** -50]]), "a row spanning 50 binades"),
    (torch.tensor([[1.0, float("inf")]]), "not finite"),
    (torch.ones(2, 2, dtype=torch.float64), "float64 inputs would be rounded to float32"),
])
def test_weights_float16_cannot_hold_are_refused(weight: torch.Tensor, why: str) -> None:
    assert exact_fp16_weight(weight) is None, why


@pytest.mark.parametrize("dtype, weights", [(torch.bfloat16, "bf16"), (torch.float16, "fp16"),
                                            (torch.float32, "bf16"), (torch.float32, "dequantized")])
@settings(FAST, max_examples=20)
@given(rows=st.integers(1, 40), seed=st.integers(0, 10_000), bias=st.booleans())
def test_layer_matches_stock_up_to_summation_order(dtype: torch.dtype, weights: str, rows: int, seed: int,
                                                   bias: bool) -> None:
    torch.manual_seed(seed)
    linear = nn.Linear(40, 12, bias=bias)
    with torch.no_grad():
        linear.weight.copy_({"bf16": lambda: _bf16_weight(12, 40, seed).to(torch.float32),
                             "fp16": lambda: linear.weight.to(torch.float16).to(torch.float32),
                             "dequantized": lambda: _dequantized_weight(12, 40, seed)}[weights]())
    linear = linear.to(dtype)
    layer = Fp16Linear.build(linear)
    assert layer is not None and layer.terms == (2 if weights == "dequantized" else 1)
    stored, _ = torch.ops.quantized.linear_unpack_fp16(layer.packed)
    summed = stored[:, :40] + stored[:, 40:] if layer.terms == 2 else stored
    assert torch.equal(summed * (layer.inverse_scale[:, None] if layer.inverse_scale is not None else 1),
                       linear.weight.to(torch.float32))
    x = torch.randn(1, rows, 40).to(dtype)
    with torch.inference_mode():
        got = layer(x)
        exact = (x.double() @ linear.weight.double().T + (linear.bias.double() if bias else 0))
        want = linear(x)
    assert got.dtype == dtype and got.shape == want.shape
    # both are a float32 sum of exact products, rounded once to ``dtype``: within the textbook
    # bound of a float32 dot product (n eps sum|x w|) plus that last rounding of the exact value
    magnitude = x.double().abs() @ linear.weight.double().abs().T + (linear.bias.double().abs() if bias else 0)
    bound = 41 * torch.finfo(torch.float32).eps * magnitude + torch.finfo(dtype).eps * exact.abs() * 1.01
    assert torch.all((got.double() - exact).abs() <= bound)
    assert torch.all((want.double() - exact).abs() <= bound)


def test_other_inputs_go_to_the_original_layer() -> None:
    linear = nn.Linear(8, 4).to(torch.bfloat16)
    layer = Fp16Linear.build(linear)
    x = torch.randn(3, 8, dtype=torch.float32)  # another dtype than the weight: stock raises, so must we
    with pytest.raises(RuntimeError):
        layer(x)
    x = torch.randn(3, 8, dtype=torch.bfloat16, requires_grad=True)
    out = layer(x)  # needs gradients: the original module, which has them
    out.float().sum().backward()
    assert x.grad is not None


def test_a_model_float16_cannot_hold_is_refused_by_name() -> None:
    model = copy.deepcopy(tiny_model("llama")).to(torch.float32)  # random float32 weights: no layer is exact
    with pytest.raises(CpuKernelError, match="float16 holds exactly.*load it in bfloat16"):
        Decoder(model, cpu_kernels="fbgemm")


def test_layers_float16_cannot_hold_keep_the_stock_kernel_and_are_named() -> None:
    model = copy.deepcopy(tiny_model("qwen2")).to(torch.bfloat16).to(torch.float32)  # a bf16 checkpoint in fp32
    with torch.no_grad():
        model.lm_head.weight[0, 0] = DENSE_BITS * 2.0 ** -7  # lm_head (tied) gets a value with too many bits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        packed = packed_model(model, "fbgemm")
    assert packed.stock_layers == ["lm_head"] and "lm_head" not in packed.layers
    assert any("keep the stock kernel" in str(w.message) and "lm_head" in str(w.message) for w in caught)
    prompt = [5, 6, 7, 5, 6, 7, 5]
    with packed.swapped():
        assert type(model.lm_head) is nn.Linear and isinstance(model.model.layers[0].mlp.up_proj, Fp16Linear)
        want = reference_greedy(model, prompt, 16)
    dec = Decoder(model, sources=[PromptLookup()], cpu_kernels="fbgemm")
    assert dec.generate(prompt, max_new_tokens=16).token_ids == want


def test_weights_no_longer_exact_after_a_change_are_refused() -> None:
    model = copy.deepcopy(tiny_model("llama")).to(torch.bfloat16).to(torch.float32)
    packed = packed_model(model, "fbgemm")
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = DENSE_BITS  # more bits than two float16 numbers hold
    with pytest.raises(CpuKernelError, match="float16 no longer holds them exactly"):
        with packed.swapped():
            pass


def test_two_kinds_in_flight_on_one_model_get_a_clear_error() -> None:
    from specdraft.kernels.cpu_kernels import packed_kernels_available

    if not packed_kernels_available():
        pytest.skip("torch built without oneDNN")
    model = copy.deepcopy(tiny_model("llama")).to(torch.bfloat16).to(torch.float32)
    fbgemm, onednn = packed_model(model, "fbgemm"), packed_model(model, "packed")
    with fbgemm.swapped():
        with pytest.raises(RuntimeError, match="must use the same cpu_kernels"):
            with onednn.swapped():
                pass
        with pytest.raises(RuntimeError, match="must use the same cpu_kernels"):
            Decoder(copy.copy(model), cpu_kernels="packed")  # packing while the other kind is swapped in
    with onednn.swapped():  # each still works on its own
        pass
