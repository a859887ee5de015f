"""Attention backends: SDPA / eager as transformers ships them, and a FlashAttention tree backend.

Why a backend of our own
    FlashAttention kernels take no arbitrary mask, and transformers' ``flash_attention_2``
    integration misreads a 4D tree mask as padding (silently wrong logits). So the peers either
    fall back to a single branch or fork the kernel. We split the attention of the new tokens in
    two instead (lookahead decoding paper, section 3.4):

    (a) every new token against the **cached prefix**: no mask is needed there (every tree node
        sees the whole prefix), so a real flash kernel does it and returns the log-sum-exp;
    (b) the new tokens **among themselves** with the tree mask: a small dense product;

    and merge the two softmax halves exactly by their log-sum-exps::

        lse = logaddexp(lse_a, lse_b);  out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

    The function is registered in transformers' ``AttentionInterface`` (and the matching mask
    builder in ``AttentionMaskInterface``), so every model uses it unpatched through
    ``attn_implementation="specdraft_split"``.

Where the prefix is
    In specdraft's own forwards the new rows sit in the KV store's regions, not after the prefix,
    so the runner passes a :class:`~specdraft.model.flash_kernels.FlashLayout` (each row's
    committed columns, the columns the new rows are written to, which new rows each row sees) and
    part (a) runs a flash kernel over each request's committed columns
    (:func:`~specdraft.model.flash_kernels.prefix_attention`: FlashAttention 4 on CUDA, flash-attn 2
    or torch's own CPU flash kernel over host spans, a dense product where neither can run). Part
    (b) and the merge are then one Triton kernel on CUDA (:mod:`specdraft.model.flash_merge_triton`)
    and torch operations elsewhere. For any other caller the new tokens are the last ``q`` keys and
    the mask says the rest.

Ordinary steps (a prefill with no cache, a one-token decode) need no split: they go straight to
the flash kernel. A prefix that is itself masked (sliding-window layers, which get no layout) is
computed densely with its mask and merged the same way, so windows stay exact.
"""

from __future__ import annotations

from typing import Any

import torch

from . import flash_merge_triton
from .flash_kernels import (FLASH_DTYPES, FLASH_LAYOUT_KEYWORD, AttentionBackendError, FlashLayout,
                            cpu_flash_available, dense_with_lse, fa2_available, fa4_available, flash_with_lse,
                            prefix_attention)
from .masks import visible
from .packed_attention import register_backend

#: Part (b) and the merge as one Triton kernel: ``None`` where Triton runs on CUDA, ``True`` /
#: ``False`` to force it (the tests run it in Triton's interpreter) or the torch operations.
TRITON_MERGE: bool | None = None

# No "flash" in the name: transformers gives names containing it special handling (padding-free
# masks, hub kernel loading) that would bypass our tree mask.
FLASH_NAME = "specdraft_split"

#: What ``Decoder(attention=...)`` accepts.
ATTENTION_CHOICES = ("auto", "sdpa", "eager", "flash", "exact")


def merge_partial_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                            lse_b: torch.Tensor) -> torch.Tensor:
    """Combine two softmax-attention results over disjoint key sets into the attention over both.

    ``out_x`` is ``[..., q, D]`` (normalised within its own keys), ``lse_x`` is ``[..., q]``.
    Computed in float32 at least; a side with ``lse = -inf`` (no keys) contributes nothing.
    """
    work = torch.float64 if torch.float64 in (out_a.dtype, out_b.dtype) else torch.float32
    lse_a, lse_b = lse_a.to(work), lse_b.to(work)
    lse = torch.logaddexp(lse_a, lse_b)
    wa = torch.exp(lse_a - lse).nan_to_num(0.0)[..., None]
    wb = torch.exp(lse_b - lse).nan_to_num(0.0)[..., None]
    return wa * out_a.to(work) + wb * out_b.to(work)


def tree_flash_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function (``AttentionInterface`` signature) for tree steps.

    ``query`` is ``[B, H, q, D]``, ``key``/``value`` ``[B, Hkv, kv, D]``. With a
    :class:`~specdraft.model.flash_kernels.FlashLayout` in ``kwargs`` (specdraft's own forwards)
    the layout says where each row's keys are and the mask is not read; otherwise the ``q`` new
    tokens are the last keys and ``attention_mask`` is the 4D mask ``[B, 1, q, kv]`` (as
    transformers' sdpa mask builder makes it). Returns ``([B, q, H, D], None)`` like transformers'
    own backends.
    """
    if dropout and module.training:
        raise AttentionBackendError("the flash tree backend does not implement attention dropout; call model.eval()")
    if kwargs.get("softcap") is not None or getattr(module, "attn_logit_softcapping", None) is not None:
        raise AttentionBackendError("the flash tree backend does not implement attention logit soft-capping; "
                                    "use attention='sdpa' for this model")
    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        raise AttentionBackendError("the flash tree backend does not implement attention sinks; use attention='sdpa'")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layout: FlashLayout | None = kwargs.get(FLASH_LAYOUT_KEYWORD)
    if layout is not None:
        return _split_by_layout(query, key, value, layout, scale), None
    out = _split_by_mask(query, key, value, attention_mask, scale)
    return out.transpose(1, 2).contiguous().to(query.dtype), None


def _fused_merge(query: torch.Tensor) -> bool:
    """Whether part (b) and the merge run as one Triton kernel (:mod:`specdraft.model.flash_merge_triton`)."""
    return TRITON_MERGE if TRITON_MERGE is not None else query.is_cuda and flash_merge_triton.available()


def _split_by_layout(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: FlashLayout,
                     scale: float) -> torch.Tensor:
    """Part (a) over each row's committed columns, part (b) over the forward's own rows (read from
    the columns they were written to), merged: ``[1, q, H, D]`` in the query's dtype."""
    if query.shape[0] != 1:
        raise AttentionBackendError(f"a forward with a flash layout carries one sequence of rows, got a batch of "
                                    f"{query.shape[0]}")
    old_out, old_lse = prefix_attention(query, key, value, layout, scale)
    if _fused_merge(query):
        return flash_merge_triton.attend_new_rows(query, key, value, layout.write_columns, layout.new_allowed,
                                                  old_out, old_lse, layout.region_length, scale)
    seen = layout.region_length > 0  # a row whose request has nothing committed: part (b) alone
    old_lse = torch.where(seen, old_lse, float("-inf"))
    old_out = torch.where(seen[:, None], old_out, 0.0)
    new_key, new_value = key.index_select(2, layout.write_columns), value.index_select(2, layout.write_columns)
    new_out, new_lse = dense_with_lse(query, new_key, new_value, scale, layout.new_allowed[None, None])
    out = merge_partial_attention(old_out, old_lse, new_out, new_lse)
    return out.transpose(1, 2).contiguous().to(query.dtype)


def _split_by_mask(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                   scale: float) -> torch.Tensor:
    """The split for a caller without a layout: the ``q`` new tokens are the last ``q`` keys."""
    batch, heads, q_len, _ = query.shape
    kv_len = key.shape[2]
    prefix = kv_len - q_len
    if attention_mask is None and (prefix == 0 or q_len == 1):  # a plain prefill or one-token decode
        return flash_with_lse(query, key, value, scale, causal=q_len > 1)[0]
    allowed = visible(attention_mask, q_len, kv_len, query.device).expand(batch, heads, q_len, kv_len)

    new_out, new_lse = dense_with_lse(query, key[:, :, prefix:], value[:, :, prefix:], scale, allowed[..., prefix:])
    if prefix == 0:
        return new_out
    prefix_allowed = allowed[..., :prefix]
    if bool(prefix_allowed.all()):
        old_out, old_lse = flash_with_lse(query, key[:, :, :prefix], value[:, :, :prefix], scale, causal=False)
    else:  # a sliding window masks part of the prefix: keep it exact with a dense product
        old_out, old_lse = dense_with_lse(query, key[:, :, :prefix], value[:, :, :prefix], scale, prefix_allowed)
    return merge_partial_attention(old_out, old_lse, new_out, new_lse)


def register_flash_backend() -> str:
    """Register the tree flash backend with transformers (idempotent); returns its name."""
    return register_backend(FLASH_NAME, tree_flash_attention)


def select_attention(model: Any, requested: str) -> str:
    """Switch ``model`` to the requested backend and return the implementation name it now uses.

    ``auto`` picks ``flash`` on CUDA with flash-attn 2 installed (FlashAttention 4 alone is taken
    only when asked for: its speed in our step is not measured yet); otherwise it keeps the model's own
    ``sdpa`` or ``eager`` and switches anything else to ``sdpa``. ``flash`` where it cannot run
    raises :class:`AttentionBackendError` naming what is missing. ``exact`` is the attention of
    exact mode (:mod:`specdraft.model.exact_attention`).
    """
    if requested not in ATTENTION_CHOICES:
        raise ValueError(f"attention must be one of {list(ATTENTION_CHOICES)}, got {requested!r}")
    current = getattr(model.config, "_attn_implementation", None)
    on_cuda = getattr(model, "device", torch.device("cpu")).type == "cuda"
    if requested == "auto":
        if on_cuda and fa2_available() and getattr(model, "dtype", None) in FLASH_DTYPES:
            requested = "flash"
        elif current in ("sdpa", "eager", FLASH_NAME):
            return current
        else:
            requested = "sdpa"
    if requested == "exact":
        from .exact_attention import register_exact_backend

        requested = register_exact_backend()
    if requested == "flash":
        dtype = getattr(model, "dtype", None)
        if on_cuda and dtype not in FLASH_DTYPES:
            raise AttentionBackendError(f"attention='flash' on CUDA needs a float16 or bfloat16 model "
                                        f"(FlashAttention has no {dtype} kernels); use attention='sdpa'")
        if on_cuda and not (fa2_available() or fa4_available()):
            raise AttentionBackendError("attention='flash' on CUDA needs flash-attn 2 (pip install "
                                        "'specdraft[flash]') or FlashAttention 4 on Hopper/Blackwell "
                                        "(pip install 'specdraft[flash4]'); or use attention='sdpa'")
        if not on_cuda and not cpu_flash_available():
            raise AttentionBackendError("attention='flash' on CPU needs torch's CPU flash kernel "
                                        "(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu), "
                                        f"which torch {torch.__version__} lacks; use attention='sdpa'")
        requested = register_flash_backend()
    if requested != current:
        if not hasattr(model, "set_attn_implementation"):
            raise AttentionBackendError(
                f"this transformers version cannot switch a loaded model's attention; load it with "
                f"attn_implementation={requested!r}")
        model.set_attn_implementation(requested)
        if getattr(model.config, "_attn_implementation", None) != requested:
            raise AttentionBackendError(f"{type(model).__name__} did not accept attn_implementation={requested!r}")
    return requested
