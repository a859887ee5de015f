"""What a row of attention costs per cached position: the part of a forward the kernel curve leaves out.

The kernel-cost curve (:mod:`specdraft.kernel_costs`) prices a forward's linear layers by its
width, which is nearly all of a one-request step on a CPU. In a batch, every request's rows also
attend over that request's own context, and with several requests of a few hundred positions each
that attention is a good part of the forward (bfloat16 ``sdpa`` on a CPU in particular). A tree
node then costs its row of linear layers *plus* a row of attention over its request's context, and
a budget that prices only the first over-buys trees at high concurrency.

:func:`attention_seconds` measures the second once per decoder: transformers' own ``sdpa``
attention on tensors of the model's head layout and dtype, at 1 and 9 query rows over 1024 cached
positions (fastest of a few rounds), and returns the slope, seconds per query row per cached
position for the whole model (every layer). A CPU-only measurement: elsewhere it returns 0.0
(attention is a small part of a GPU forward at these sizes, and timing it would need syncs).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import torch

#: Cached positions and query rows the measurement uses, and its rounds.
_COLUMNS = 1024
_ROWS = (1, 9)
_ROUNDS = 5


def attention_seconds(model: Any) -> float:
    """Seconds of attention per query row per cached position over all of ``model``'s layers
    (see the module docstring); 0.0 where it cannot be measured."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    device = getattr(model, "device", torch.device("cpu"))
    config = getattr(model, "config", None)
    if device.type != "cpu" or config is None:
        return 0.0
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", None)
    layers = getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", None)
    hidden = getattr(text, "hidden_size", None) or getattr(text, "n_embd", None)
    if not (heads and layers and hidden):
        return 0.0
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    dtype = getattr(model, "dtype", torch.float32)
    # what sdpa_attention_forward reads of an attention module (in eval mode)
    layer = SimpleNamespace(num_key_value_groups=max(1, heads // kv_heads), is_causal=False, training=False)
    generator = torch.Generator().manual_seed(0)
    key = torch.randn(1, kv_heads, _COLUMNS, head_dim, generator=generator).to(dtype)
    value = torch.randn(1, kv_heads, _COLUMNS, head_dim, generator=generator).to(dtype)
    best: dict[int, float] = {}
    with torch.inference_mode():
        for _ in range(_ROUNDS):
            for rows in _ROWS:
                query = torch.randn(1, heads, rows, head_dim, generator=generator).to(dtype)
                mask = torch.ones(1, 1, rows, _COLUMNS, dtype=torch.bool)
                started = time.perf_counter()
                sdpa_attention_forward(layer, query, key, value, mask, scaling=head_dim ** -0.5)
                seconds = time.perf_counter() - started
                best[rows] = min(best.get(rows, seconds), seconds)
    low, high = _ROWS
    return max(0.0, (best[high] - best[low]) / ((high - low) * _COLUMNS)) * layers
