"""Batched soak: thousands of requests through ``generate_batch`` and ``stream_batch``, checked.

A service sends the batched decoder whatever arrives, for as long as it runs: requests of every
length and setting, callers that cancel or hang up mid-stream, a draft source that breaks on some
requests, and malformed requests. What must hold after any number of them:

* every completed greedy request equals that prompt's own ``model.generate(do_sample=False)``
  output (stop strings applied as plain decoding would), and every seeded sampled one equals the
  one-request decoder's output with that seed: batching never changes a request's output;
* a request whose source raises ends alone, with that error in its output; the others of its batch
  complete; a request cancelled before it ends is flagged ``cancelled``; nothing a request began in
  a source outlives it;
* an invalid request makes its call raise a ``ValueError`` / ``TypeError`` whose message names the
  request (``request 3: ...``) and the bad value, and the decoder works right after;
* no request waits forever (a watchdog aborts with every thread's stack if a call hangs), and
  resident memory levels off.

The model is a tiny random Qwen2 (float64, so greedy argmaxes are never decided by float noise and
``model.generate`` is an exact reference) with ``--vocab-size`` tokens, by default 151 936, the
default model's vocabulary, and a word-level tokenizer (token ``i`` is the word ``w<i>``) so that
text prompts and stop strings work. A few frequent output tokens are made EOS so that requests
also end on EOS. Two decoders share one set of sources (the defaults: prompt lookup, the frequency
trie, the n-gram, the suffix tree, plus :class:`FailingSource`): one with the tokenizer and the
adaptive budget, one without a tokenizer (token-id streams) on a fixed budget that always drafts.
A quarter of the prompts repeat earlier ones, so the shared sources' drafts get accepted and trees
really commit several tokens.

This module is also the harness of ``tests/test_batch_soak.py`` (the same code at test scale, so
the two cannot drift).

    python benchmarks/batch_soak.py                       # 10 000 requests, results/batch-soak-<date>-<commit>/
    python benchmarks/batch_soak.py --requests 500 --vocab-size 4000 --out soak-out   # a quick look
"""

from __future__ import annotations

import argparse
import csv
import faulthandler
import gc
import json
import math
import os
import platform
import subprocess
import sys
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from soak import check_plotting, rss_mib  # benchmarks/soak.py: the same /proc reading and plot check

from specdraft import BatchRequest, Decoder
from specdraft.bench.report import require_matplotlib
from specdraft.sources import Context, Draft, Feedback
from specdraft.sources.base import SourceBase
from specdraft.sources.registry import default_sources

#: First prompt token -> where :class:`FailingSource` raises for that request. Prompts of the
#: requests meant to fail start with one of these; no other prompt does.
POISON: dict[int, str] = {3: "propose", 4: "observe", 5: "end"}

#: Token ids below this are never drawn for prompts or made EOS: specials (0-2) and :data:`POISON`.
FIRST_PLAIN_ID = 6

FIELDS = ["requests", "calls", "seconds", "rss_mib", "rss_trimmed_mib", "peak_rss_mib", "py_blocks", "gc_objects",
          "new_tokens", "completed",
          "cancelled", "failed", "invalid", "latency_p50_ms", "latency_p99_ms", "latency_max_ms", "trie_nodes",
          "trie_trees", "suffix_cached_requests", "suffix_cached_tokens", "live_states", "greedy_checked",
          "sampled_checked", "mismatches", "problems"]


# -- the source that raises ---------------------------------------------------------------------


class PlannedFailure(RuntimeError):
    """What :class:`FailingSource` raises: a distinct type, so a request that failed for any
    other reason is told apart."""


def failure_plan(prompt_ids: Sequence[int]) -> tuple[str, int] | None:
    """Where (``propose``, ``observe`` or ``end``) and at which call (1-3) the failing source
    raises for a request with this prompt, or ``None``. Keyed by the prompt alone, so which
    requests are meant to fail is known before they run and needs no state."""
    if not len(prompt_ids) or int(prompt_ids[0]) not in POISON:
        return None
    return POISON[int(prompt_ids[0])], 1 + len(prompt_ids) % 3


@dataclass
class _Countdown:
    """One poisoned request's progress towards its failure."""

    prompt: tuple[int, ...]
    where: str
    at: int
    calls: int = 0


class FailingSource(SourceBase[_Countdown]):
    """A draft source that raises :class:`PlannedFailure` on the requests :func:`failure_plan`
    marks: in ``propose`` or ``observe`` at the planned call, or in ``end``. It drafts nothing.
    Every raise is logged in :attr:`raised` (prompt, where), so a check knows exactly which
    requests must carry an error: a planned request that ends before its failure point (token
    limit, stop string, cancellation) does not fail."""

    name = "fails"

    def __init__(self) -> None:
        super().__init__()
        self.raised: list[tuple[tuple[int, ...], str]] = []
        self.raises: Counter = Counter()

    def new_state(self, context: Context) -> _Countdown | None:
        plan = failure_plan(context.tokens)
        if plan is None:
            return None
        return _Countdown(tuple(int(t) for t in context.tokens), *plan)

    def propose(self, context: Context, budget: int) -> Draft:
        self._tick(context.request_id, "propose")
        return Draft()

    def observe(self, feedback: Feedback) -> None:
        self._tick(feedback.context.request_id, "observe")

    def end(self, context: Context) -> None:
        state = self.peek_state(context.request_id)
        super().end(context)  # the state goes first: a raise here must not leave it behind
        if state is not None and state.where == "end":
            self._raise(state)

    def _tick(self, request_id: int, where: str) -> None:
        state = self.peek_state(request_id)
        if state is None or state.where != where:
            return
        state.calls += 1
        if state.calls == state.at:
            self._raise(state)

    def _raise(self, state: _Countdown) -> None:
        self.raised.append((state.prompt, state.where))
        self.raises[state.where] += 1
        raise PlannedFailure(f"planned failure in {state.where} (call {state.at}) of the request whose prompt "
                             f"starts {list(state.prompt[:4])}")


# -- the model and its tokenizer -------------------------------------------------------------------


def word_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer over ``vocab_size`` ids: ``<unk>``, ``<s>``, ``</s>``, then token
    ``i`` is the word ``w<i>``; decoding joins words with spaces. Text prompts round-trip to the
    same ids, and stop strings search real text (``"7 w"`` hits after any word ending in 7)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")


def tiny_model(vocab_size: int, max_positions: int, seed: int) -> Any:
    """A tiny random float64 Qwen2 (hidden 32, 2 layers): float64 so that greedy output is exact
    against ``model.generate`` whatever the width of the forward that computed it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                         tie_word_embeddings=True)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = Qwen2ForCausalLM(config).to(torch.float64).eval()
    return model


def frequent_outputs(model: Any, prompt_ids: Sequence[int], rng: np.random.Generator, count: int) -> list[int]:
    """The ``count`` tokens the model's greedy outputs hold most often (a random model has "hub"
    tokens): made EOS, they end a share of requests early, as a real model's EOS does."""
    seen: Counter = Counter()
    for _ in range(24):
        prompt = [int(t) for t in rng.choice(prompt_ids, size=int(rng.integers(2, 24)))]
        seen.update(t for t in reference_tokens(model, prompt, 24) if t >= FIRST_PLAIN_ID)
    return [t for t, _ in seen.most_common(count)]


@torch.inference_mode()
def reference_tokens(model: Any, prompt_ids: Sequence[int], max_new_tokens: int,
                     repetition_penalty: float | None = None) -> list[int]:
    """Plain ``model.generate(do_sample=False)``: the ground truth of a greedy request."""
    if max_new_tokens == 0:
        return []
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    extra = {"repetition_penalty": repetition_penalty} if repetition_penalty is not None else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, **extra)
    return out[0, ids.shape[1]:].tolist()


def cut_at_stop(tokenizer: Any, tokens: list[int], stops: Sequence[str]) -> list[int]:
    """``tokens`` up to the first token after which the decoded text holds a stop string: where
    plain decoding with those stop strings ends."""
    if not stops:
        return tokens
    for k in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:k])
        if any(s in text for s in stops):
            return tokens[:k]
    return tokens


def trimmed_rss_mib() -> float:
    """RSS once the cyclic garbage is collected and the C allocator has handed its free pages back
    (glibc ``malloc_trim``; elsewhere, after the collection alone). A forward over a large
    vocabulary allocates and frees logits of tens of MiB, and how much of that freed memory the
    allocator keeps at a given moment varies by tens of MiB; what is left after a trim is what is
    really held, so a leak shows here without that noise."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return rss_mib()[0]


def live_states(source: Any) -> int:
    """Requests a source holds state for (``active_requests`` is an int or a list of ids; 0 when
    the source does not say)."""
    value = getattr(source, "active_requests", 0)
    return value if isinstance(value, int) else len(value)


# -- configuration and report --------------------------------------------------------------------


@dataclass
class SoakConfig:
    """What the soak sends. The defaults are the full run; :meth:`test_scale` the test's."""

    requests: int = 10_000
    seed: int = 0
    vocab_size: int = 151_936
    max_positions: int = 1024
    prompt_vocab: int = 2000  # prompts draw from this many ids, so windows repeat across requests
    max_prompt: int = 48
    long_prompt_share: float = 0.01  # prompts of 513-700 tokens: prefilled in chunks across steps
    reuse_share: float = 0.25  # a request repeats an earlier prompt (drafts from shared sources get accepted)
    max_new_tokens: int = 32
    max_batch: int = 16
    max_concurrency: int = 8
    stream_share: float = 0.5  # calls of stream_batch (the rest: generate_batch)
    text_share: float = 0.3  # prompts given as text (on the decoder with a tokenizer)
    sample_share: float = 0.35
    stop_share: float = 0.3  # requests with stop strings (on the decoder with a tokenizer)
    fail_share: float = 0.05  # requests whose prompt marks them for FailingSource
    invalid_share: float = 0.05  # calls with one invalid request (or an invalid call argument)
    cancel_rate: float = 0.04  # per streamed piece: cancel a random request of the batch
    close_share: float = 0.1  # stream calls closed early
    abandon_share: float = 0.03  # stream calls left mid-way by ``break``, without close(), and dropped
    duplicate_share: float = 0.03  # a request repeats a prompt of its own batch
    eos_extra: int = 3  # frequent output tokens made EOS
    greedy_check_every: int = 1  # compare every N-th finished greedy request with model.generate
    sampled_check_every: int = 3  # compare every N-th finished seeded sampled request with the one-request decoder
    every: int = 250  # a CSV row every N requests
    call_timeout_s: float = 600.0  # a call (or a reference) running longer is a hang: abort with stacks
    invalid_sweep: bool = True  # start with every invalid kind once on each decoder
    adaptive_tree_nodes: int = 32
    fixed_tree_nodes: int = 8
    hide_host_work: bool | None = None  # True: the accelerator's order (learning and ends behind the forward)

    @classmethod
    def test_scale(cls, **overrides: Any) -> "SoakConfig":
        """A few hundred requests on a small vocabulary, everything mixed in, no timing."""
        base = dict(requests=300, vocab_size=512, prompt_vocab=200, max_positions=768, max_prompt=24,
                    long_prompt_share=0.01, max_new_tokens=16, fail_share=0.12, invalid_share=0.08,
                    cancel_rate=0.06, close_share=0.25, abandon_share=0.0, every=50, call_timeout_s=120.0,
                    adaptive_tree_nodes=16, fixed_tree_nodes=6)
        base.update(overrides)
        return cls(**base)


@dataclass
class SoakReport:
    """What the soak found: counts by outcome, checks made, problems (each a sentence naming the
    call and the request), latencies and the memory rows."""

    config: SoakConfig
    counts: Counter = field(default_factory=Counter)
    checks: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    mismatches: int = 0
    latencies_s: list[float] = field(default_factory=list)  # admission to finish, per request with an output
    waits_s: list[float] = field(default_factory=list)  # submitted (the call made) to output seen, per request
    call_seconds: list[float] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    eos_ids: list[int] = field(default_factory=list)
    live_after: dict[str, int] = field(default_factory=dict)
    invalid_messages: dict[str, str] = field(default_factory=dict)  # an example message per invalid kind
    raised_by_where: dict[str, int] = field(default_factory=dict)  # the failing source's raises
    reference_seconds: float = 0.0  # spent computing the references the outputs are checked against
    caps: dict[str, int] = field(default_factory=dict)  # the shared sources' documented caps

    def problem(self, text: str) -> None:
        self.problems.append(text)


# -- requests ------------------------------------------------------------------------------------


@dataclass
class Planned:
    """One request as the harness sent it, with the settings it resolves to."""

    prompt: Any  # what was passed (text, list, tuple, array or tensor)
    prompt_ids: list[int]
    max_new_tokens: int
    do_sample: bool
    stop: list[str]
    seed: int | None
    sampling: dict[str, Any]  # temperature, top_k, top_p, min_p (sampled requests only)
    repetition_penalty: float | None
    plan: tuple[str, int] | None


@dataclass
class Invalid:
    """An invalid request (or call argument) and what its error must say."""

    kind: str
    index: int | None  # the request the error must name; None: a call argument, no request
    fragments: list[str]  # what the message must contain besides ``request <index>:``
    request: Any = None  # replaces the batch's request ``index``
    call: dict[str, Any] = field(default_factory=dict)  # call arguments to add or override


INVALID_KINDS = ("max_new_tokens_negative", "max_new_tokens_float", "max_new_tokens_str", "max_new_tokens_bool",
                 "max_new_tokens_call_none", "id_above_vocab", "id_negative", "id_float", "id_bool", "empty_ids",
                 "empty_text", "nested_prompt", "prompt_type", "too_long", "unknown_option", "unsupported_option",
                 "stop_int", "stop_empty", "stop_mixed", "stop_bytes", "temperature_zero", "top_p_high",
                 "top_k_negative", "top_k_float", "min_p_high", "repetition_zero", "warper_greedy",
                 "do_sample_str", "seed_str", "seed_float", "seed_huge", "temperature_nan", "prompt_none", "tensor_2d",
                 "concurrency_zero", "concurrency_float", "prompts_str", "prompts_generator",
                 "text_without_tokenizer", "stop_without_tokenizer")


def invalid_kinds(has_tokenizer: bool) -> list[str]:
    """The invalid kinds that apply to a decoder with (or without) a tokenizer."""
    text_only = ("stop_empty", "stop_mixed")
    ids_only = ("text_without_tokenizer", "stop_without_tokenizer")
    return [k for k in INVALID_KINDS if k not in (ids_only if has_tokenizer else text_only)]


def make_invalid(kind: str, index: int, prompt_ids: list[int], vocab: int, limit: int, has_tokenizer: bool
                 ) -> Invalid:
    """The invalid request ``kind`` at ``index`` (built around a valid prompt), and the parts of
    the value its error must name."""
    p = list(prompt_ids)
    r = lambda **kw: BatchRequest(**{"prompt": p, **kw})  # noqa: E731
    table: dict[str, Callable[[], Invalid]] = {
        "max_new_tokens_negative": lambda: Invalid(kind, index, ["max_new_tokens", "-1"], r(max_new_tokens=-1)),
        "max_new_tokens_float": lambda: Invalid(kind, index, ["max_new_tokens", "2.5"], r(max_new_tokens=2.5)),
        "max_new_tokens_str": lambda: Invalid(kind, index, ["max_new_tokens", "'8'"], r(max_new_tokens="8")),
        "max_new_tokens_bool": lambda: Invalid(kind, index, ["max_new_tokens", "True"], r(max_new_tokens=True)),
        "max_new_tokens_call_none": lambda: Invalid(kind, 0, ["max_new_tokens", "None"], None,
                                                    {"max_new_tokens": None}),
        "id_above_vocab": lambda: Invalid(kind, index, [str(vocab + 7)], p[:3] + [vocab + 7]),
        "id_negative": lambda: Invalid(kind, index, ["-3"], [-3] + p[:3]),
        "id_float": lambda: Invalid(kind, index, ["2.0"], p[:2] + [2.0]),
        "id_bool": lambda: Invalid(kind, index, ["True"], [True] + p[:2]),
        "empty_ids": lambda: Invalid(kind, index, ["empty"], []),
        "empty_text": lambda: Invalid(kind, index, ["empty"] if has_tokenizer else ["tokenizer"], ""),
        "nested_prompt": lambda: Invalid(kind, index, ["nested"], [p[:2], p[:2]]),
        "prompt_type": lambda: Invalid(kind, index, ["float"], 3.5),
        "too_long": lambda: Invalid(kind, index, [f"{limit - 4} tokens", "max_new_tokens=20"],
                                    r(prompt=(p * limit)[: limit - 4], max_new_tokens=20)),
        "unknown_option": lambda: Invalid(kind, 0, ["frobnicate"], None, {"frobnicate": 1}),
        "unsupported_option": lambda: Invalid(kind, 0, ["num_beams"], None, {"num_beams": 3}),
        "stop_int": lambda: Invalid(kind, index, ["stop", "5"], r(stop=5)),
        "stop_empty": lambda: Invalid(kind, index, ["stop", "''"], r(stop=[""])),
        "stop_mixed": lambda: Invalid(kind, index, ["stop", "3"], r(stop=["w1", 3])),
        "stop_bytes": lambda: Invalid(kind, index, ["stop", "b'w1'"], r(stop=b"w1")),
        "temperature_zero": lambda: Invalid(kind, index, ["temperature", "0.0"], r(do_sample=True, temperature=0.0)),
        "top_p_high": lambda: Invalid(kind, index, ["top_p", "1.5"], r(do_sample=True, top_p=1.5)),
        "top_k_negative": lambda: Invalid(kind, index, ["top_k", "-2"], r(do_sample=True, top_k=-2)),
        "top_k_float": lambda: Invalid(kind, index, ["top_k", "2.5"], r(do_sample=True, top_k=2.5)),
        "min_p_high": lambda: Invalid(kind, index, ["min_p", "1.5"], r(do_sample=True, min_p=1.5)),
        "repetition_zero": lambda: Invalid(kind, index, ["repetition_penalty", "0.0"], r(repetition_penalty=0.0)),
        "warper_greedy": lambda: Invalid(kind, index, ["temperature", "0.7"], r(do_sample=False, temperature=0.7)),
        "do_sample_str": lambda: Invalid(kind, index, ["do_sample", "'yes'"], r(do_sample="yes")),
        "seed_str": lambda: Invalid(kind, index, ["seed", "'x'"], r(seed="x")),
        "seed_float": lambda: Invalid(kind, index, ["seed", "1.5"], r(seed=1.5)),
        "seed_huge": lambda: Invalid(kind, index, ["seed", str(2**70)], r(seed=2**70)),
        "temperature_nan": lambda: Invalid(kind, index, ["temperature", "nan"],
                                           r(do_sample=True, temperature=math.nan)),
        "prompt_none": lambda: Invalid(kind, index, ["NoneType"], r(prompt=None)),
        "tensor_2d": lambda: Invalid(kind, index, ["shape", "(2, 2)"], torch.tensor([p[:1] * 2, p[:1] * 2])),
        "concurrency_zero": lambda: Invalid(kind, None, ["concurrency", "0"], None, {"concurrency": 0}),
        "concurrency_float": lambda: Invalid(kind, None, ["concurrency", "2.5"], None, {"concurrency": 2.5}),
        "prompts_str": lambda: Invalid(kind, None, ["prompts", "str"], None, {"prompts": "w7 w8"}),
        "prompts_generator": lambda: Invalid(kind, None, ["prompts", "generator"], None,
                                             {"prompts": (q for q in [p, p])}),
        "text_without_tokenizer": lambda: Invalid(kind, index, ["tokenizer"], "w7 w8"),
        "stop_without_tokenizer": lambda: Invalid(kind, index, ["stop", "tokenizer"], r(stop=["w1"])),
    }
    return table[kind]()


# -- the soak ------------------------------------------------------------------------------------


class Soak:
    """Builds the model, the tokenizer, the sources and the decoders, then sends
    ``config.requests`` requests in random calls and checks every output (see the module docstring)."""

    def __init__(self, config: SoakConfig, progress: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.config = config
        self.progress = progress
        self.rng = np.random.default_rng(config.seed)
        torch.manual_seed(config.seed)  # unseeded sampling draws from torch's global stream
        self.model = tiny_model(config.vocab_size, config.max_positions, config.seed)
        self.tokenizer = word_tokenizer(config.vocab_size)
        self.prompt_ids = self.rng.choice(np.arange(FIRST_PLAIN_ID, config.vocab_size),
                                          size=min(config.prompt_vocab, config.vocab_size - FIRST_PLAIN_ID),
                                          replace=False)
        self.eos_ids = [2] + frequent_outputs(self.model, self.prompt_ids, self.rng, config.eos_extra)
        self.model.generation_config.eos_token_id = self.eos_ids
        self.model.generation_config.pad_token_id = 2
        self.failing = FailingSource()
        self.sources = [*default_sources(), self.failing]
        # mid-list: the sources before it observe a step it fails in, the sources after it do not
        self.sources.insert(2, self.sources.pop())
        self.with_text = Decoder(self.model, self.tokenizer, sources=self.sources,
                                 max_tree_nodes=config.adaptive_tree_nodes)
        self.ids_only = Decoder(self.model, sources=self.sources, max_tree_nodes=config.fixed_tree_nodes,
                                adaptive_budget=False)
        self.alone = Decoder(self.model, self.tokenizer, sources=[], max_tree_nodes=0)  # seeded sampling's reference
        for decoder in (self.with_text, self.ids_only):
            decoder.hide_host_work = config.hide_host_work
        self.pool: list[list[int]] = []  # recent prompts, for repeats
        self.report = SoakReport(config, eos_ids=list(self.eos_ids))
        self._greedy_seen = 0
        self._sampled_seen = 0
        self._new_tokens = 0
        self._interval: list[float] = []
        self._next_invalid = {True: 0, False: 0}
        for source in self.sources:
            if getattr(source, "name", "") == "trie":
                self.report.caps["trie_max_nodes"] = int(source.max_nodes)
            if getattr(source, "name", "") == "suffix":
                self.report.caps["suffix_max_cached_requests"] = int(source.max_cached_requests)

    # -- drawing requests ------------------------------------------------------------------------

    def _prompt_ids(self, taken: set[tuple[int, ...]]) -> list[int]:
        rng, cfg = self.rng, self.config
        if taken and rng.random() < cfg.duplicate_share:
            return list(list(taken)[int(rng.integers(0, len(taken)))])
        if self.pool and rng.random() < cfg.reuse_share:
            for _ in range(4):
                prompt = self.pool[int(rng.integers(0, len(self.pool)))]
                if tuple(prompt) not in taken:
                    return list(prompt)
        while True:
            if rng.random() < cfg.long_prompt_share:
                length = int(rng.integers(513, min(701, cfg.max_positions - 2 * cfg.max_new_tokens)))
            else:
                length = int(rng.integers(1, cfg.max_prompt + 1))
            prompt = [int(t) for t in rng.choice(self.prompt_ids, size=length)]
            if length > 1 and rng.random() < 0.05:
                prompt[int(rng.integers(1, length))] = self.eos_ids[int(rng.integers(0, len(self.eos_ids)))]
            if rng.random() < cfg.fail_share:
                prompt[0] = int(rng.choice(list(POISON)))
            if tuple(prompt) not in taken:
                self.pool.append(prompt)
                del self.pool[:-200]
                return prompt

    def _stop_strings(self) -> list[str] | str:
        """One to three stop strings: frequent (``"7 w"``: after a word ending in 7), rare
        (``"w42"``: a word starting so), or never seen (not a word); as a str, list or tuple."""
        rng = self.rng
        stops = []
        for _ in range(int(rng.integers(1, 4))):
            kind = rng.random()
            if kind < 0.4:
                stops.append(f"{int(rng.integers(0, 10))} w")
            elif kind < 0.8:
                stops.append(f"w{int(rng.integers(10, 100))}")
            else:
                stops.append("\u00a7never\u00a7")
        form = rng.random()
        if len(stops) == 1 and form < 0.5:
            return stops[0]
        return tuple(stops) if form < 0.7 else stops

    def _form(self, prompt_ids: list[int], text_ok: bool) -> Any:
        """The prompt as the caller passes it: text, a list, a tuple, an array or a tensor."""
        rng = self.rng
        if text_ok and rng.random() < self.config.text_share:
            text = " ".join(self.tokenizer.convert_ids_to_tokens(prompt_ids))
            if self.tokenizer(text)["input_ids"] == list(prompt_ids):  # else (an EOS word inside): as ids
                return text
        form = rng.random()
        if form < 0.6:
            return list(prompt_ids)
        if form < 0.75:
            return tuple(prompt_ids)
        if form < 0.9:
            return np.asarray(prompt_ids, dtype=np.int64)
        return torch.tensor(prompt_ids)

    def _max_new_tokens(self) -> int:
        u = self.rng.random()
        if u < 0.03:
            return 0
        if u < 0.08:
            return 1
        if u < 0.88:
            return int(self.rng.integers(2, self.config.max_new_tokens + 1))
        return int(self.rng.integers(self.config.max_new_tokens + 1, 2 * self.config.max_new_tokens + 1))

    def _request(self, taken: set[tuple[int, ...]], text_ok: bool, defaults: dict[str, Any]
                 ) -> tuple[Any, Planned]:
        """One valid request (a raw prompt taking the call's defaults, or a BatchRequest with its
        own settings) and what it resolves to."""
        rng, cfg = self.rng, self.config
        prompt_ids = self._prompt_ids(taken)
        taken.add(tuple(prompt_ids))
        form = self._form(prompt_ids, text_ok)
        own: dict[str, Any] = {}
        if rng.random() < 0.7:
            own["max_new_tokens"] = self._max_new_tokens()
        sampling: dict[str, Any] = {}
        do_sample = defaults.get("do_sample") or False
        if rng.random() < cfg.sample_share:
            do_sample = True
            own["do_sample"] = True
            if rng.random() < 0.6:
                sampling["temperature"] = float(np.round(rng.uniform(0.3, 1.5), 2))
            if rng.random() < 0.5:
                sampling["top_k"] = int(rng.choice([0, 1, 5, 50]))
            if rng.random() < 0.4:
                sampling["top_p"] = float(rng.choice([0.5, 0.9, 1.0]))
            if rng.random() < 0.25:
                sampling["min_p"] = float(rng.choice([0.02, 0.1]))
            own.update(sampling)
            if rng.random() < 0.6:
                own["seed"] = int(rng.integers(0, 2**31))
        elif do_sample and rng.random() < 0.5:
            do_sample = False
            own["do_sample"] = False  # overrides the call's do_sample=True
        if rng.random() < 0.1:
            own["repetition_penalty"] = float(rng.choice([1.1, 1.3, 1.6]))
        if text_ok and rng.random() < cfg.stop_share:
            own["stop"] = self._stop_strings()
        if not own and rng.random() < 0.8:
            request: Any = form
        else:
            request = BatchRequest(form, **own)
        merged = {**defaults, **own}
        stop = merged.get("stop")
        seed = merged.get("seed")
        planned = Planned(prompt=form, prompt_ids=prompt_ids, max_new_tokens=merged["max_new_tokens"],
                          do_sample=do_sample, stop=[stop] if isinstance(stop, str) else list(stop or []),
                          seed=seed if do_sample else None, sampling=sampling if do_sample else {},
                          repetition_penalty=merged.get("repetition_penalty"), plan=failure_plan(prompt_ids))
        return request, planned

    # -- one call --------------------------------------------------------------------------------

    def run(self) -> SoakReport:
        cfg, rng, report = self.config, self.rng, self.report
        started = time.perf_counter()
        self._started = started
        sent = calls = 0
        self._record(0, 0)
        if cfg.invalid_sweep:
            sent, calls = self.invalid_sweep(0)
            self._record(sent, calls)
        while sent < cfg.requests:
            before = sent
            size = min(int(rng.integers(1, cfg.max_batch + 1)), cfg.requests - sent)
            decoder = self.with_text if rng.random() < 0.7 else self.ids_only
            if rng.random() < cfg.invalid_share:
                self._invalid_call(decoder, size, calls)
                calls += 1
                report.counts["calls_invalid"] += 1
                sent += size
                # the decoder works right after: a small greedy batch, every output checked
                probe = min(2, max(0, cfg.requests - sent))
                if probe:
                    self._valid_call(decoder, probe, calls, probe=True)
                    calls += 1
                    sent += probe
            else:
                self._valid_call(decoder, size, calls)
                calls += 1
                sent += size
            if sent // cfg.every > before // cfg.every or sent >= cfg.requests:
                self._record(sent, calls)
        report.seconds = time.perf_counter() - started
        report.raised_by_where = dict(self.failing.raises)
        report.live_after = {getattr(s, "name", repr(s)): live_states(s) for s in self.sources}
        return report

    def _watch(self) -> None:
        faulthandler.dump_traceback_later(self.config.call_timeout_s, exit=True)

    def _call_defaults(self, text_ok: bool) -> dict[str, Any]:
        rng = self.rng
        defaults: dict[str, Any] = {"max_new_tokens": self._max_new_tokens()}
        if rng.random() < 0.2:
            defaults["do_sample"] = True
        if rng.random() < 0.2:
            defaults["seed"] = int(rng.integers(0, 2**31))
        if text_ok and rng.random() < 0.1:
            defaults["stop"] = self._stop_strings()
        return defaults

    def _valid_call(self, decoder: Decoder, size: int, call: int, probe: bool = False) -> None:
        cfg, rng, report = self.config, self.rng, self.report
        text_ok = decoder.tokenizer is not None
        defaults = {"max_new_tokens": self._max_new_tokens()} if probe else self._call_defaults(text_ok)
        taken: set[tuple[int, ...]] = set()
        requests, planned = [], []
        for _ in range(size):
            if probe:  # plain greedy requests, checked whatever greedy_check_every says
                ids = self._prompt_ids(taken)
                taken.add(tuple(ids))
                requests.append(ids)
                planned.append(Planned(ids, ids, defaults["max_new_tokens"], False, [], None, {}, None,
                                       failure_plan(ids)))
            else:
                request, plan = self._request(taken, text_ok, defaults)
                requests.append(request)
                planned.append(plan)
        concurrency = int(rng.integers(1, cfg.max_concurrency + 1))
        stream_mode = not probe and rng.random() < cfg.stream_share
        self.failing.raised.clear()
        self._watch()
        t0 = time.perf_counter()
        cancelled_live: dict[int, bool] = {}  # index -> the output was not out yet when cancel() was called
        pieces: dict[int, list[Any]] = {}
        seen_at: dict[int, float] = {}
        closed = False
        try:
            if stream_mode:
                report.counts["calls_stream"] += 1
                stream = decoder.stream_batch(requests, concurrency=concurrency, **defaults)
                if rng.random() < 0.1:  # cancelled before it starts
                    j = int(rng.integers(0, size))
                    cancelled_live[j] = True
                    stream.cancel(j)
                if rng.random() < 0.05:
                    self._bad_cancel(stream, size, call)
                close_after = int(rng.integers(0, 3 * size + 1)) if rng.random() < cfg.close_share else None
                abandon_after = int(rng.integers(1, 2 * size + 1)) if close_after is None and \
                    rng.random() < cfg.abandon_share else None
                count = 0
                if close_after == 0:
                    stream.close()  # before the first piece: nothing ran
                    closed = True
                else:
                    for index, piece in stream:
                        pieces.setdefault(index, []).append(piece)
                        now = time.perf_counter()
                        for j, out in enumerate(stream.outputs):
                            if out is not None and j not in seen_at:
                                seen_at[j] = now - t0
                        if rng.random() < cfg.cancel_rate:
                            j = int(rng.integers(0, size))
                            if j not in cancelled_live:
                                cancelled_live[j] = stream.outputs[j] is None
                            stream.cancel(j)
                        count += 1
                        if close_after is not None and count >= close_after:
                            stream.close()
                            closed = True
                            break
                        if abandon_after is not None and count >= abandon_after:
                            break  # no close(): the caller just drops the stream
                outputs = list(stream.outputs)
                if abandon_after is not None and count >= abandon_after:
                    held = stream.outputs  # the list the loop fills in (read again once the stream is gone)
                    del stream
                    closed = self._after_abandon(decoder, call)
                    outputs = list(held)
            else:
                report.counts["calls_generate"] += 1
                result = decoder.generate_batch(requests, concurrency=concurrency, **defaults)
                outputs = list(result)
                if len(outputs) == size and result.stats.new_tokens != sum(len(o.token_ids) for o in outputs):
                    report.problem(f"call {call}: batch stats count {result.stats.new_tokens} new tokens, "
                                   f"outputs hold {sum(len(o.token_ids) for o in outputs)}")
        except Exception as exc:  # noqa: BLE001 - a valid call must not raise: report it and go on
            faulthandler.cancel_dump_traceback_later()
            report.problem(f"call {call} ({'stream' if stream_mode else 'generate'}, {size} requests, "
                           f"concurrency {concurrency}) raised {type(exc).__name__}: {exc}")
            report.counts["calls_raised"] += 1
            return
        elapsed = time.perf_counter() - t0
        faulthandler.cancel_dump_traceback_later()
        report.call_seconds.append(elapsed)
        if closed:
            report.counts["calls_closed"] += 1
        for j in range(size):
            seen_at.setdefault(j, elapsed)
        self._check_call(decoder, call, planned, outputs, cancelled_live, pieces if stream_mode else None, closed,
                         seen_at, every_one=probe)

    def _after_abandon(self, decoder: Decoder, call: int) -> bool:
        """A stream left by ``break`` and dropped, as a caller who stops reading does: its requests
        must end (as cancelled, like close()) and the decoder must take the next call at once, as it
        does after a single-request stream is dropped. If it is still busy, that is a problem; the
        cyclic garbage collector is then run so the soak can go on. Returns True (the stream
        counts as closed)."""
        report = self.report
        report.counts["calls_abandoned"] += 1
        live = sum(live_states(s) for s in self.sources)
        try:
            decoder.generate([FIRST_PLAIN_ID], max_new_tokens=1)
        except RuntimeError as exc:
            report.counts["abandoned_left_busy"] += 1
            report.problem(f"call {call}: abandoned stream: after the stream was dropped the decoder refused the "
                           f"next call ({exc}); {live} request state(s) still open in the sources")
            gc.collect()
        return True

    def _bad_cancel(self, stream: Any, size: int, call: int) -> None:
        """``cancel`` of an index outside the batch must raise ``IndexError`` naming the index."""
        bad = size + int(self.rng.integers(0, 3))
        try:
            stream.cancel(bad)
        except IndexError as exc:
            self.report.checks["bad_cancel"] += 1
            if str(bad) not in str(exc):
                self.report.problem(f"call {call}: cancel({bad}) raised an IndexError not naming {bad}: {exc}")
        except Exception as exc:  # noqa: BLE001
            self.report.problem(f"call {call}: cancel({bad}) raised {type(exc).__name__}, not IndexError: {exc}")
        else:
            self.report.problem(f"call {call}: cancel({bad}) on a batch of {size} was accepted")

    # -- checks ----------------------------------------------------------------------------------

    def _check_call(self, decoder: Decoder, call: int, planned: list[Planned], outputs: list[Any],
                    cancelled_live: dict[int, bool], pieces: dict[int, list[Any]] | None, closed: bool,
                    seen_at: dict[int, float], every_one: bool = False) -> None:
        report = self.report
        raised: Counter = Counter(prompt for prompt, _ in self.failing.raised)
        if len(outputs) != len(planned):
            report.problem(f"call {call}: {len(outputs)} outputs for {len(planned)} requests")
            return
        # a prompt may come twice in a batch: as many of its requests carry the error as times it raised
        errors: Counter = Counter(tuple(p.prompt_ids) for p, o in zip(planned, outputs)
                                  if o is not None and o.error is not None)
        for prompt in set(raised) | set(errors):
            if raised[prompt] != errors[prompt]:
                report.problem(f"call {call}: the failing source raised {raised[prompt]} time(s) for prompt "
                               f"{list(prompt[:6])}..., {errors[prompt]} of its outputs carry an error")
        for index, (plan, out) in enumerate(zip(planned, outputs)):
            where = f"call {call}, request {index}"
            if out is None:
                if closed:
                    report.counts["closed_before_admission"] += 1
                else:
                    report.problem(f"{where}: no output after the stream ended")
                continue
            report.latencies_s.append(float(out.stats.wall_time))
            report.waits_s.append(seen_at[index])
            self._interval.append(float(out.stats.wall_time))
            tokens = list(out.token_ids)
            self._new_tokens += len(tokens)
            if out.error is not None:
                report.counts["failed"] += 1
                if not isinstance(out.error, PlannedFailure):
                    report.problem(f"{where}: unexpected error {type(out.error).__name__}: {out.error}")
                elif plan.plan is None:
                    report.problem(f"{where}: error {out.error} on a request not marked to fail")
            if out.cancelled:
                report.counts["cancelled"] += 1
                if not closed and not cancelled_live.get(index):
                    report.problem(f"{where}: flagged cancelled but never cancelled")
            elif cancelled_live.get(index):
                report.problem(f"{where}: cancelled while running but not flagged cancelled")
            if out.error is None and not out.cancelled:
                report.counts["completed"] += 1
                if tokens and tokens[-1] in self.eos_ids:
                    report.counts["completed_on_eos"] += 1
                elif plan.stop and len(tokens) < plan.max_new_tokens:
                    report.counts["completed_on_stop_string"] += 1
            if out.error is None and self._passed_failure_point(plan, out):
                report.problem(f"{where}: planned to fail in {plan.plan} and ran past it without an error "
                               f"({out.stats.steps} steps)")
            bad = [t for t in tokens if not 0 <= int(t) < self.config.vocab_size]
            if bad or len(tokens) > plan.max_new_tokens:
                report.problem(f"{where}: {len(tokens)} tokens (limit {plan.max_new_tokens}), out of range {bad[:5]}")
            if out.stats.new_tokens != len(tokens):
                report.problem(f"{where}: stats.new_tokens {out.stats.new_tokens} != {len(tokens)} tokens")
            text_ok = decoder.tokenizer is not None
            expected_text = self.tokenizer.decode(tokens, skip_special_tokens=True) if text_ok else None
            if out.text != expected_text:
                report.problem(f"{where}: text {out.text!r} is not its tokens' {expected_text!r}")
            if pieces is not None:
                self._check_pieces(where, pieces.get(index, []), tokens, expected_text, closed)
            finished = out.error is None and not out.cancelled
            self._check_tokens(where, plan, tokens, finished, every_one)

    @staticmethod
    def _passed_failure_point(plan: Planned, out: Any) -> bool:
        """Whether a poisoned request surely reached the call its source raises in: every step after
        the prefill's (``stats.steps - 1`` of them) drafts once and is observed once, and a request
        that drafted at all ends its sources. Only the sure cases count (a cancelled request may
        stop between a draft and its verification)."""
        if plan.plan is None:
            return False
        where, at = plan.plan
        drafted = out.stats.steps - 1
        if where == "end":
            return drafted >= 1
        return drafted >= at + (1 if out.cancelled else 0)

    def _check_pieces(self, where: str, pieces: list[Any], tokens: list[int], text: str | None, closed: bool) -> None:
        """A stream's pieces put together are the request's output (a prefix of it when the stream
        was closed: the last step's tokens may not have been handed out)."""
        if text is not None:
            joined: Any = "".join(pieces)
            whole: Any = text
        else:
            joined = [int(t) for piece in pieces for t in piece]
            whole = tokens
        self.report.checks["stream_pieces"] += 1
        ok = joined == whole[: len(joined)] if closed else joined == whole
        if not ok:
            self.report.problem(f"{where}: streamed pieces {joined!r} are not its output {whole!r}")

    def _check_tokens(self, where: str, plan: Planned, tokens: list[int], finished: bool, every_one: bool) -> None:
        """Greedy: the reference, or a prefix of it for a request that ended early. Seeded sampled:
        the one-request decoder's output with that seed. Other sampled: the stop rules hold."""
        report, cfg = self.report, self.config
        if not plan.do_sample:
            self._greedy_seen += 1
            if (self._greedy_seen - 1) % cfg.greedy_check_every and not every_one:
                return
            self._watch()
            t0 = time.perf_counter()
            reference = reference_tokens(self.model, plan.prompt_ids, plan.max_new_tokens, plan.repetition_penalty)
            report.reference_seconds += time.perf_counter() - t0
            faulthandler.cancel_dump_traceback_later()
            reference = cut_at_stop(self.tokenizer, reference, plan.stop)
            report.checks["greedy_finished" if finished else "greedy_prefix"] += 1
            ok = tokens == reference if finished else tokens == reference[: len(tokens)]
            if not ok:
                report.mismatches += 1
                report.problem(f"{where}: greedy output {tokens} != model.generate's {reference} "
                               f"(prompt {plan.prompt_ids[:8]}..., {plan.max_new_tokens} new, stop {plan.stop}, "
                               f"repetition_penalty {plan.repetition_penalty}, finished {finished})")
            return
        if plan.seed is not None:
            self._sampled_seen += 1
            if (self._sampled_seen - 1) % cfg.sampled_check_every:
                return
            self._watch()
            t0 = time.perf_counter()
            alone = self.alone.generate(plan.prompt_ids, max_new_tokens=plan.max_new_tokens, do_sample=True,
                                        seed=plan.seed, repetition_penalty=plan.repetition_penalty,
                                        stop=plan.stop or None, **plan.sampling).token_ids
            report.reference_seconds += time.perf_counter() - t0
            faulthandler.cancel_dump_traceback_later()
            report.checks["sampled_finished" if finished else "sampled_prefix"] += 1
            ok = tokens == alone if finished else tokens == alone[: len(tokens)]
            if not ok:
                report.mismatches += 1
                report.problem(f"{where}: seeded sample {tokens} != the one-request decoder's {alone} "
                               f"(seed {plan.seed}, {plan.sampling}, stop {plan.stop})")
            return
        if finished and len(tokens) < plan.max_new_tokens:
            ended = bool(tokens) and tokens[-1] in self.eos_ids
            ended = ended or any(s in self.tokenizer.decode(tokens) for s in plan.stop)
            report.checks["sampled_stop_rule"] += 1
            if not ended:
                report.problem(f"{where}: sampled output of {len(tokens)} < {plan.max_new_tokens} tokens "
                               f"ends on no EOS and no stop string {plan.stop}")

    # -- invalid calls ---------------------------------------------------------------------------

    def invalid_sweep(self, call: int) -> tuple[int, int]:
        """Every invalid kind once on each decoder, then a checked greedy batch on it (the soak's
        random invalid calls cycle through the kinds as well; this makes sure of all of them from
        the start). Returns (requests sent, calls made)."""
        sent = made = 0
        for decoder in (self.with_text, self.ids_only):
            for kind in invalid_kinds(decoder.tokenizer is not None):
                size = int(self.rng.integers(1, 4))
                self._invalid_call(decoder, size, call + made, kind)
                self.report.counts["calls_invalid"] += 1
                sent, made = sent + size, made + 1
            self._valid_call(decoder, 2, call + made, probe=True)
            sent, made = sent + 2, made + 1
        return sent, made

    def _invalid_call(self, decoder: Decoder, size: int, call: int, kind: str | None = None) -> None:
        rng, report, cfg = self.rng, self.report, self.config
        text_ok = decoder.tokenizer is not None
        taken: set[tuple[int, ...]] = set()
        defaults = self._call_defaults(text_ok)
        requests = [self._request(taken, text_ok, defaults)[0] for _ in range(size)]
        kinds = invalid_kinds(text_ok)
        if kind is None:
            kind = kinds[self._next_invalid[text_ok] % len(kinds)]  # round robin: every kind comes up
            self._next_invalid[text_ok] += 1
        index = int(rng.integers(0, size))
        limit = cfg.max_positions
        bad = make_invalid(kind, index, list(self._prompt_ids(taken)), cfg.vocab_size, limit, text_ok)
        if bad.request is not None:
            requests[index] = bad.request
        elif bad.index == 0 and isinstance(requests[0], BatchRequest):
            requests[0] = requests[0].prompt  # a call-wide value reaches request 0 only if it has none of its own
        args: dict[str, Any] = {"prompts": requests, **defaults, "concurrency": int(rng.integers(1, 9))}
        args.update(bad.call)
        use_stream = rng.random() < 0.5
        report.counts["invalid"] += 1
        report.counts["rejected_with_invalid"] += size - (1 if bad.index is not None else 0)
        self._watch()
        try:
            prompts = args.pop("prompts")
            if use_stream:
                stream = decoder.stream_batch(prompts, **args)
                for _ in stream:  # if it got this far the request was not refused: run it out
                    pass
            else:
                decoder.generate_batch(prompts, **args)
        except (ValueError, TypeError) as exc:
            faulthandler.cancel_dump_traceback_later()
            message = str(exc)
            report.invalid_messages.setdefault(kind, f"{type(exc).__name__}: {message}")
            report.checks["invalid_named"] += 1
            needed = list(bad.fragments)
            if bad.index is not None:
                needed.insert(0, f"request {bad.index}:")
            missing = [f for f in needed if f not in message]
            if missing:
                report.problem(f"call {call}: invalid {kind} at request {bad.index}: the error does not name "
                               f"{missing}: {type(exc).__name__}: {message}")
            return
        except Exception as exc:  # noqa: BLE001
            faulthandler.cancel_dump_traceback_later()
            report.invalid_messages.setdefault(kind, f"{type(exc).__name__}: {exc}")
            report.problem(f"call {call}: invalid {kind} at request {bad.index} raised {type(exc).__name__} "
                           f"(not ValueError/TypeError): {exc}")
            return
        faulthandler.cancel_dump_traceback_later()
        report.problem(f"call {call}: invalid {kind} at request {bad.index} was accepted")

    # -- recording -------------------------------------------------------------------------------

    def _record(self, requests: int, calls: int) -> None:
        rss, peak = rss_mib()
        trimmed = trimmed_rss_mib()  # collects the cyclic garbage first: the counts below are what is held
        py_blocks, gc_objects = sys.getallocatedblocks(), len(gc.get_objects())
        trie = next((s for s in self.sources if getattr(s, "name", "") == "trie"), None)
        suffix = next((s for s in self.sources if getattr(s, "name", "") == "suffix"), None)
        window = sorted(self._interval)
        pick = lambda q: round(1000 * percentile(window, q), 1)  # noqa: E731
        counts = self.report.counts
        row = dict(requests=requests, calls=calls, seconds=round(time.perf_counter() - self._started, 2),
                   rss_mib=round(rss, 1), rss_trimmed_mib=round(trimmed, 1), peak_rss_mib=round(peak, 1),
                   py_blocks=py_blocks, gc_objects=gc_objects, new_tokens=self._new_tokens,
                   completed=counts["completed"], cancelled=counts["cancelled"], failed=counts["failed"],
                   invalid=counts["invalid"], latency_p50_ms=pick(0.5), latency_p99_ms=pick(0.99),
                   latency_max_ms=round(1000 * window[-1], 1) if window else 0.0,
                   trie_nodes=len(trie) if trie is not None else 0,
                   trie_trees=len(trie.tree_sizes()) if trie is not None else 0,
                   suffix_cached_requests=suffix.cached_requests if suffix is not None else 0,
                   suffix_cached_tokens=sum(len(s) for s in suffix.cached_sequences()) if suffix is not None else 0,
                   live_states=sum(live_states(s) for s in self.sources),
                   greedy_checked=self.report.checks["greedy_finished"] + self.report.checks["greedy_prefix"],
                   sampled_checked=self.report.checks["sampled_finished"] + self.report.checks["sampled_prefix"],
                   mismatches=self.report.mismatches, problems=len(self.report.problems))
        self._interval = []
        self.report.rows.append(row)
        if self.progress is not None:
            self.progress(row)


# -- summary, plot, files ------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0-1) of ``values`` (nearest rank), 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))])


def last_half_slope(rows: Sequence[dict[str, Any]], total: int, key: str = "rss_mib") -> tuple[float, float]:
    """Least-squares slope of ``key`` (an RSS column) over the rows of the last half of the run, in
    MiB per 1000 requests, and the change it implies over that half (MiB)."""
    half = [(r["requests"], r[key]) for r in rows if r["requests"] >= total / 2]
    if len(half) < 2:
        return 0.0, 0.0
    x = np.array([h[0] for h in half], dtype=float)
    y = np.array([h[1] for h in half], dtype=float)
    slope = float(np.polyfit(x, y, 1)[0])
    return slope * 1000, slope * (x[-1] - x[0])


def summarize(report: SoakReport) -> dict[str, Any]:
    """The figures of a run, as plain data for ``summary.json``."""
    rows, cfg = report.rows, report.config
    total = rows[-1]["requests"] if rows else 0
    half_rows = [r for r in rows if r["requests"] >= total / 2]

    def memory(key: str) -> dict[str, float]:
        per_1000, over_half = last_half_slope(rows, total, key)
        return {"start": rows[0][key] if rows else 0.0,
                "half": half_rows[0][key] if half_rows else 0.0,
                "end": rows[-1][key] if rows else 0.0,
                "last_half_min": min((r[key] for r in half_rows), default=0.0),
                "last_half_max": max((r[key] for r in half_rows), default=0.0),
                "last_half_slope_per_1000_requests": round(per_1000, 3),
                "last_half_fitted_change": round(over_half, 2)}

    ms = lambda v: round(1000 * v, 1)  # noqa: E731
    return {
        "requests": total,
        "calls": rows[-1]["calls"] if rows else 0,
        "seconds": round(report.seconds, 1),
        "outcomes": {k: report.counts[k] for k in ("completed", "cancelled", "failed", "invalid",
                                                   "rejected_with_invalid", "closed_before_admission")},
        "completed_early": {k: report.counts[k] for k in ("completed_on_eos", "completed_on_stop_string")},
        "reference_seconds": round(report.reference_seconds, 1),
        "calls_by_kind": {k: report.counts[k] for k in ("calls_generate", "calls_stream", "calls_closed",
                                                        "calls_abandoned", "abandoned_left_busy",
                                                        "calls_invalid", "calls_raised")},
        "failures_raised_by_where": report.raised_by_where,
        "checks": dict(report.checks),
        "mismatches": report.mismatches,
        "problems": len(report.problems),
        "problems_abandoned_stream_left_decoder_busy": report.counts["abandoned_left_busy"],
        "first_problems": report.problems[:50],
        "rss_mib": {**memory("rss_mib"), "peak": max((r["peak_rss_mib"] for r in rows), default=0.0)},
        "rss_trimmed_mib": memory("rss_trimmed_mib"),
        "python_heap": {key: {"start": rows[0][key], "half": half_rows[0][key], "end": rows[-1][key],
                              "last_half_slope_per_1000_requests": round(last_half_slope(rows, total, key)[0], 1)}
                        for key in ("py_blocks", "gc_objects")} if rows and half_rows else {},
        "latency_admission_to_finish_ms": {"p50": ms(percentile(report.latencies_s, 0.5)),
                                           "p99": ms(percentile(report.latencies_s, 0.99)),
                                           "max": ms(max(report.latencies_s, default=0.0))},
        "latency_call_to_output_ms": {"p50": ms(percentile(report.waits_s, 0.5)),
                                      "p99": ms(percentile(report.waits_s, 0.99)),
                                      "max": ms(max(report.waits_s, default=0.0))},
        "longest_call_ms": ms(max(report.call_seconds, default=0.0)),
        "new_tokens": rows[-1]["new_tokens"] if rows else 0,
        "sources_end": {k: rows[-1][k] for k in ("trie_nodes", "trie_trees", "suffix_cached_requests",
                                                 "suffix_cached_tokens", "live_states")} if rows else {},
        "live_states_after": report.live_after,
        "eos_ids": report.eos_ids,
        "caps": report.caps,
        "invalid_messages": report.invalid_messages,
        "config": asdict(cfg),
    }


def plot(rows: Sequence[dict[str, Any]], path: Path, title: str, caps: dict[str, int]) -> None:
    """RSS, per-interval latency, the shared sources' sizes and the Python heap over the run (200 dpi,
    12 pt)."""
    plt = require_matplotlib()
    plt.rcParams.update({"font.size": 12})
    x = [r["requests"] for r in rows]
    total = x[-1] if x else 0
    fig, axes = plt.subplots(4, 1, figsize=(10, 14), sharex=True)
    axes[0].plot(x, [r["rss_mib"] for r in rows], label="RSS")
    axes[0].plot(x, [r["rss_trimmed_mib"] for r in rows], label="RSS after gc + malloc_trim")
    axes[0].plot(x, [r["peak_rss_mib"] for r in rows], label="peak RSS", linestyle="--")
    half = [r for r in rows if r["requests"] >= total / 2]
    if len(half) >= 2:
        hx = np.array([r["requests"] for r in half], dtype=float)
        for key, name in (("rss_mib", "RSS"), ("rss_trimmed_mib", "trimmed")):
            fit = np.polyfit(hx, [r[key] for r in half], 1)
            axes[0].plot(hx, np.polyval(fit, hx), color="black", linestyle=":",
                         label=f"last-half fit ({name}): {fit[0] * 1000:+.2f} MiB / 1000 requests")
    axes[0].set_ylabel("MiB")
    axes[0].legend(loc="best", fontsize=11)
    axes[1].plot(x[1:], [r["latency_p50_ms"] for r in rows[1:]], label="p50")
    axes[1].plot(x[1:], [r["latency_p99_ms"] for r in rows[1:]], label="p99")
    axes[1].plot(x[1:], [r["latency_max_ms"] for r in rows[1:]], label="max", linestyle=":")
    axes[1].set_ylabel("admission to finish (ms)")
    axes[1].set_yscale("log")
    axes[1].legend(loc="upper right")
    axes[2].plot(x, [r["trie_nodes"] for r in rows], label="trie nodes")
    if caps.get("trie_max_nodes"):
        axes[2].axhline(caps["trie_max_nodes"], color="grey", linestyle=":", label="trie max_nodes")
    axes[2].plot(x, [r["suffix_cached_tokens"] for r in rows], label="suffix tree: cached tokens")
    axes[2].set_ylabel("size")
    axes[2].legend(loc="lower right")
    axes[3].plot(x, [r["py_blocks"] / 1e6 for r in rows], label="Python heap: allocated blocks")
    axes[3].plot(x, [r["gc_objects"] / 1e6 for r in rows], label="objects tracked by gc")
    axes[3].set_ylabel("millions")
    axes[3].set_xlabel("requests")
    axes[3].legend(loc="lower right")
    fig.suptitle(title, fontsize=13)
    fig.tight_layout()
    fig.savefig(path, dpi=200)
    plt.close(fig)


def cpu_name() -> str:
    """The CPU as ``lscpu`` names it, with family / model and the CPU count (the machine's name in results)."""
    fields: dict[str, str] = {}
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True, timeout=10).stdout
        for line in text.splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    name = fields.get("Model name") or platform.processor() or platform.machine()
    detail = []
    if {"CPU family", "Model"} <= set(fields):
        detail.append(f"family {fields['CPU family']} model {fields['Model']}")
    detail.append(f"{os.cpu_count()} CPUs")
    if fields.get("Hypervisor vendor"):
        detail.append(f"{fields['Hypervisor vendor']} guest")
    return f"{name} ({', '.join(detail)})"


def commit_of(path: Path) -> tuple[str, bool]:
    """(short commit, whether the work tree has changes) of the checkout holding ``path``."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=path, capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=path,
                                    capture_output=True, text=True, check=True, timeout=10).stdout.strip())
        return head, dirty
    except (OSError, subprocess.SubprocessError):
        return "unknown", False


def package_commit() -> tuple[str, bool]:
    """(short commit, uncommitted changes) of the checkout the imported ``specdraft`` comes from:
    read when the run starts, since that is the code that runs."""
    import specdraft

    return commit_of(Path(specdraft.__file__).resolve().parent)


def write_results(report: SoakReport, out: Path, command: str, commit: str, dirty: bool,
                  draw: bool = True) -> dict[str, Any]:
    """``summary.json``, ``soak.csv``, ``README.md`` and (with ``draw``) ``soak.png`` in ``out``."""
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(report)
    when = datetime.now(timezone.utc)
    summary["machine"] = {"cpu": cpu_name(), "torch_threads": torch.get_num_threads(),
                          "python": platform.python_version(), "torch": torch.__version__,
                          "transformers": transformers.__version__,
                          "niceness": os.nice(0) if hasattr(os, "nice") else None,
                          "load_average_at_end": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg")
                          else None}
    summary["commit"] = commit + ("+uncommitted changes" if dirty else "")
    summary["date"] = when.strftime("%Y-%m-%d %H:%M UTC")
    summary["command"] = command
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    with open(out / "soak.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(report.rows)
    cfg = report.config
    if draw:
        plot(report.rows, out / "soak.png",
             f"batched soak: {summary['requests']} requests, tiny float64 Qwen2, vocab {cfg.vocab_size}\n"
             f"{summary['machine']['cpu']}, commit {summary['commit']}", report.caps)
    o, r, lat, wait = summary["outcomes"], summary["rss_mib"], summary["latency_admission_to_finish_ms"], \
        summary["latency_call_to_output_ms"]
    t, ph = summary["rss_trimmed_mib"], summary["python_heap"]
    ch = summary["checks"]
    lines = [
        f"# Batched soak, {summary['date'][:10]}, commit {summary['commit']}",
        "",
        f"`{command}`, on {summary['machine']['cpu']}, one torch thread, niceness {summary['machine']['niceness']} "
        f"(load average {summary['machine']['load_average_at_end']} at the end); torch "
        f"{summary['machine']['torch']}, transformers {summary['machine']['transformers']}, "
        f"{summary['seconds']:.0f} s ({summary['reference_seconds']:.0f} s of it computing the references).",
        "",
        f"{summary['requests']} requests in {summary['calls']} calls ({summary['calls_by_kind']['calls_generate']} of "
        f"`generate_batch`, {summary['calls_by_kind']['calls_stream']} of `stream_batch` of which "
        f"{summary['calls_by_kind']['calls_closed']} closed early, {summary['calls_by_kind']['calls_invalid']} "
        f"refused for an invalid request), concurrency 1-{cfg.max_concurrency}, batches of 1-{cfg.max_batch}, "
        f"on a tiny random float64 Qwen2 (hidden 32, 2 layers, vocabulary {cfg.vocab_size}, EOS ids "
        f"{summary['eos_ids']}) with a word-level tokenizer; two decoders (tokenizer + adaptive budget, "
        f"no tokenizer + fixed budget of {cfg.fixed_tree_nodes} nodes) sharing the default sources and a "
        "source that raises on the requests whose prompt marks them (in `propose`, `observe` or `end`).",
        "",
        "| outcome | requests |",
        "|---|---|",
        f"| completed | {o['completed']} |",
        f"| cancelled | {o['cancelled']} |",
        f"| failed (their source raised) | {o['failed']} |",
        f"| invalid (refused, error checked) | {o['invalid']} |",
        f"| valid, in a call refused for another request | {o['rejected_with_invalid']} |",
        f"| queued when their stream was closed (no output) | {o['closed_before_admission']} |",
        "",
        f"- Mismatches: **{summary['mismatches']}** ({ch.get('greedy_finished', 0)} finished greedy requests "
        f"compared with `model.generate`, every {cfg.greedy_check_every}; {ch.get('greedy_prefix', 0)} cancelled "
        f"or failed ones compared as prefixes; {ch.get('sampled_finished', 0) + ch.get('sampled_prefix', 0)} "
        f"seeded sampled ones with the one-request decoder, every {cfg.sampled_check_every}). Problems of any "
        f"kind: {summary['problems']}, of which {summary['problems_abandoned_stream_left_decoder_busy']} of "
        f"{summary['calls_by_kind']['calls_abandoned']} streams left by `break` and dropped without `close()` "
        "left the decoder busy until the cyclic garbage collector ran.",
        f"- RSS: {r['start']:.0f} MiB after loading, {r['half']:.0f} MiB at half way, {r['end']:.0f} MiB at the "
        f"end (peak {r['peak']:.0f}); last half between {r['last_half_min']:.0f} and {r['last_half_max']:.0f} MiB, "
        f"slope {r['last_half_slope_per_1000_requests']:+.2f} MiB per 1000 requests "
        f"({r['last_half_fitted_change']:+.1f} MiB fitted over the last half). After `gc.collect()` and "
        f"`malloc_trim(0)` (what is really held, without the allocator's free pages): {t['start']:.0f}, "
        f"{t['half']:.0f} and {t['end']:.0f} MiB; last half between {t['last_half_min']:.0f} and "
        f"{t['last_half_max']:.0f} MiB, slope {t['last_half_slope_per_1000_requests']:+.2f} MiB per 1000 requests "
        f"({t['last_half_fitted_change']:+.1f} MiB over the last half).",
        f"- Python heap (after `gc.collect()`): {ph['py_blocks']['half']} allocated blocks at half way, "
        f"{ph['py_blocks']['end']} at the end ({ph['py_blocks']['last_half_slope_per_1000_requests']:+.0f} per 1000 "
        f"requests over the last half); objects tracked by gc {ph['gc_objects']['half']} and "
        f"{ph['gc_objects']['end']}.",
        f"- Latency, admission to finish: p50 {lat['p50']:.0f} ms, p99 {lat['p99']:.0f} ms, max {lat['max']:.0f} ms; "
        f"call made to output seen: p50 {wait['p50']:.0f} ms, p99 {wait['p99']:.0f} ms, max {wait['max']:.0f} ms; "
        f"longest call {summary['longest_call_ms']:.0f} ms.",
        f"- Sources at the end: trie {summary['sources_end'].get('trie_nodes')} nodes, suffix tree "
        f"{summary['sources_end'].get('suffix_cached_requests')} cached responses; live per-request states after "
        f"the run: {sum(summary['live_states_after'].values())}.",
        "",
        "Files: `summary.json` (all figures, the configuration, an example error message per invalid kind), "
        "`soak.csv` (a row every "
        f"{cfg.every} requests)" + (", `soak.png`." if draw else "."),
        "",
    ]
    (out / "README.md").write_text("\n".join(lines), encoding="utf-8")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=151_936,
                        help="vocabulary of the tiny random model (default: the default model's, %(default)s)")
    parser.add_argument("--greedy-check-every", type=int, default=1,
                        help="compare every N-th greedy request with model.generate (default: %(default)s)")
    parser.add_argument("--every", type=int, default=250, help="a CSV row every N requests (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None,
                        help="results directory (default: benchmarks/results/batch-soak-<date>-<commit>)")
    parser.add_argument("--no-plot", action="store_true", help="write no soak.png (needs no matplotlib)")
    args = parser.parse_args(argv)
    check_plotting(parser, args.no_plot)
    for name in ("requests", "greedy_check_every", "every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.vocab_size < 64:
        parser.error(f"--vocab-size must be >= 64, got {args.vocab_size}")
    torch.set_num_threads(1)
    config = SoakConfig(requests=args.requests, seed=args.seed, vocab_size=args.vocab_size,
                        greedy_check_every=args.greedy_check_every, every=args.every)
    out = args.out
    commit, dirty = package_commit()
    if out is None:
        out = Path(__file__).resolve().parent / "results" / \
            f"batch-soak-{datetime.now(timezone.utc).strftime('%Y-%m-%d')}-{commit}"

    def progress(row: dict[str, Any]) -> None:
        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)

    report = Soak(config, progress).run()
    command = "python benchmarks/batch_soak.py " + " ".join(argv if argv is not None else sys.argv[1:])
    summary = write_results(report, out, command.strip(), commit, dirty, draw=not args.no_plot)
    for line in report.problems[:20]:
        print("PROBLEM:", line, file=sys.stderr)
    shown = ("requests", "seconds", "outcomes", "mismatches", "problems", "rss_mib", "rss_trimmed_mib",
             "latency_admission_to_finish_ms")
    print(json.dumps({k: summary[k] for k in shown}, indent=1))
    print(f"wrote {out}")
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
