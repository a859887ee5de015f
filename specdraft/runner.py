"""The model side: prefill, one tree forward over the KV cache, cache compaction.

Everything here goes through public transformers APIs on a stock, unpatched model: a 4D
attention mask ``[1, 1, q, cache_len + q]``, explicit ``position_ids`` and a ``DynamicCache``
subclass (:class:`SlotCache`) whose layers are written and compacted in place. That is what keeps specdraft working
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
from transformers.cache_utils import DynamicLayer

from .compat import cache_keyword
from .transfer import upload

#: Attention implementations that take our 4D tree mask correctly, with the mask kind they need
#: ("specdraft_split" is our own split + merge backend, see attention.py).
_MASK_KIND = {"sdpa": "bool", "eager": "additive", "specdraft_split": "bool", "specdraft_packed": "bool"}


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
        self.cache: SlotCache = SlotCache()
        self.cache_len = 0
        self._last_q = 0
        #: the prompt's ids on the device, from the last prefill (a repetition penalty starts from them)
        self.prefill_ids: torch.Tensor | None = None
        #: the riders of the last :meth:`forward`, on the device
        self.rider_tensors: list[torch.Tensor] = []

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

    def reset(self, capacity: int = 0) -> None:
        """Start a new request with an empty cache. The buffers of the last request are kept and
        reused (grown if ``capacity``, the most positions the request will need, exceeds them)."""
        self.cache.start_request(capacity)
        self.cache_len = 0
        self._last_q = 0

    @property
    def device(self) -> torch.device:
        """Where the model's inputs go (its first parameter's device)."""
        return self.model.device

    @torch.inference_mode()
    def prefill(self, token_ids: Sequence[int], capacity: int = 0) -> torch.Tensor | None:
        """Put ``token_ids`` into a fresh cache and return the logits ``[vocab]`` of the last one
        (``None`` for no tokens). ``capacity`` is the most positions the request will need, so the
        cache is allocated once (see :class:`SlotCache`).

        The decoder prefills the whole prompt and takes the first new token from these logits, as
        ``model.generate`` does: the same forward shape as its prefill, and no extra one-token
        forward for the prompt's last token (which costs a whole step, 7% of a 14-token answer).
        """
        self.reset(max(capacity, len(token_ids)))
        if not token_ids:
            return None
        n = len(token_ids)
        ids, positions = upload([np.asarray(token_ids, dtype=np.int64).reshape(1, n),
                                 np.arange(n, dtype=np.int64).reshape(1, n)], self.device)
        self.prefill_ids = ids[0]
        kwargs = {"logits_to_keep": 1} if self._takes_logits_to_keep else {}
        kwargs[self._cache_keyword] = self.cache
        out = self.model(input_ids=ids, position_ids=positions, use_cache=True, **kwargs)
        self.cache_len = n
        # the prompt's last token is the root of the first step, and its row is the one returned:
        # ``compact([0])`` after a prefill keeps the whole prompt, like after any other forward
        self._last_q = 1
        return _logits_for_decoding(out.logits[0, -1])

    # -- the step -------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], offsets: np.ndarray, block_mask: np.ndarray,
                riders: Sequence[np.ndarray] = ()) -> torch.Tensor:
        """Run ``tokens`` over the cache and return their logits ``[q, vocab]`` (float32, or the
        model's own bfloat16/float16, which float32 holds exactly: no full-width cast per step).

        ``offsets[i]`` is token ``i``'s position relative to ``cache_len`` (the root is 0);
        ``block_mask[i, j]`` says whether new token ``i`` attends to new token ``j``. Every new
        token sees the whole cache (inside the sliding window, where the model has one). The new
        tokens' keys/values are appended to the cache; call :meth:`compact` next.

        ``riders`` are host arrays the caller needs on the device this step; they travel in the
        same single upload as the step's ids, positions and mask and come back, on the device,
        in :attr:`rider_tensors`.
        """
        q = len(tokens)
        offsets = np.asarray(offsets, dtype=np.int64)
        if self.max_positions is not None and self.cache_len + int(offsets.max()) >= self.max_positions:
            raise ValueError(
                f"position {self.cache_len + int(offsets.max())} exceeds the model's context of {self.max_positions} tokens")
        parts = upload([np.asarray(tokens, dtype=np.int64).reshape(1, q), (offsets + self.cache_len).reshape(1, q),
                        np.asarray(block_mask, dtype=bool), *riders], self.device)
        ids, positions, block = parts[0], parts[1], parts[2]
        self.rider_tensors = parts[3:]
        if q == 1 and not self.has_sliding_window:
            mask = None  # a lone root attends to everything: the model's fast, maskless path
        else:
            mask = self._build_masks(positions[0], block)
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                         **{self._cache_keyword: self.cache})
        self.cache_len += q
        self._last_q = q
        return _logits_for_decoding(out.logits[0])

    def _build_masks(self, q_pos: torch.Tensor, block: torch.Tensor):
        """The 4D mask(s) for one forward: cache part, then the new tokens' own block (all made on
        the device from the uploaded block: nothing here copies from the host)."""
        P = self.cache_len
        q = q_pos.shape[0]
        allowed = torch.ones(q, P + q, dtype=torch.bool, device=block.device)  # the cache part: all seen
        allowed[:, P:] = block
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
        tokens, in increasing order, as a tree path is); drop the rest (rejected drafts, side
        blocks). The kept entries move down in place, a run of consecutive nodes at a time: the
        work is O(accepted tokens), whatever the context, and nothing is copied whole."""
        keep = [int(k) for k in keep]
        base = self.cache_len - self._last_q
        if self._last_q == 0 or any(not 0 <= k < self._last_q for k in keep) or \
                any(b <= a for a, b in zip(keep, keep[1:])):
            raise ValueError(f"keep {keep} must index the {self._last_q} tokens of the last forward, increasing")
        held = self.cache.get_seq_length()
        if held != self.cache_len:
            raise RuntimeError(f"KV cache holds {held} positions but {self.cache_len} were written; "
                               "this model's cache does not behave like a DynamicCache")
        self.cache.keep_rows(base, keep)
        self.cache_len = base + len(keep)
        self._last_q = 0


def _logits_for_decoding(logits: torch.Tensor) -> torch.Tensor:
    """Logits as decoding compares them: float32, as ``model.generate`` takes them. A float32,
    bfloat16 or float16 model's logits are returned as they are (float32 holds them exactly, so an
    argmax or top-k gives the same ids without a full-width cast every step); a float64 model's
    are rounded to float32, as ``model.generate`` rounds them (its greedy ties are float32 ties)."""
    if logits.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return logits
    return logits.to(torch.float32)


class _SlotLayer(DynamicLayer):
    """One layer's keys and values in a buffer allocated once per request (or kept from the last
    one), written in place.

    transformers' ``DynamicLayer`` concatenates every forward's new entries onto a new tensor: a
    copy of the whole layer per step, and a second copy's memory while it runs. Here
    :meth:`update` writes the new entries into the free slots and hands the attention a view of
    the filled part, and :meth:`keep_rows` moves a step's accepted entries down in place. The
    buffer doubles when a request outgrows it (the decoder sizes it from the prompt and
    ``max_new_tokens``, so that is rare). Everything else (``get_seq_length``, masks) reads the
    view, as it reads a ``DynamicLayer``'s tensors.
    """

    def __init__(self) -> None:
        super().__init__()
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._length = 0
        self.capacity_hint = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        n = key_states.shape[-2]
        end = self._length + n
        if self._key_buffer is None or end > self._key_buffer.shape[-2] \
                or self._key_buffer.shape[:-2] != key_states.shape[:-2] or self._key_buffer.dtype != key_states.dtype:
            self._grow(key_states, value_states, end)
        self._key_buffer[..., self._length : end, :].copy_(key_states)
        self._value_buffer[..., self._length : end, :].copy_(value_states)
        self._set_length(end)
        return self.keys, self.values

    def _grow(self, keys: torch.Tensor, values: torch.Tensor, needed: int) -> None:
        old_k, old_v = self._key_buffer, self._value_buffer
        same_kind = old_k is not None and old_k.shape[:-2] == keys.shape[:-2] and old_k.dtype == keys.dtype \
            and old_k.device == keys.device
        keep = self._length if same_kind else 0
        capacity = max(needed, self.capacity_hint, 2 * old_k.shape[-2] if same_kind else 0, 16)
        self._key_buffer = keys.new_empty((*keys.shape[:-2], capacity, keys.shape[-1]))
        self._value_buffer = values.new_empty((*values.shape[:-2], capacity, values.shape[-1]))
        if keep:
            self._key_buffer[..., :keep, :].copy_(old_k[..., :keep, :])
            self._value_buffer[..., :keep, :].copy_(old_v[..., :keep, :])
        self._length = keep
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def _set_length(self, length: int) -> None:
        self._length = length
        self.keys = self._key_buffer[..., :length, :]
        self.values = self._value_buffer[..., :length, :]

    def get_seq_length(self, *args, **kwargs) -> int:
        return self._length

    def start_request(self, capacity: int) -> None:
        """Empty the layer for a new request; its buffer stays (and grows at the next write if
        ``capacity`` exceeds it)."""
        self.capacity_hint = capacity
        if self._key_buffer is not None:
            if capacity > self._key_buffer.shape[-2]:
                self._key_buffer = self._value_buffer = None  # the next update allocates the new size
                self._length = 0
                self.keys = self.values = None
                self.is_initialized = False
            else:
                self._set_length(0)

    def keep_rows(self, base: int, keep: list[int]) -> None:
        """Keep rows ``[0, base)`` plus ``base + k`` for ``k`` in ``keep`` (increasing), moved to
        ``base, base + 1, ...``."""
        if self._key_buffer is None:
            return
        for dst, src, length in _runs(base, keep):
            for buf in (self._key_buffer, self._value_buffer):
                moved = buf[..., src : src + length, :]
                if src - dst < length:  # the two ranges overlap: copy out first
                    moved = moved.clone()
                buf[..., dst : dst + length, :].copy_(moved)
        self._set_length(base + len(keep))


def _runs(base: int, keep: list[int]) -> list[tuple[int, int, int]]:
    """The moves that bring rows ``base + keep[i]`` to ``base + i``, as (destination, source,
    length) runs of consecutive rows; rows already in place need none."""
    runs: list[tuple[int, int, int]] = []
    for i, k in enumerate(keep):
        if k == i:
            continue
        dst, src = base + i, base + k
        if runs and runs[-1][0] + runs[-1][2] == dst and runs[-1][1] + runs[-1][2] == src:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((dst, src, 1))
    return runs


class SlotCache(DynamicCache):
    """A ``DynamicCache`` whose layers are :class:`_SlotLayer`: written in place, compacted in
    place, reused across requests. It is a transformers cache object like any other (public
    ``Cache`` API: ``update``, ``get_seq_length``, ``layers``), so the model stays unpatched."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_class_to_replicate = _SlotLayer
        self._capacity = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:
            layer = _SlotLayer()
            layer.capacity_hint = self._capacity
            self.layers.append(layer)
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self, layer_idx: int | None = 0, *args, **kwargs) -> int:
        if not self.layers:
            return 0
        return self.layers[layer_idx or 0].get_seq_length()

    def start_request(self, capacity: int) -> None:
        self._capacity = capacity
        for layer in self.layers:
            layer.start_request(capacity)

    def keep_rows(self, base: int, keep: list[int]) -> None:
        for layer in self.layers:
            layer.keep_rows(base, keep)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions of every layer (for measurements that rerun a step)."""
        for layer in self.layers:
            layer.keep_rows(length, [])
