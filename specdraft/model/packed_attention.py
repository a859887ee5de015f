"""Attention for a packed batch: each request's rows against its own cache region only.

A batched forward (:mod:`specdraft.batch_runner`) carries several requests' rows as one sequence
over one cache buffer in which every request owns a region. Its 4D mask already keeps requests
apart, but a dense masked attention still computes every row against every column of every
region: with eight requests each row pays for eight contexts. On a CPU that was measured to
double the cost of a bfloat16 forward of 16 rows at eight regions of 400 positions.

Each request's allowed columns are one contiguous stretch of the buffer (its region's committed
tokens, then its new rows), so this backend runs transformers' own ``sdpa`` attention once per
request on that stretch, with that request's slice of the mask, and concatenates the outputs: the
same arithmetic per request as a forward of that request alone, and no work on other requests'
columns. (The flash split's FlashAttention 4 call does the same on a GPU, through one
variable-length call: :mod:`specdraft.model.flash_kernels`.)

The layout reaches the attention through the forward's keyword arguments (transformers passes
them down to the attention function of every layer); without it, for any other caller of the
model, the function *is* transformers' ``sdpa`` attention. It is registered in transformers'
``AttentionInterface`` under :data:`PACKED_NAME`, so the model stays unpatched.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

#: The registered name (no "flash" in it: transformers treats such names specially).
PACKED_NAME = "specdraft_packed"

#: The forward keyword that carries the layout to the attention function.
LAYOUT_KEYWORD = "specdraft_layout"


@dataclass(frozen=True)
class PackedLayout:
    """Per request: its rows ``[row_start, row_end)`` of the forward and the columns
    ``[column_start, column_end)`` of the cache it may attend to."""

    spans: Sequence[tuple[int, int, int, int]]


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function (``AttentionInterface`` signature): ``sdpa`` per request
    span when the forward carries a :class:`PackedLayout`, plain ``sdpa`` otherwise."""
    layout: PackedLayout | None = kwargs.pop(LAYOUT_KEYWORD, None)
    if layout is None or attention_mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    kwargs.pop("is_causal", None)
    outputs = [sdpa_attention_forward(module, query[:, :, r0:r1], key[:, :, c0:c1], value[:, :, c0:c1],
                                      attention_mask[:, :, r0:r1, c0:c1], *args, is_causal=False, **kwargs)[0]
               for r0, r1, c0, c1 in layout.spans]  # each request's rows [r0, r1) and columns [c0, c1)
    return torch.cat(outputs, dim=1), None


def register_backend(name: str, attention: Callable[..., Any]) -> str:
    """Register ``attention`` with transformers' ``AttentionInterface`` under ``name``, with
    ``sdpa``'s bool mask builder (idempotent); returns ``name``. Every backend of the package takes
    the bool mask ``sdpa`` takes."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def register_packed_backend() -> str:
    """Register :func:`packed_attention` with transformers (idempotent); returns its name."""
    return register_backend(PACKED_NAME, packed_attention)


@contextmanager
def packed_attention_for(model: Any) -> Iterator[bool]:
    """While inside, a model on ``sdpa`` attention runs :func:`packed_attention` (which is
    ``sdpa`` for every forward without a layout); yields whether it does. Other implementations
    are left as they are (the packed mask alone keeps requests apart there)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        yield False
        return
    register_packed_backend()
    model.set_attn_implementation(PACKED_NAME)
    try:
        yield True
    finally:
        model.set_attn_implementation("sdpa")
