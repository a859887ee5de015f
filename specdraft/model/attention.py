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
    ``attn_implementation="specdraft_split"``. On CUDA part (a) runs flash-attn's kernel; on CPU it
    runs torch's own flash kernel, which also returns the log-sum-exp, so the whole backend runs and
    is tested here.

Ordinary steps (a prefill with no cache, a one-token decode) need no split: they go straight to
the flash kernel. A prefix part that is itself masked (sliding-window layers) is computed densely
with its mask and merged the same way, so windows stay exact.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

# No "flash" in the name: transformers gives names containing it special handling (padding-free
# masks, hub kernel loading) that would bypass our tree mask.
FLASH_NAME = "specdraft_split"

#: What ``Decoder(attention=...)`` accepts.
ATTENTION_CHOICES = ("auto", "sdpa", "eager", "flash", "exact")


class AttentionBackendError(RuntimeError):
    """The requested attention backend cannot run here; the message says what is missing."""


def flash_attn_available() -> bool:
    """Whether the flash-attn package (CUDA kernels) is importable."""
    return importlib.util.find_spec("flash_attn") is not None


def cpu_flash_available() -> bool:
    """Whether this torch build has its CPU flash kernel that returns the log-sum-exp."""
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


# -- kernels returning (out [B, H, q, D], lse [B, H, q]) -------------------------------------------


def _flash_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One flash-kernel call over [B, H, n, D] tensors (same head count), with its log-sum-exp."""
    if q.is_cuda:
        if not flash_attn_available():
            raise AttentionBackendError("the flash backend on CUDA needs the flash-attn package: pip install flash-attn")
        from flash_attn import flash_attn_func  # type: ignore[import-not-found]

        out, lse, _ = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                                      causal=causal, return_attn_probs=True)
        return out.transpose(1, 2), lse[..., : q.shape[2]]
    if not cpu_flash_available():
        raise AttentionBackendError("this torch build has no CPU flash kernel "
                                    "(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu); use attention='sdpa'")
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=None,
                                                                           scale=scale)[:2]
    return out, lse


def _dense_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention of q against k/v in float32 (or float64), with its log-sum-exp.

    Rows with nothing allowed get lse = -inf and a zero output, so they vanish in the merge.
    """
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = torch.matmul(q.to(work), k.to(work).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    return torch.matmul(weights, v.to(work)), lse


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


def _allowed(mask: torch.Tensor) -> torch.Tensor:
    """A bool "may attend" mask from either a bool or an additive float mask."""
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def tree_flash_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function (``AttentionInterface`` signature) for tree steps.

    ``query`` is ``[B, H, q, D]``, ``key``/``value`` ``[B, Hkv, kv, D]`` with the ``q`` new tokens
    last; ``attention_mask`` is the 4D mask ``[B, 1, q, kv]`` exactly as the decoder built it (or as
    transformers' sdpa mask builder made it for ordinary calls), so the prefix length is
    ``P = kv - q``. Returns ``([B, q, H, D], None)`` like transformers' own backends.
    """
    if dropout and module.training:
        raise AttentionBackendError("the flash tree backend does not implement attention dropout; call model.eval()")
    if kwargs.get("softcap") is not None or getattr(module, "attn_logit_softcapping", None) is not None:
        raise AttentionBackendError("the flash tree backend does not implement attention logit soft-capping; "
                                    "use attention='sdpa' for this model")
    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        raise AttentionBackendError("the flash tree backend does not implement attention sinks; use attention='sdpa'")
    batch, heads, q_len, head_dim = query.shape
    groups = heads // key.shape[1]
    if groups > 1:  # grouped-query attention: share each key/value head across its query heads
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    kv_len = key.shape[2]
    prefix = kv_len - q_len
    scale = scaling if scaling is not None else head_dim ** -0.5

    if attention_mask is None:
        if prefix == 0 or q_len == 1:  # plain prefill or one-token decode: the ordinary flash path
            out, _ = _flash_with_lse(query, key, value, scale, causal=q_len > 1)
            return out.transpose(1, 2).contiguous().to(query.dtype), None
        q_pos = torch.arange(prefix, kv_len, device=query.device)
        allowed = torch.arange(kv_len, device=query.device)[None, :] <= q_pos[:, None]
        allowed = allowed[None, None].expand(batch, 1, q_len, kv_len)
    else:
        allowed = _allowed(attention_mask[..., -kv_len:])
    allowed = allowed.expand(batch, heads, q_len, kv_len)

    new_out, new_lse = _dense_with_lse(query, key[:, :, prefix:], value[:, :, prefix:], scale, allowed[..., prefix:])
    if prefix == 0:
        return new_out.transpose(1, 2).contiguous().to(query.dtype), None
    prefix_allowed = allowed[..., :prefix]
    if bool(prefix_allowed.all()):
        old_out, old_lse = _flash_with_lse(query, key[:, :, :prefix], value[:, :, :prefix], scale, causal=False)
    else:  # a sliding window masks part of the prefix: keep it exact with a dense product
        old_out, old_lse = _dense_with_lse(query, key[:, :, :prefix], value[:, :, :prefix], scale, prefix_allowed)
    out = merge_partial_attention(old_out, old_lse, new_out, new_lse)
    return out.transpose(1, 2).contiguous().to(query.dtype), None


def register_flash_backend() -> str:
    """Register the tree flash backend with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(FLASH_NAME, tree_flash_attention)
    AttentionMaskInterface.register(FLASH_NAME, sdpa_mask)
    return FLASH_NAME


def select_attention(model: Any, requested: str) -> str:
    """Switch ``model`` to the requested backend and return the implementation name it now uses.

    ``auto`` picks ``flash`` on CUDA with flash-attn installed; otherwise it keeps the model's own
    ``sdpa`` or ``eager`` and switches anything else to ``sdpa``. ``flash`` where it cannot run
    raises :class:`AttentionBackendError` naming what is missing. ``exact`` is the attention of
    exact mode (:mod:`specdraft.model.exact_attention`).
    """
    if requested not in ATTENTION_CHOICES:
        raise ValueError(f"attention must be one of {list(ATTENTION_CHOICES)}, got {requested!r}")
    current = getattr(model.config, "_attn_implementation", None)
    on_cuda = getattr(model, "device", torch.device("cpu")).type == "cuda"
    if requested == "auto":
        if on_cuda and flash_attn_available():
            requested = "flash"
        elif current in ("sdpa", "eager", FLASH_NAME):
            return current
        else:
            requested = "sdpa"
    if requested == "exact":
        from .exact_attention import register_exact_backend

        requested = register_exact_backend()
    if requested == "flash":
        if on_cuda and not flash_attn_available():
            raise AttentionBackendError("attention='flash' on CUDA needs the flash-attn package "
                                        "(pip install 'specdraft[flash]'); or use attention='sdpa'")
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
