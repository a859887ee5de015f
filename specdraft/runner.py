"""The model side: prefill, one tree forward over the KV cache, cache compaction.

Everything here goes through public transformers APIs on a stock, unpatched model: a 4D
attention mask ``[1, 1, q, cache_len + q]``, explicit ``position_ids`` and a ``DynamicCache``
whose per-layer keys/values we trim with ``index_select``. That is what keeps specdraft working
across transformers releases where peers patch modeling files.

Facts this module relies on (checked on transformers 5.23, see DESIGN.md):

* a 4D mask reaches every layer unchanged; ``sdpa`` takes a bool mask, ``eager`` needs an
  additive float mask (a bool mask is silently wrong there), so eager always gets additive;
* HF's flash-attention integration misreads a tree mask as padding, so ``flash_attention_2`` is
  refused here (specdraft's own flash backend plugs in through the attention registry instead);
* sliding-window caches keep only the window and reject a full-width mask, so we always use a
  plain ``DynamicCache()`` and write the window into the mask ourselves; hybrid models
  (some layers sliding, some full) receive a dict of masks keyed by layer type.
"""

from __future__ import annotations

import inspect
from typing import Sequence

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from .compat import cache_keyword

#: Attention implementations that take our 4D tree mask correctly, with the mask kind they need
#: ("specdraft_split" is our own split + merge backend, see attention.py).
_MASK_KIND = {"sdpa": "bool", "eager": "additive", "specdraft_split": "bool"}


class UnsupportedModelError(ValueError):
    """The model cannot be decoded losslessly by specdraft (and we say why rather than guess)."""


def _text_config(model: PreTrainedModel):
    cfg = model.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def context_limit(model: PreTrainedModel) -> int | None:
    """The most positions the model can attend over (``max_position_embeddings``, or GPT-2's
    ``n_positions``); ``None`` when its config does not say."""
    if getattr(model, "config", None) is None:
        return None
    text = _text_config(model)
    return getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)


class ModelRunner:
    """Owns the KV cache of one request and runs forwards of (tree + side block) tokens over it.

    Positions in the cache are absolute token positions: slot ``i`` holds the token at position
    ``i`` of the committed sequence. Tree tokens go in after ``cache_len`` and are trimmed away
    again by :meth:`compact`, which keeps only the accepted path.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        config = model.config
        if getattr(config, "is_encoder_decoder", False):
            raise UnsupportedModelError(
                f"{type(model).__name__} is an encoder-decoder model; specdraft decodes causal LMs only "
                "(load with AutoModelForCausalLM)")
        if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
            raise UnsupportedModelError(
                f"{type(model).__name__} has no language-modeling head; load the model with AutoModelForCausalLM")
        if not (hasattr(model, "can_generate") and model.can_generate()):
            raise UnsupportedModelError(
                f"{type(model).__name__} is not a causal language model that can generate (e.g. a masked LM); "
                "load a decoder with AutoModelForCausalLM")
        impl = getattr(config, "_attn_implementation", None) or "eager"
        if impl not in _MASK_KIND:
            raise UnsupportedModelError(
                f"attention implementation {impl!r} cannot take a tree mask losslessly; load the model with "
                f"attn_implementation='sdpa' or 'eager' (supported: {sorted(_MASK_KIND)})")
        self.model = model
        self.mask_kind = _MASK_KIND[impl]
        text = _text_config(model)
        self.vocab_size: int = int(text.vocab_size)
        self.max_positions: int | None = context_limit(model)
        self._layer_windows = self._read_layer_windows(text)
        try:
            self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            self._takes_logits_to_keep = False
        #: ``cache`` from transformers 5.24, ``past_key_values`` before (see :mod:`specdraft.compat`)
        self._cache_keyword = cache_keyword(model)
        self.cache: DynamicCache = DynamicCache()
        self.cache_len = 0
        self._last_q = 0

    # -- model facts -----------------------------------------------------------------------

    @staticmethod
    def _read_layer_windows(text) -> dict[str, int | None]:
        """Map each attention layer type to its sliding window (None = full attention)."""
        window = getattr(text, "sliding_window", None)
        layer_types = getattr(text, "layer_types", None)
        if layer_types:
            kinds = set(layer_types)
            unknown = kinds - {"full_attention", "sliding_attention"}
            if unknown:
                raise UnsupportedModelError(
                    f"layer types {sorted(unknown)} are not supported yet (supported: full_attention, sliding_attention)")
            if "sliding_attention" in kinds and not window:
                raise UnsupportedModelError("the config has sliding_attention layers but no sliding_window size")
            return {k: (window if k == "sliding_attention" else None) for k in kinds}
        if window and getattr(text, "use_sliding_window", True):
            # e.g. Mistral: one window applies to every layer.
            return {"": int(window)}
        return {"": None}

    @property
    def has_sliding_window(self) -> bool:
        return any(w is not None for w in self._layer_windows.values())

    # -- cache lifecycle ----------------------------------------------------------------------

    def reset(self) -> None:
        """Start a new request with an empty cache."""
        self.cache = DynamicCache()
        self.cache_len = 0
        self._last_q = 0

    @torch.inference_mode()
    def prefill(self, token_ids: Sequence[int]) -> torch.Tensor | None:
        """Put ``token_ids`` into a fresh cache and return the float32 logits ``[vocab]`` of the
        last one (``None`` for no tokens).

        The decoder prefills the whole prompt and takes the first new token from these logits, as
        ``model.generate`` does: the same forward shape as its prefill, and no extra one-token
        forward for the prompt's last token (which costs a whole step, 7% of a 14-token answer).
        """
        self.reset()
        if not token_ids:
            return None
        device = self.model.device
        ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=device).unsqueeze(0)
        positions = torch.arange(ids.shape[1], device=device).unsqueeze(0)
        kwargs = {"logits_to_keep": 1} if self._takes_logits_to_keep else {}
        kwargs[self._cache_keyword] = self.cache
        out = self.model(input_ids=ids, position_ids=positions, use_cache=True, **kwargs)
        self.cache_len = ids.shape[1]
        # the prompt's last token is the root of the first step, and its row is the one returned:
        # ``compact([0])`` after a prefill keeps the whole prompt, like after any other forward
        self._last_q = 1
        return out.logits[0, -1].to(torch.float32)

    # -- the step -------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], offsets: np.ndarray, block_mask: np.ndarray) -> torch.Tensor:
        """Run ``tokens`` over the cache and return their float32 logits ``[q, vocab]``.

        ``offsets[i]`` is token ``i``'s position relative to ``cache_len`` (the root is 0);
        ``block_mask[i, j]`` says whether new token ``i`` attends to new token ``j``. Every new
        token sees the whole cache (inside the sliding window, where the model has one). The new
        tokens' keys/values are appended to the cache; call :meth:`compact` next.
        """
        q = len(tokens)
        device = self.model.device
        offsets = np.asarray(offsets, dtype=np.int64)
        if self.max_positions is not None and self.cache_len + int(offsets.max()) >= self.max_positions:
            raise ValueError(
                f"position {self.cache_len + int(offsets.max())} exceeds the model's context of {self.max_positions} tokens")
        ids = torch.as_tensor(list(tokens), dtype=torch.long, device=device).unsqueeze(0)
        positions = torch.as_tensor(offsets + self.cache_len, device=device).unsqueeze(0)
        if q == 1 and not self.has_sliding_window:
            mask = None  # a lone root attends to everything: the model's fast, maskless path
        else:
            mask = self._build_masks(positions[0], torch.as_tensor(np.asarray(block_mask, dtype=bool), device=device))
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                         **{self._cache_keyword: self.cache})
        self.cache_len += q
        self._last_q = q
        return out.logits[0].to(torch.float32)

    def _build_masks(self, q_pos: torch.Tensor, block: torch.Tensor):
        """The 4D mask(s) for one forward: cache part, then the new tokens' own block."""
        P = self.cache_len
        q = q_pos.shape[0]
        allowed = torch.cat([torch.ones(q, P, dtype=torch.bool, device=block.device), block], dim=1)
        masks = {}
        for kind, window in self._layer_windows.items():
            m = allowed
            if window is not None:
                k_pos = torch.cat([torch.arange(P, device=block.device), q_pos])
                m = m & ((q_pos[:, None] - k_pos[None, :]) < window)
            masks[kind] = self._as_model_mask(m)
        if set(masks) == {""}:
            return masks[""]
        return masks

    def _as_model_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        allowed = allowed[None, None]
        if self.mask_kind == "bool":
            return allowed
        dtype = self.model.dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)

    @torch.inference_mode()
    def compact(self, keep: Sequence[int]) -> None:
        """Keep the committed cache plus the new entries ``keep`` (indices into the last forward's
        tokens, in path order); drop the rest (rejected drafts, side blocks)."""
        keep = [int(k) for k in keep]
        base = self.cache_len - self._last_q
        if self._last_q == 0 or any(not 0 <= k < self._last_q for k in keep):
            raise ValueError(f"keep {keep} must index the {self._last_q} tokens of the last forward")
        layers = _cache_layers(self.cache)
        if layers and layers[0][0].shape[-2] != self.cache_len:
            raise RuntimeError(f"KV cache holds {layers[0][0].shape[-2]} positions but {self.cache_len} were written; "
                               "this model's cache does not behave like a DynamicCache")
        new_len = base + len(keep)
        contiguous = keep == list(range(len(keep)))
        if not contiguous:
            idx = torch.as_tensor(list(range(base)) + [base + k for k in keep], device=layers[0][0].device)
        for i, (keys, values) in enumerate(layers):
            if contiguous:  # the accepted entries already follow the prefix: cut the tail
                _set_layer(self.cache, i, keys[..., :new_len, :], values[..., :new_len, :])
            else:
                _set_layer(self.cache, i, keys.index_select(-2, idx), values.index_select(-2, idx))
        self.cache_len = new_len
        self._last_q = 0


def _cache_layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys, values) across cache API versions (``layers`` from 4.56, lists before)."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers if getattr(layer, "keys", None) is not None]
    return list(zip(cache.key_cache, cache.value_cache))


def _set_layer(cache: DynamicCache, i: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    if hasattr(cache, "layers"):
        cache.layers[i].keys = keys
        cache.layers[i].values = values
    else:
        cache.key_cache[i] = keys
        cache.value_cache[i] = values
