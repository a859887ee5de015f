"""specdraft inside ``model.generate``: a decoding loop for transformers' ``custom_generate``.

Code that already calls ``model.generate(**inputs, ...)`` (directly, through a pipeline, with
streamers, generation config files and stopping criteria) gets speculative decoding by adding one
argument::

    import specdraft.hf

    out = model.generate(**inputs, max_new_tokens=128, custom_generate=specdraft.hf.loop())

transformers prepares the call as usual (it merges the generation config, left-pads the batch,
builds the logits processors and the stopping criteria) and hands the decoding loop to the
callable. The loop reads what transformers built, checks that every piece of it can be applied
exactly per token-tree node, and decodes with a :class:`~specdraft.Decoder` (one request alone,
or a batch through :meth:`~specdraft.Decoder.stream_batch`). It returns what ``generate``
returns: the prompt plus the new tokens, finished rows padded as ``generate`` pads them, or a
``GenerateDecoderOnlyOutput`` when ``return_dict_in_generate=True``.

Why each piece is exact:

- **Processors** are read back into sampling settings (repetition penalty, temperature, top-k,
  top-p, min-p), which the decoder applies per tree node with the node's own prefix, in
  transformers' order. Any other processor, or one of these with parameters the decoder cannot
  reproduce, raises :class:`~specdraft.UnsupportedOptionError` naming it.
- **Minimum lengths** (``min_new_tokens``, ``min_length``) forbid EOS for the first tokens.
  Those tokens are decoded by transformers' own ``generate`` with the very processors it built,
  then the decoder continues from there: the ban is inactive afterwards, so nothing is
  approximated.
- **Stopping criteria** are evaluated on the committed tokens the way ``generate``'s loop does:
  once per generated position, on the whole batch's ``input_ids`` (finished rows padded), in
  order. A step of the decoder may commit several tokens at once; they are replayed one position
  at a time, and what a criterion cuts off is never returned nor streamed. Criteria receive
  ``scores=None``: the committed tokens are exact, per-position scores are not computed.
- **The streamer** receives the prompt, then one ``[batch]`` tensor per generated position, then
  ``end()``, as from ``generate``.

:func:`generate` is the same decoding as a complete ``generate`` replacement (what
``custom_generate/generate.py`` in this repository exposes). Use it, or the folder, where
transformers does not hand a streamer or a tokenizer to a ``custom_generate`` callable
(transformers 5.x calls the callable without ``streamer`` and cannot build stop strings for it).
"""

from __future__ import annotations

import copy
import inspect
import threading
import weakref
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from transformers import GenerationConfig
from transformers.generation import GenerateDecoderOnlyOutput, GenerationMixin
from transformers.generation.logits_process import (
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)

from specdraft import Decoder, GenerationStats, SamplingSettings, UnsupportedOptionError
from specdraft.checks import check_int
from specdraft.sources import DraftSource

# The one private name used here: what the decoder resolves a call's options to, so that this
# module can check that the decoder will apply exactly the settings transformers asked for.
from specdraft.sampling import resolve_settings as _engine_settings

__all__ = ["SpecdraftLoop", "loop", "generate"]

#: The processors the decoder applies, in the order transformers builds them (and the decoder applies them):
#: each one's decoder option, the attribute holding its value, the value's type and the option's value without
#: it. All but the repetition penalty are sampling warpers.
_APPLIED: dict[type, tuple[str, str, type, Any]] = {
    RepetitionPenaltyLogitsProcessor: ("repetition_penalty", "penalty", float, 1.0),
    TemperatureLogitsWarper: ("temperature", "temperature", float, 1.0),
    TopKLogitsWarper: ("top_k", "top_k", int, 0),
    TopPLogitsWarper: ("top_p", "top_p", float, 1.0),
    MinPLogitsWarper: ("min_p", "min_p", float, None)}

#: Model inputs transformers prepares for a decoder-only loop, beyond ``input_ids``, that the loop
#: reads or that carry nothing the decoder must reproduce (``logits_to_keep`` and ``use_cache``
#: change how logits are computed, not which; the cache is checked to be empty).
_KNOWN_MODEL_INPUTS = frozenset({"attention_mask", "position_ids", "cache", "past_key_values", "use_cache",
                                 "logits_to_keep", "cache_position", "output_attentions", "output_hidden_states"})

#: Cache implementations whose keys and values are exact: the decoder's own cache gives the same
#: logits. Quantized or offloaded caches would change them, so they are refused.
_EXACT_CACHES = frozenset({None, "dynamic", "static"})


# -- reading what transformers built ------------------------------------------------------------


@dataclass
class _Rows:
    """The batch as the decoder sees it: each row's prompt without its left padding."""

    input_ids: torch.Tensor  # [batch, length], as transformers handed it (left-padded)
    pads: list[int]  # leading padding positions of each row
    prompts: list[list[int]]  # each row's tokens after its padding

    @classmethod
    def read(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
             position_ids: torch.Tensor | None) -> "_Rows":
        if input_ids is None or input_ids.dim() != 2 or input_ids.shape[1] == 0:
            shape = None if input_ids is None else tuple(input_ids.shape)
            raise UnsupportedOptionError(f"specdraft.hf needs input_ids of shape [batch, length >= 1], got {shape}; "
                                         "inputs_embeds alone cannot be decoded speculatively")
        batch, length = input_ids.shape
        if attention_mask is not None and tuple(attention_mask.shape) != (batch, length):
            raise UnsupportedOptionError(f"attention_mask must have the shape of input_ids {(batch, length)}, "
                                         f"got {tuple(attention_mask.shape)}")
        mask = (torch.ones((batch, length), dtype=torch.long) if attention_mask is None
                else attention_mask.detach().to("cpu", torch.long))
        ids = input_ids.detach().to("cpu", torch.long)
        custom_positions = position_ids is not None and tuple(position_ids.shape) == (batch, length)
        pads, prompts = [], []
        for row in range(batch):
            m = mask[row].tolist()
            pad = m.count(0)
            if m != [0] * pad + [1] * (length - pad):
                raise UnsupportedOptionError(
                    f"attention_mask row {row} is {m}: only left padding (zeros, then ones) is supported; "
                    "tokenize with padding_side='left', as decoder-only generation needs")
            if pad == length:
                raise UnsupportedOptionError(f"row {row} of the batch is all padding: give every row at least one token")
            if custom_positions and position_ids[row, pad:].tolist() != list(range(length - pad)):
                raise UnsupportedOptionError(
                    f"position_ids of row {row} are {position_ids[row, pad:pad + 8].tolist()}...: the "
                    "decoder numbers each prompt's tokens 0, 1, 2, ... after its padding, as generate does; "
                    "custom positions are not supported")
            pads.append(pad)
            prompts.append(ids[row, pad:].tolist())
        return cls(input_ids, pads, prompts)


@dataclass
class _Processors:
    """What the logits processors transformers built mean for the decoder."""

    options: dict[str, Any]  # the decoder's sampling options
    expected: SamplingSettings  # what the decoder must resolve them to
    min_tokens: int  # new tokens during which EOS is banned (decoded by transformers itself)


def _read_processors(processors: Sequence[Any], do_sample: bool, rows: _Rows) -> _Processors:
    """Map each processor to a decoder setting, refusing what cannot be applied exactly."""
    length = rows.input_ids.shape[1]
    order = list(_APPLIED)
    applied: dict[type, Any] = {}  # in the order given, which must be the decoder's
    min_tokens = 0
    for processor in processors:
        kind = type(processor)
        name = kind.__name__
        if kind is MinLengthLogitsProcessor:
            min_tokens = max(min_tokens, int(processor.min_length) - length)
        elif kind is MinNewTokensLengthLogitsProcessor:
            min_tokens = max(min_tokens, int(processor.prompt_length_to_skip) + int(processor.min_new_tokens) - length)
        elif kind not in _APPLIED:
            raise UnsupportedOptionError(
                f"logits processor {name} cannot be applied exactly per token-tree node by specdraft; "
                "supported: RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, "
                "TopPLogitsWarper, MinPLogitsWarper, MinLengthLogitsProcessor, "
                "MinNewTokensLengthLogitsProcessor (generation options repetition_penalty, temperature, top_k, "
                "top_p, min_p, min_length, min_new_tokens)")
        elif kind is not RepetitionPenaltyLogitsProcessor and not do_sample:
            raise UnsupportedOptionError(f"{name} is a sampling warper, but do_sample=False (greedy decoding "
                                         "takes the argmax of the logits)")
        elif kind in applied:
            raise UnsupportedOptionError(f"two {name} processors: the decoder applies each processor once")
        elif applied and order.index(list(applied)[-1]) > order.index(kind):
            raise UnsupportedOptionError(
                f"{name} comes after {list(applied)[-1].__name__}: the decoder applies the repetition "
                "penalty, temperature, top-k, top-p and min-p in that order (transformers' order); build "
                "them in it, or set them in the generation config")
        else:
            if kind is RepetitionPenaltyLogitsProcessor:
                _check_penalty_prefix(processor, rows)
            elif kind is not TemperatureLogitsWarper:
                # top-k folds min_tokens_to_keep into top_k itself (max of the two)
                keep = 1 if kind is TopKLogitsWarper else processor.min_tokens_to_keep
                if processor.filter_value != -float("inf") or keep != 1:
                    raise UnsupportedOptionError(
                        f"{name}(filter_value={processor.filter_value}, min_tokens_to_keep={keep}) "
                        "is not supported: the decoder filters to -inf and keeps at least 1 token, as generate "
                        "does with num_beams=1")
            applied[kind] = processor
    options: dict[str, Any] = {"do_sample": do_sample}
    for kind, (option, attribute, cast, default) in _APPLIED.items():
        if do_sample or kind is RepetitionPenaltyLogitsProcessor:
            options[option] = cast(getattr(applied[kind], attribute)) if kind in applied else default
    return _Processors(options, SamplingSettings(**options), min_tokens)


def _check_penalty_prefix(processor: Any, rows: _Rows) -> None:
    """The decoder penalises every token of a row's unpadded prompt and output. transformers may
    skip leading positions (``prompt_ignore_length``: its own padding from 5.x on, or what a user
    asked) or, in older releases, count the padding too; refuse where that differs."""
    if getattr(processor, "logits_indices", None) is not None or getattr(processor, "cu_seq_lens_q", None) is not None:
        raise UnsupportedOptionError("RepetitionPenaltyLogitsProcessor set up for continuous batching "
                                     "(logits_indices) is not supported")
    ignore = getattr(processor, "prompt_ignore_length", None)
    length = rows.input_ids.shape[1]
    ids = rows.input_ids.detach().to("cpu")
    per_row = isinstance(ignore, torch.Tensor) and ignore.numel() > 1
    for row, pad in enumerate(rows.pads):
        skip = 0 if ignore is None else int(ignore.reshape(-1)[row] if per_row else ignore)
        if skip > length:
            raise UnsupportedOptionError(f"RepetitionPenaltyLogitsProcessor(prompt_ignore_length={skip}) would ignore "
                                         f"generated tokens (the prompt has {length}); not supported")
        seen = set(ids[row, skip:].tolist())
        mine = set(ids[row, pad:].tolist())
        if seen != mine:
            raise UnsupportedOptionError(
                f"RepetitionPenaltyLogitsProcessor penalises tokens {sorted(seen ^ mine)[:5]} of row {row}'s prompt "
                f"differently from the decoder (it skips {skip} leading positions; the row has {pad} of padding). "
                "transformers before 5.x penalises the padding tokens of left-padded rows; upgrade transformers, "
                "or batch prompts of equal length")


def _config_settings(config: GenerationConfig) -> SamplingSettings:
    """The settings the processors generate builds from ``config`` alone would carry (its rules
    for which processor it adds), to tell them from processors a caller passed to generate."""
    penalty = 1.0 if config.repetition_penalty is None else float(config.repetition_penalty)
    if not config.do_sample:
        return SamplingSettings(do_sample=False, repetition_penalty=penalty)
    temperature = float(config.temperature) if config.temperature is not None and config.temperature != 1.0 else 1.0
    top_k = max(int(config.top_k), 1) if config.top_k is not None and config.top_k != 0 else 0
    top_p = float(config.top_p) if config.top_p is not None and config.top_p < 1.0 else 1.0
    min_p = float(config.min_p) if getattr(config, "min_p", None) is not None else None
    return SamplingSettings(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            repetition_penalty=penalty)


def _check_config(config: GenerationConfig, model: Any) -> None:
    """Refuse generation options that change the decoding method itself (the processors and the
    criteria are read separately)."""
    def refuse(option: str, why: str, when: Callable[[Any], bool] = lambda value: value is not None) -> None:
        value = getattr(config, option, None)
        if when(value):
            raise UnsupportedOptionError(f"{option}={value!r} is not supported by specdraft.hf: {why}")

    def above_one(value: Any) -> bool:
        return (value or 1) > 1

    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedOptionError("specdraft.hf decodes decoder-only models; this model is encoder-decoder")
    refuse("num_beams", "beam search keeps several hypotheses; use num_beams=1", above_one)
    refuse("num_beam_groups", "group beam search; use num_beams=1", above_one)
    refuse("penalty_alpha", "contrastive search needs hidden states per candidate",
           lambda value: bool(value) and (getattr(config, "top_k", None) or 0) > 1)
    refuse("dola_layers", "DoLa contrasts early-exit layers")
    refuse("prompt_lookup_num_tokens", "specdraft is the speculative decoder here; pass its sources to "
                                       "specdraft.hf.loop (PromptLookup is one of the defaults)")
    refuse("assistant_early_exit", "self-speculation by early exit")
    refuse("num_return_sequences", "greedy decoding returns one sequence per prompt",
           lambda value: not config.do_sample and above_one(value))
    refuse("cache_implementation", f"the decoder keeps its own exact cache; supported: "
                                   f"{sorted(c for c in _EXACT_CACHES if c)} or None",
           lambda value: value not in _EXACT_CACHES)
    for option in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
        refuse(option, "the decoder computes logits for a token tree, not the per-position scores, logits, attentions "
                       "or hidden states generate returns; recompute them with one forward over the returned sequences",
               lambda value: bool(config.return_dict_in_generate and value))


def _check_model_inputs(model_kwargs: dict[str, Any]) -> None:
    unknown = sorted(k for k, v in model_kwargs.items() if k not in _KNOWN_MODEL_INPUTS and v is not None)
    if unknown:
        raise UnsupportedOptionError(f"model inputs {unknown} are not supported by specdraft.hf: the decoder runs "
                                     "the model on token ids with its own mask, positions and cache")
    for name in ("cache", "past_key_values"):
        cache = model_kwargs.get(name)
        if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
            raise UnsupportedOptionError(f"a {name} that already holds {cache.get_seq_length()} positions: "
                                         "specdraft.hf starts from the prompt; pass the whole prompt instead")


def _eos_ids(value: Any) -> list[int]:
    """EOS ids as a config or a criterion holds them: None, one id, a list or a tensor."""
    return [] if value is None else [int(v) for v in torch.as_tensor(value).reshape(-1).tolist()]


# -- stopping, one generated position at a time ----------------------------------------------


class _Positions:
    """The batch's generated tokens, released one position at a time as ``generate``'s loop
    would release them: every stopping criterion sees ``input_ids`` of the whole batch (rows it
    finished earlier padded, when an EOS criterion is present, as ``generate`` pads them), the
    streamer gets each position's ``[batch]`` tokens. Tokens arrive from the decoder in bursts,
    per row; a position is released once every row that still produces tokens has it."""

    def __init__(self, rows: _Rows, criteria: Sequence[Any], limit: int, pad: int | None,
                 streamer: Any) -> None:
        self.batch, self.length = rows.input_ids.shape
        self.limit = limit
        self.tokens: list[list[int]] = [[] for _ in range(self.batch)]
        self.unfinished = [True] * self.batch
        self.position = 0  # positions released so far
        # transformers' own test for "finished rows get padding"
        self.pads_finished = any(hasattr(c, "eos_token_id") for c in criteria)
        if self.pads_finished and pad is None:
            raise UnsupportedOptionError("an EOS stopping criterion without a pad token: set pad_token_id so that "
                                         "finished rows can be padded")
        self.pad = pad
        self.eos = frozenset(t for c in criteria if type(c) is EosTokenCriteria for t in _eos_ids(c.eos_token_id))
        self.others = StoppingCriteriaList([c for c in criteria if type(c) not in (MaxLengthCriteria, EosTokenCriteria)])
        # the batch's input_ids as generate grows them: the prompts, then each released position
        self.buffer = torch.full((self.batch, self.length + limit), pad or 0, dtype=torch.long)
        self.buffer[:, : self.length] = rows.input_ids.detach().to("cpu", torch.long)
        self.streamer = streamer

    @property
    def finished(self) -> bool:
        return not any(self.unfinished) or self.position >= self.limit

    def produces(self, row: int) -> bool:
        """Whether ``row`` still takes part in the loop (a finished row keeps generating when no
        EOS criterion pads it, as in ``generate``)."""
        return not self.finished and (self.unfinished[row] or not self.pads_finished)

    def feed(self, row: int, tokens: Sequence[int]) -> None:
        self.tokens[row].extend(int(t) for t in tokens)

    def release(self) -> list[int]:
        """Release every position all producing rows have; returns the rows that finished."""
        ended: list[int] = []
        while not self.finished:
            t = self.position
            if any(self.produces(r) and len(self.tokens[r]) <= t for r in range(self.batch)):
                break
            step = [self.tokens[r][t] if self.produces(r) else self.pad for r in range(self.batch)]
            column = torch.tensor(step, dtype=torch.long)
            self.buffer[:, self.length + t] = column
            self.position += 1
            done = [token in self.eos for token in step]
            if len(self.others):
                verdict = self._others(self.buffer[:, : self.length + t + 1])
                done = [d or bool(v) for d, v in zip(done, verdict)]
            if self.streamer is not None:
                self.streamer.put(column)
            for r in range(self.batch):
                if self.unfinished[r] and done[r]:
                    self.unfinished[r] = False
                    ended.append(r)
        return ended

    def _others(self, input_ids: torch.Tensor) -> list[bool]:
        try:
            verdict = self.others(input_ids, None)
        except Exception as exc:  # noqa: BLE001 - name the criterion that failed, keep the cause
            names = [type(c).__name__ for c in self.others]
            raise UnsupportedOptionError(
                f"stopping criteria {names} failed when called with scores=None: specdraft.hf evaluates stopping "
                "criteria on the committed tokens (input_ids) only; a criterion that reads the scores cannot be "
                f"applied exactly ({type(exc).__name__}: {exc})") from exc
        return [bool(v) for v in torch.as_tensor(verdict).reshape(-1).tolist()]

    def new_tokens(self) -> torch.Tensor:
        return self.buffer[:, self.length : self.length + self.position].contiguous()


# -- the loop --------------------------------------------------------------------------------


@dataclass
class _Held:
    """One model's decoder and the lock that runs calls on it one at a time (a decoder owns its
    caches)."""

    decoder: Decoder
    lock: threading.Lock = field(default_factory=threading.Lock)


class SpecdraftLoop:
    """A decoding loop for ``model.generate(..., custom_generate=...)``: see the module docstring.

    One loop may serve several models; it keeps one :class:`~specdraft.Decoder` per model (made
    at the model's first call, dropped with the model), so the decoder's measurements and what
    its draft sources learn (the frequency trie, the suffix tree) carry over from call to call.
    ``sources`` given here are shared by every model's decoder; ``None`` gives each decoder the
    default combination of its own. Calls on one model run one at a time (a second thread waits).
    ``last_stats`` holds the statistics of the last call's rows (``None`` for a row the decoder
    did not run: one that ended within the tokens ``min_new_tokens`` forces).

    The arguments are :class:`~specdraft.Decoder`'s: the draft sources (``None``: the default
    combination), the largest tree checked per forward, the adaptive budget, the attention
    backend, the CPU kernels and, on a CUDA GPU, compiled decode forwards. Keep the loop and pass
    it to every call: its decoders and what its sources learned are reused.
    """

    def __init__(self, sources: Sequence[DraftSource] | None = None, max_tree_nodes: int | None = None,
                 adaptive_budget: bool = True, attention: str = "auto", cpu_kernels: str = "auto",
                 compile: bool = False) -> None:
        _check_transformers()
        check_int("max_tree_nodes", max_tree_nodes, 0, " (the device's default)", none_ok=True)
        if not isinstance(compile, bool):
            raise ValueError(f"compile must be True or False, got {compile!r}")
        #: the draft sources every decoder of this loop uses (``None``: each decoder makes the default ones)
        self.sources = list(sources) if sources is not None else None
        # the rest of each decoder's arguments
        self._options = dict(max_tree_nodes=max_tree_nodes, adaptive_budget=adaptive_budget,
                             attention=attention, cpu_kernels=cpu_kernels, compile=compile)
        self.last_stats: list[GenerationStats | None] = []
        self._held: "weakref.WeakKeyDictionary[Any, _Held]" = weakref.WeakKeyDictionary()
        self._making = threading.Lock()

    def decoder(self, model: Any) -> Decoder:
        """The decoder this loop runs ``model`` with (made on first use)."""
        return self._hold(model).decoder

    def close(self) -> None:
        """Free what the decoders hold beyond the models (packed weights); they run on stock
        kernels afterwards."""
        for held in list(self._held.values()):
            held.decoder.close()

    def _hold(self, model: Any) -> _Held:
        with self._making:
            held = self._held.get(model)
            if held is None:
                held = self._held[model] = _Held(Decoder(model, None, sources=self.sources, **self._options))
            return held

    def __call__(self, model: Any, input_ids: torch.LongTensor, logits_processor: Any = None,
                 stopping_criteria: Any = None, generation_config: GenerationConfig | None = None,
                 synced_gpus: bool = False, streamer: Any = None, **model_kwargs: Any) -> Any:
        """What ``generate`` calls with the prepared inputs (the signature of its own loops).

        A streamer handed here already received the prompt from ``generate``."""
        return self._run(model, input_ids, streamer, False, logits_processor, stopping_criteria, generation_config,
                         synced_gpus, **model_kwargs)

    def bind(self, streamer: Any = None) -> Callable[..., Any]:
        """This loop with ``streamer`` attached: for callers (such as :func:`generate`) that keep
        the streamer away from ``generate`` because transformers would not hand it to the loop.
        The bound loop sends the prompt to the streamer itself."""
        attached = streamer

        def bound(model: Any, input_ids: torch.LongTensor, *args: Any, streamer: Any = None, **kwargs: Any) -> Any:
            # takes what __call__ takes; a streamer generate handed after all has had the prompt from generate
            return self._run(model, input_ids, attached if streamer is None else streamer, streamer is None, *args,
                             **kwargs)

        return bound

    # -- one call -----------------------------------------------------------------------------

    def _run(self, model: Any, input_ids: torch.LongTensor, streamer: Any, put_prompt: bool,
             logits_processor: Any = None, stopping_criteria: Any = None,
             generation_config: GenerationConfig | None = None, synced_gpus: bool = False, **model_kwargs: Any) -> Any:
        if generation_config is None:
            raise UnsupportedOptionError("specdraft.hf.loop is a decoding loop for model.generate(custom_generate=...): "
                                         "call generate, which prepares the generation config, processors and criteria")
        if synced_gpus:
            raise UnsupportedOptionError("synced_gpus=True is not supported: specdraft.hf decodes on one device")
        _check_config(generation_config, model)
        _check_model_inputs(model_kwargs)
        rows = _Rows.read(input_ids, model_kwargs.get("attention_mask"), model_kwargs.get("position_ids"))
        criteria = list(stopping_criteria or [])
        processors = _read_processors(list(logits_processor or []), bool(generation_config.do_sample), rows)
        lengths = [int(c.max_length) for c in criteria if type(c) is MaxLengthCriteria]
        if not lengths:
            raise UnsupportedOptionError("no MaxLengthCriteria among the stopping criteria: specdraft.hf needs a "
                                         "length limit (max_new_tokens or max_length)")
        limit = min(lengths) - input_ids.shape[1]
        pad = generation_config.pad_token_id
        if pad is None:  # what generate pads with when no pad token is set
            pad = next(iter(_eos_ids(generation_config.eos_token_id)), None)
        if streamer is not None and put_prompt:
            streamer.put(input_ids.cpu())
        positions = _Positions(rows, criteria, max(limit, 0), pad, streamer)
        self.last_stats = [None] * len(rows.prompts)
        forced = min(processors.min_tokens, positions.limit)
        if forced > 0:
            if _config_settings(generation_config) != processors.expected:
                raise UnsupportedOptionError(
                    "min_new_tokens / min_length together with logits processors passed to generate() "
                    "directly is not supported: the first tokens are decoded by generate from the generation "
                    "config; set repetition_penalty, temperature, top_k, top_p and min_p there instead")
            self._forced_tokens(model, input_ids, model_kwargs.get("attention_mask"), generation_config,
                                forced, positions)
        if not positions.finished:  # (with no room for new tokens it is finished from the start)
            self._decode(model, rows, positions, processors)
        if streamer is not None:
            streamer.end()
        sequences = torch.cat([input_ids, positions.new_tokens().to(input_ids.device)], dim=1)
        return (GenerateDecoderOnlyOutput(sequences=sequences) if generation_config.return_dict_in_generate
                else sequences)

    @staticmethod
    def _forced_tokens(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                       generation_config: GenerationConfig, count: int, positions: _Positions) -> None:
        """The first ``count`` new tokens, while ``min_new_tokens`` / ``min_length`` ban EOS:
        decoded by transformers' own loop from the same generation config (so with the same
        processors), then released through the stopping criteria like every other token."""
        config = copy.deepcopy(generation_config)
        config.max_new_tokens = count
        config.max_length = None
        config.stop_strings = None  # the criteria are evaluated by _Positions, on every token
        config.max_time = None
        config.num_return_sequences = 1  # input_ids are already expanded
        config.return_dict_in_generate = False
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        out = GenerationMixin.generate(model, input_ids, attention_mask=mask, generation_config=config,
                                       custom_generate=None)
        for row, tokens in enumerate(out[:, input_ids.shape[1]:].tolist()):
            positions.feed(row, tokens)
        positions.release()

    def _decode(self, model: Any, rows: _Rows, positions: _Positions, processors: _Processors) -> None:
        """The tokens after the forced ones: the decoder continues every row that still produces
        tokens from its prompt plus what it has, until the stopping criteria end it."""
        start = positions.position
        todo = [r for r in range(len(rows.prompts)) if positions.produces(r)]
        requests = [rows.prompts[r] + positions.tokens[r][:start] for r in todo]
        options = dict(max_new_tokens=positions.limit - start, **processors.options)
        held = self._hold(model)
        with held.lock, _engine_view(model, sorted(positions.eos), processors):
            if positions.batch > 1 and held.decoder.runner.batches_supported:
                self._decode_many(held.decoder, todo, requests, options, positions)
            else:
                # one row, or a model whose attention cannot share a forward between requests (GPT-2's
                # eager attention in older transformers): each row alone, one after another, as
                # generate's tokens; a row's positions are released once the others have theirs
                for row, prompt in zip(todo, requests):
                    self.last_stats[row] = stats = GenerationStats()
                    with closing(held.decoder.stream(prompt, stats=stats, **options)) as stream:
                        for chunk in stream:
                            positions.feed(row, chunk)
                            positions.release()
                            if not positions.produces(row):
                                break
                _check_complete(positions, dict.fromkeys(todo))

    def _decode_many(self, decoder: Decoder, todo: list[int], requests: list[list[int]],
                     options: dict[str, Any], positions: _Positions) -> None:
        index_of = {row: i for i, row in enumerate(todo)}
        with closing(decoder.stream_batch(requests, concurrency=len(requests), **options)) as stream:
            for index, chunk in stream:
                positions.feed(todo[index], chunk)
                for row in positions.release():
                    if positions.pads_finished and row in index_of:
                        stream.cancel(index_of[row])
                if positions.finished:
                    break
        outputs = {row: stream.outputs[i] for row, i in index_of.items()}
        for row, output in outputs.items():
            self.last_stats[row] = output.stats if output is not None else None
        _check_complete(positions, outputs)


def _check_complete(positions: _Positions, outputs: dict[int, Any]) -> None:
    """Every row the criteria still run must have been given its tokens: a request that failed
    raises its error, and a decoder that stopped a row where generate would go on is a bug to
    report, never a silently short output."""
    positions.release()
    if positions.finished:
        return
    for row, output in outputs.items():
        if positions.produces(row) and len(positions.tokens[row]) <= positions.position:
            if output is not None and getattr(output, "error", None) is not None:
                raise output.error
    raise RuntimeError(f"specdraft.hf: the decoder stopped after {positions.position} of {positions.limit} new tokens "
                       "where generate's stopping criteria would continue; please report this with the call")


@contextmanager
def _engine_view(model: Any, eos: list[int], processors: _Processors) -> Iterator[None]:
    """Make the decoder stop at the EOS ids of this call and resolve exactly the settings read
    from the processors. The decoder reads both from ``model.generation_config``; where that
    config differs from the call's (another EOS, options the decoder refuses in a model config
    although this call does not use them), a config holding only this call's EOS ids stands in
    for it during the call."""
    current = getattr(model, "generation_config", None)
    if _engine_agrees(current, eos, processors):
        yield
        return
    standin = GenerationConfig(eos_token_id=eos or None)
    if not _engine_agrees(standin, eos, processors):
        raise RuntimeError(f"specdraft.hf cannot make the decoder apply {processors.expected}; please report this")
    model.generation_config = standin
    try:
        yield
    finally:
        model.generation_config = current


def _engine_agrees(config: GenerationConfig | None, eos: list[int], processors: _Processors) -> bool:
    try:
        return (sorted(set(_eos_ids(getattr(config, "eos_token_id", None)))) == eos
                and _engine_settings(config, **processors.options) == processors.expected)
    except UnsupportedOptionError:  # the decoder would refuse this config
        return False


def _check_transformers() -> None:
    """``generate(custom_generate=<callable>)`` is the extension point this module plugs into."""
    if "custom_generate" not in inspect.signature(GenerationMixin.generate).parameters:
        import transformers

        raise ImportError(f"specdraft.hf needs a transformers release whose generate() takes custom_generate= "
                          f"(transformers >= 4.56); installed: {transformers.__version__}. Upgrade transformers, or "
                          "use specdraft.Decoder directly")


#: A decoding loop to pass as ``model.generate(..., custom_generate=loop(...))``: the name the
#: documentation calls.
loop = SpecdraftLoop


_default_loop: SpecdraftLoop | None = None
_default_lock = threading.Lock()


def _the_default_loop() -> SpecdraftLoop:
    global _default_loop
    with _default_lock:
        if _default_loop is None:
            _default_loop = loop()
        return _default_loop


def generate(model: Any, inputs: torch.Tensor | None = None, generation_config: GenerationConfig | None = None,
             logits_processor: Any = None, stopping_criteria: Any = None, prefix_allowed_tokens_fn: Any = None,
             synced_gpus: bool | None = None, assistant_model: Any = None, streamer: Any = None,
             negative_prompt_ids: torch.Tensor | None = None, negative_prompt_attention_mask: torch.Tensor | None = None,
             *, specdraft_loop: SpecdraftLoop | None = None, tokenizer: Any = None, **kwargs: Any) -> Any:
    """``model.generate`` with specdraft's decoding loop, taking every argument ``generate`` takes.

    This is what ``custom_generate/generate.py`` exposes, so ``model.generate(...,
    custom_generate="path/to/custom_generate_folder", trust_remote_code=True)`` lands here. It
    keeps the ``streamer`` and builds the stop-string criterion from ``tokenizer`` itself, then
    calls transformers' ``generate`` with the loop (``specdraft_loop``, or one made once with
    the default sources). Called directly, it is the same as
    ``model.generate(..., custom_generate=loop)`` where transformers would drop the streamer or
    fail on stop strings."""
    if assistant_model is not None:
        raise UnsupportedOptionError("assistant_model is not supported: specdraft is the speculative decoder here "
                                     "(its sources draft the tokens)")
    if "custom_generate" in kwargs:
        raise UnsupportedOptionError("custom_generate was given twice; specdraft.hf.generate runs its own loop "
                                     "(pass specdraft_loop= to choose it)")
    kwargs.pop("trust_remote_code", None)  # meant for loading this function; generate has nothing to load
    chosen = specdraft_loop if specdraft_loop is not None else _the_default_loop()
    if not isinstance(chosen, SpecdraftLoop):
        raise TypeError(f"specdraft_loop must be a specdraft.hf.loop(...), got {type(chosen).__name__}")
    stop = kwargs.get("stop_strings", getattr(generation_config, "stop_strings", None))
    if stop is None and "stop_strings" not in kwargs:
        stop = getattr(model.generation_config, "stop_strings", None)
    if stop:
        if tokenizer is None:
            raise ValueError("stop strings need the model's tokenizer: pass tokenizer= to generate")
        extra = StopStringCriteria(tokenizer=tokenizer, stop_strings=stop)
        stopping_criteria = StoppingCriteriaList([*(stopping_criteria or []), extra])
        kwargs["stop_strings"] = None  # the criterion above replaces the one generate would build
    return GenerationMixin.generate(
        model, inputs, generation_config=generation_config, logits_processor=logits_processor,
        stopping_criteria=stopping_criteria, prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        synced_gpus=synced_gpus, negative_prompt_ids=negative_prompt_ids,
        negative_prompt_attention_mask=negative_prompt_attention_mask, custom_generate=chosen.bind(streamer),
        **kwargs)
