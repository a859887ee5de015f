"""Sampling settings, resolved and applied exactly as ``model.generate`` would.

Exactness under sampling needs two things: the same settings (a model's ``generation_config``
supplies defaults, ``do_sample=True`` alone means ``top_k=50`` unless that config says
otherwise), and the same logits processing per position, with the position's *own* prefix
(repetition penalty depends on it). We build transformers' own public processor classes in
transformers' order and apply them per tree node with that node's prefix.

Options we cannot honour raise :class:`UnsupportedOptionError`; nothing is silently dropped.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


class UnsupportedOptionError(ValueError):
    """A generation option specdraft cannot apply losslessly (or does not know)."""


#: Options ``Decoder.generate`` accepts besides the prompt.
SUPPORTED_OPTIONS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty")

#: Values transformers uses when neither the caller nor the model's generation config sets one.
_GLOBAL_DEFAULTS: dict[str, Any] = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
                                    "min_p": None, "repetition_penalty": 1.0}

#: generation_config fields that change the token distribution and that we do not implement.
#: A model whose own generation config sets one of these is refused rather than decoded wrongly.
_UNSUPPORTED_IF_SET: dict[str, Callable[[Any], bool]] = {
    "num_beams": lambda v: v is not None and v > 1,
    "typical_p": lambda v: v is not None and v < 1.0,
    "epsilon_cutoff": lambda v: v is not None and 0.0 < v < 1.0,
    "eta_cutoff": lambda v: v is not None and 0.0 < v < 1.0,
    "guidance_scale": lambda v: v is not None and v != 1,
    "encoder_repetition_penalty": lambda v: v is not None and v != 1.0,
    # set when truthy (a size, a length, a switch)
    **dict.fromkeys(("no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "min_length", "min_new_tokens",
                     "renormalize_logits", "remove_invalid_values"), bool),
    # set when given at all
    **dict.fromkeys(("bad_words_ids", "sequence_bias", "top_h", "forced_bos_token_id", "forced_eos_token_id",
                     "suppress_tokens", "begin_suppress_tokens", "exponential_decay_length_penalty",
                     "watermarking_config"), lambda v: v is not None),
}

#: Options whose meaning only exists under sampling; passing one with greedy decoding raises.
_SAMPLING_ONLY = {"temperature": 1.0, "top_k": None, "top_p": 1.0, "min_p": None}


@dataclass(frozen=True)
class SamplingSettings:
    """The resolved settings of one generation."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature is None or not self.temperature > 0:
            raise UnsupportedOptionError(f"temperature must be > 0, got {self.temperature!r} (use do_sample=False for greedy)")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise UnsupportedOptionError(f"top_k must be a non-negative int or None, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise UnsupportedOptionError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise UnsupportedOptionError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not self.repetition_penalty > 0:
            raise UnsupportedOptionError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")

    @property
    def needs_prefix(self) -> bool:
        """Whether processing a node's logits depends on the node's prefix."""
        return self.repetition_penalty != 1.0

    def warpers(self) -> list[Any]:
        """transformers' warpers for these settings, in ``_get_logits_processor`` order (the
        repetition penalty, which comes before them there, :class:`NodeScorer` applies itself)."""
        warpers: list[Any] = []
        if self.do_sample:
            if self.temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(self.temperature))
            if self.top_k is not None and self.top_k != 0:
                warpers.append(TopKLogitsWarper(top_k=self.top_k, min_tokens_to_keep=1))
            if self.top_p < 1.0:
                warpers.append(TopPLogitsWarper(top_p=self.top_p, min_tokens_to_keep=1))
            if self.min_p is not None:
                warpers.append(MinPLogitsWarper(min_p=self.min_p, min_tokens_to_keep=1))
        return warpers


def resolve_settings(generation_config: GenerationConfig | None, **requested: Any) -> SamplingSettings:
    """Merge the caller's options over the model's generation config over transformers' defaults.

    ``requested`` holds what the caller passed (``None`` meaning "not given"). Unknown names and
    options we cannot apply raise :class:`UnsupportedOptionError` naming them.
    """
    unknown = sorted(set(requested) - set(SUPPORTED_OPTIONS))
    if unknown:
        known_hf = [u for u in unknown if hasattr(GenerationConfig(), u)]
        if known_hf:
            raise UnsupportedOptionError(
                f"generation option(s) {known_hf} are not supported by specdraft (they cannot be applied losslessly "
                f"to a token tree yet); supported options: {list(SUPPORTED_OPTIONS)}"
            )
        raise UnsupportedOptionError(f"unknown generation option(s) {unknown}; supported options: {list(SUPPORTED_OPTIONS)}")

    model_cfg = generation_config.to_dict() if generation_config is not None else {}
    for name, is_set in _UNSUPPORTED_IF_SET.items():
        value = model_cfg.get(name)
        if is_set(value):
            raise UnsupportedOptionError(
                f"the model's generation_config sets {name}={value!r}, which specdraft does not support; "
                f"reset it (model.generation_config.{name} = None) to decode without it"
            )

    for name, value in requested.items():
        _check_type(name, value)

    def pick(name: str) -> Any:
        if requested.get(name) is not None:
            return requested[name]
        if model_cfg.get(name) is not None:
            return model_cfg[name]
        return _GLOBAL_DEFAULTS[name]

    do_sample = bool(pick("do_sample"))
    if not do_sample:
        conflicting = {k: v for k, v in requested.items() if k in _SAMPLING_ONLY and v is not None and v != _SAMPLING_ONLY[k]}
        if conflicting:
            raise UnsupportedOptionError(
                f"{conflicting} only apply when sampling; pass do_sample=True, or drop them for greedy decoding"
            )
        return SamplingSettings(do_sample=False, repetition_penalty=float(pick("repetition_penalty")))
    top_k = pick("top_k")
    return SamplingSettings(
        do_sample=True,
        temperature=float(pick("temperature")),
        top_k=int(top_k) if top_k is not None else None,
        top_p=float(pick("top_p")),
        min_p=pick("min_p"),
        repetition_penalty=float(pick("repetition_penalty")),
    )


def _check_type(name: str, value: Any) -> None:
    """Refuse an option of the wrong type by name (``do_sample="yes"``, ``top_k=2.5``,
    ``temperature="hot"``) instead of letting ``bool()`` / ``float()`` take or garble it."""
    if value is None:
        return
    if name == "do_sample":
        if not isinstance(value, (bool, np.bool_)):
            raise UnsupportedOptionError(f"do_sample must be True, False or None, got {value!r}")
    elif name == "top_k":
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 0:
            raise UnsupportedOptionError(f"top_k must be an int >= 0 or None, got {value!r}")
    elif isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(float(value)):
        raise UnsupportedOptionError(f"{name} must be a finite number or None, got {value!r}")


class PenaltyPrefix:
    """The committed sequence as a repetition penalty sees it: the set of tokens it holds, as a
    bool mask ``[vocab]`` on the logits' device, grown in place as tokens commit.

    A penalty depends on which tokens a position's prefix holds, not on their order or count, so a
    node's prefix is this mask plus the tokens on its own path: the work per node is
    O(vocabulary), whatever the context (a token-id list of the whole prefix per node grows with
    it). ``prefix + walked`` (what the verifiers write for a node's input ids) gives that node's
    :class:`NodeIds`.
    """

    def __init__(self, vocab_size: int, device: torch.device, tokens: Sequence[int] = ()) -> None:
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        #: the committed tokens themselves (the caller's live sequence), for code that wants the
        #: list (the reference verifiers of the exactness tests); the decoding path reads only
        #: :attr:`seen`
        self.tokens = tokens

    def add(self, ids: torch.Tensor | Sequence[int]) -> None:
        """Mark ``ids`` (a tensor on the mask's device, or host ints on a CPU) as seen."""
        if not isinstance(ids, torch.Tensor):
            ids = torch.as_tensor(list(ids), dtype=torch.long, device=self.seen.device)
        if ids.numel():
            self.seen.index_fill_(0, ids.reshape(-1), True)

    def __add__(self, walked: Sequence[int]) -> "NodeIds":
        return NodeIds(self, tuple(int(t) for t in walked))


@dataclass(frozen=True)
class NodeIds:
    """A tree node's input ids for a prefix-dependent processor: the committed prefix's token set
    plus the tokens walked from the root to the node."""

    prefix: PenaltyPrefix
    walked: tuple[int, ...]

    def mask(self) -> torch.Tensor:
        seen = self.prefix.seen
        if not self.walked:
            return seen
        mask = seen.clone()
        mask[list(self.walked)] = True
        return mask


class NodeScorer:
    """Turns a tree node's raw logits into processed scores, using the node's own prefix.

    ``prefix`` is the committed sequence (the root included); a node's input ids are that prefix
    followed by the tokens on the path from the root to the node, exactly what plain decoding
    would have as ``input_ids`` at that position. They come as a list of ids or, from the
    decoder, as :class:`NodeIds` (the prefix's token set on the device plus the walked tokens).

    The repetition penalty is applied through a mask of the tokens the prefix holds, with the
    arithmetic of transformers' ``RepetitionPenaltyLogitsProcessor`` (``score * penalty`` where
    negative, ``score / penalty`` elsewhere, on the masked tokens; transformers' own batched path
    is the same ``torch.where`` over a token mask); the warpers (temperature, top-k, top-p, min-p)
    are transformers' own classes, which do not read the ids. :meth:`process_rows` does it for
    many rows at once, each with its own mask: on an accelerator the decoder scores every tree
    node in one pass instead of one node per host round trip.
    """

    def __init__(self, settings: SamplingSettings) -> None:
        self.settings = settings
        self._warpers = settings.warpers()
        #: nothing to apply: the scores are the logits
        self.is_identity = not self._warpers and not settings.needs_prefix

    def __call__(self, logits_row: torch.Tensor, input_ids: Sequence[int] | NodeIds) -> torch.Tensor:
        scores = logits_row.to(torch.float32).reshape(1, -1).clone()
        if self.is_identity:
            return scores[0]
        if not self.settings.needs_prefix:
            return self.process_rows(scores, None)[0]
        if isinstance(input_ids, NodeIds):
            mask = input_ids.mask()
        else:
            mask = torch.zeros(scores.shape[-1], dtype=torch.bool, device=scores.device)
            ids = [int(t) for t in input_ids if 0 <= int(t) < scores.shape[-1]]
            mask[torch.as_tensor(ids, dtype=torch.long, device=scores.device)] = True  # (none: no-op)
        return self.process_rows(scores, mask[None])[0]

    def process_rows(self, scores: torch.Tensor, seen: torch.Tensor | None) -> torch.Tensor:
        """Processed scores of ``scores`` ``[rows, vocab]`` (float32), row ``i`` penalised on the
        tokens ``seen[i]`` marks (``seen`` ``[rows, vocab]`` bool; ``None`` without a penalty)."""
        penalty = self.settings.repetition_penalty
        if penalty != 1.0:
            if seen is None:
                raise ValueError("a repetition penalty needs each row's seen-token mask")
            penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
            scores = torch.where(seen, penalised, scores)
        if self._warpers:
            no_ids = torch.empty((scores.shape[0], 0), dtype=torch.long, device=scores.device)
            for warper in self._warpers:
                scores = warper(no_ids, scores)
        return scores
