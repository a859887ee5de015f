"""The decoding methods a benchmark compares, behind one small interface.

Names (``--methods``):

``baseline``
    ``model.generate(do_sample=False)``: plain greedy decoding, the reference output and time.
``hf-prompt-lookup``
    ``model.generate(do_sample=False, prompt_lookup_num_tokens=10)``: transformers' own prompt
    lookup decoding, the bar to beat.
``generate-static``
    ``model.generate(do_sample=False, cache_implementation="static")``: transformers' own fastest
    path, a preallocated cache and, on a GPU, a forward compiled by ``torch.compile`` (what an
    informed user runs there; on a CPU transformers does not compile it).
``specdraft:<names>``
    our :class:`~specdraft.decoder.Decoder` with the draft sources ``<names>`` joined by ``+``
    (``specdraft:prompt``, ``specdraft:prompt+trie+ngram``); the names are those of
    :data:`specdraft.sources.registry.SOURCES`, read at run time, so a newly registered source is available
    (and in the default list) without touching this file. The prefix may be left out:
    ``prompt+trie`` means ``specdraft:prompt+trie``.
``default``
    the library's default combination for the model's device (what ``Decoder()`` uses there when
    no sources are given): :data:`specdraft.sources.registry.DEFAULT_SOURCES`, and on CUDA
    :data:`~specdraft.sources.registry.GPU_DEFAULT_SOURCES`.
``plain``
    our :class:`~specdraft.decoder.Decoder` with no draft sources and ``max_tree_nodes=0``: plain
    one-token decoding through our own loop. Next to ``plain@packed`` it separates what a kernel
    path gains from what speculation gains; the report's "vs plain" column divides each of our
    methods by the ``plain`` run on the same kernels.

Suffixes of our methods: ``@fixed`` switches the adaptive budget off, ``@nopause`` only its
drafting pauses (the budget's ``drafting_share = 0``, :mod:`specdraft.engine.pause`), ``@notrial``
only its weighing of the whole tree on CUDA (:mod:`specdraft.budget.whole_tree`); without a kernel suffix
the decoder runs the library's default, ``cpu_kernels="auto"`` (each forward width on the
cheapest exact path measured on this machine, see :mod:`specdraft.kernel_costs`); ``@stock``
runs ``cpu_kernels="stock"``, ``@packed`` ``"packed"`` (oneDNN-packed linear weights) and
``@fbgemm`` ``"fbgemm"`` (exact float16 weights on FBGEMM; see :mod:`specdraft.cpu_kernels`);
``@exact`` runs the method in exact mode (``Decoder(exact=True)``) and ``@noexact`` without it
(``exact=False``), whatever ``--exact`` says, so one run times both modes in the same process
(``plain,plain@exact``, or ``plain,plain@noexact`` where exact mode is the default); its "vs plain"
reference is ``plain`` with the same suffix. ``@flash`` runs the method on the flash split
(``Decoder(attention="flash")``, without exact mode; :mod:`specdraft.model.attention`), its
reference ``plain@flash``. ``@compiled`` runs it with ``Decoder(compile=True)`` (a GPU's decode
forwards through ``torch.compile``, without exact mode), its reference ``plain@compiled``. One
suffix of each kind may be given together (``default@fixed@packed@exact``,
``default@fixed@flash@compiled``). ``baseline`` and ``hf-prompt-lookup``
always run stock ``model.generate``.

**State across prompts.** Each method object is built once per dataset and keeps its draft
sources for the whole run, as a server would: a source that learns across requests (the
frequency trie) gets better as the run goes on, which is the setting its paper reports. Only
per-request state is reset between prompts, and the decoder does that itself
(``DraftSource.begin``/``end``). With ``--repeats R > 1`` the first R-1 timed runs of a prompt use
a *copy* of the sources (so the method does not learn the answer from its own repeats) and the
last run uses the live sources, so the state after the prompt is exactly "saw it once".
"""

from __future__ import annotations

import pickle
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

from ..baseline import time_plain_generate
from ..decoder import Decoder
from ..model.compat import cache_keyword
from ..source_spec import SourceSpecError, parse_source_spec, split_top_level
from ..sources import registry
from .checkpoint import dumps_with_locks

__all__ = ["BASELINE", "DEFAULT", "HF_PROMPT_LOOKUP", "PLAIN", "STATIC_GENERATE", "SUFFIX_KINDS", "Method",
           "MethodError", "MethodResult", "PlainGenerate", "SpecdraftMethod", "StaticGenerate", "build_method",
           "build_methods", "default_method_names", "parse_methods", "plain_reference", "valid_method_names"]

BASELINE = "baseline"
HF_PROMPT_LOOKUP = "hf-prompt-lookup"
STATIC_GENERATE = "generate-static"
DEFAULT = "default"
PLAIN = "plain"
PREFIX = "specdraft:"

#: ``prompt_lookup_num_tokens`` for transformers' prompt lookup (its documented typical value).
HF_PROMPT_LOOKUP_TOKENS = 10


class MethodError(ValueError):
    """A ``--methods`` value names no known method; the message lists the valid ones."""


@dataclass
class MethodResult:
    """One timed generation.

    ``accept_lengths`` has the tokens committed by each forward pass after the prompt (Spec-Bench's
    field; all ones for plain decoding), ``None`` if it could not be observed. ``steps`` counts
    those forward passes. ``per_source`` maps a draft source to ``{"proposed", "accepted"}`` draft
    tokens (empty for methods without our sources). ``skipped_drafts`` counts the steps that ran
    without drafting because recent drafts did not pay (``None`` for methods without our decoder).
    """

    token_ids: list[int]
    wall_time: float
    accept_lengths: list[int] | None
    steps: int | None
    per_source: dict[str, dict[str, int]] = field(default_factory=dict)
    skipped_drafts: int | None = None


class Method(Protocol):
    """What the runner needs from a method."""

    name: str
    description: str

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int, learn: bool = True) -> MethodResult:
        """Generate greedily and time it. ``learn=False``: leave no trace in cross-request state."""
        ...

    def get_state(self) -> Any:
        """The state carried from one prompt to the next (picklable; ``None`` if there is none),
        saved in a checkpoint after every prompt so an interrupted run can resume."""
        ...

    def set_state(self, state: Any) -> None:
        """Restore what :meth:`get_state` returned (when resuming from a checkpoint)."""
        ...


# --------------------------------------------------------------------------------------------
# the registry
# --------------------------------------------------------------------------------------------


def _arctic_suffix(**kwargs: Any) -> Any:
    from .arctic_suffix import ArcticSuffix

    return ArcticSuffix(**{"name": "arctic-suffix", **kwargs})


#: Sources only the benchmark offers, as measured peers, never in the default method list:
#: ``arctic-suffix`` runs the SuffixDecoding authors' C++ suffix tree (ArcticInference) through
#: our verifier (see :mod:`specdraft.bench.arctic_suffix` for how to build it).
BENCH_ONLY_SOURCES: dict[str, Callable[..., Any]] = {"arctic-suffix": _arctic_suffix}


def _sources() -> dict[str, Callable[..., Any]]:
    """The library's registered sources plus the benchmark-only peers."""
    return {**registry.SOURCES, **BENCH_ONLY_SOURCES}


def default_method_names() -> list[str]:
    """baseline, hf-prompt-lookup, every registered source alone, and ``default`` when it
    combines more than one source (with a single source it would repeat ``specdraft:<it>``)."""
    names = [BASELINE, HF_PROMPT_LOOKUP] + [PREFIX + s for s in registry.SOURCES]
    if len(registry.default_source_names()) > 1:
        names.append(DEFAULT)
    return names


def valid_method_names() -> str:
    """The valid ``--methods`` names, for help and error messages."""
    sources = ", ".join(_sources())
    kernels, exact, attention, compiled = (" or ".join(SUFFIX_KINDS[kind].suffixes)
                                          for kind in ("kernels", "exact", "attention", "compile"))
    return (f"{BASELINE}, {HF_PROMPT_LOOKUP}, {STATIC_GENERATE}, {DEFAULT}, {PLAIN}, or {PREFIX}<sources joined by +> "
            f"with sources from: {sources} (each NAME or NAME[key=value,...]); add @fixed to one of ours to "
            f"switch its adaptive budget off, {kernels} to run it on those CPU kernels instead of "
            f"{DEFAULT_KERNELS!r}, {exact} to run it with exact mode on or off, "
            f"{attention} to run it on that attention, {compiled} to compile its GPU forwards")


#: What a method without a kernel suffix runs: the library's default.
DEFAULT_KERNELS = "auto"


@dataclass(frozen=True)
class _SuffixKind:
    """One kind of method-name suffix: suffix -> value, the value without one, what it names."""

    suffixes: dict[str, Any]
    default: Any
    what: str


#: The kinds of suffix our methods take, in the order a canonical name lists them (see the module docstring).
#: ``budget``: ``@fixed`` turns the adaptive tree budget off (every step checks up to ``--max-tree-nodes``
#: nodes), ``@nopause`` keeps it but never pauses drafting, ``@notrial`` never weighs the whole tree against
#: its choice (the trial runs on CUDA only, :mod:`specdraft.budget.whole_tree`). ``kernels``:
#: ``Decoder(cpu_kernels=...)``. ``exact``: exact mode on or off whatever ``--exact`` says. ``attention``:
#: the flash split (``Decoder(attention="flash")``, without exact mode), timed against ``sdpa`` by
#: ``plain@flash,default@flash`` beside ``plain@noexact,default@noexact``. ``compile``:
#: ``Decoder(compile=True)`` (CUDA only), timed by ``plain@compiled,default@compiled`` beside ``plain,default``.
SUFFIX_KINDS = {"budget": _SuffixKind({"@fixed": "fixed", "@nopause": "nopause", "@notrial": "notrial"},
                                      "adaptive", "budgets"),
                "kernels": _SuffixKind({"@stock": "stock", "@packed": "packed", "@fbgemm": "fbgemm"},
                                       DEFAULT_KERNELS, "CPU kernels"),
                "exact": _SuffixKind({"@exact": True, "@noexact": False}, None, "exact modes"),
                "attention": _SuffixKind({"@flash": "flash"}, None, "attention backends"),
                "compile": _SuffixKind({"@compiled": True}, False, "compile modes")}


def _split_suffixes(name: str) -> tuple[str, dict[str, Any]]:
    """``(base, {kind: value})`` of a method name with at most one suffix of each kind
    (:data:`SUFFIX_KINDS`), in any order; a kind without a suffix has its default value."""
    name = name.strip()
    chosen = {kind: spec.default for kind, spec in SUFFIX_KINDS.items()}
    named: set[str] = set()
    while True:
        found = next(((kind, s) for kind, spec in SUFFIX_KINDS.items() for s in spec.suffixes if name.endswith(s)), None)
        if found is None:
            return name, chosen
        kind, suffix = found
        spec = SUFFIX_KINDS[kind]
        if kind in named:
            raise MethodError(f"method {name + _suffix(kind, chosen[kind])!r} names two {spec.what}; give at most one "
                              f"of {list(spec.suffixes)}")
        named.add(kind)
        name, chosen[kind] = name[: -len(suffix)].strip(), spec.suffixes[suffix]


def _suffix(kind: str, value: Any) -> str:
    """The method-name suffix of ``value`` of ``kind`` (empty for the kind's default)."""
    return next((s for s, v in SUFFIX_KINDS[kind].suffixes.items() if v == value and value is not None), "")


def _suffixes(chosen: dict[str, Any]) -> str:
    """Every suffix of ``chosen`` (from :func:`_split_suffixes`), in canonical order."""
    return "".join(_suffix(kind, value) for kind, value in chosen.items())


def plain_reference(name: str) -> str:
    """The ``plain`` method on the same kernels, in the same mode and on the same attention as our
    method ``name`` (``plain``, ``plain@packed``, ``plain@exact``, ``plain@flash``, ...)."""
    _, chosen = _split_suffixes(name)
    return PLAIN + _suffixes({**chosen, "budget": SUFFIX_KINDS["budget"].default})


def _canonical(name: str) -> str:
    name, chosen = _split_suffixes(name)
    suffixes = _suffixes(chosen)
    if suffixes:
        base = _canonical(name)
        for kind, value in chosen.items():
            if _suffix(kind, value) and base in (BASELINE, HF_PROMPT_LOOKUP, STATIC_GENERATE):
                raise MethodError(f"{_suffix(kind, value)} applies to our decoder's methods, not to {base!r}")
        if chosen["budget"] != "adaptive" and base == PLAIN:
            raise MethodError(f"{_suffix('budget', chosen['budget'])} means nothing for {PLAIN!r}, which checks no drafts")
        if chosen["exact"] and chosen["compile"]:
            raise MethodError(f"method {name + suffixes!r}: exact mode runs on eager kernels; @compiled runs without "
                              f"it (drop @exact)")
        if chosen["exact"] and chosen["attention"] is not None:
            raise MethodError(f"method {name + suffixes!r}: exact mode runs its own attention; "
                              f"{_suffix('attention', chosen['attention'])} runs without it (drop @exact)")
        return base + suffixes
    if name in (BASELINE, HF_PROMPT_LOOKUP, STATIC_GENERATE, DEFAULT, PLAIN):
        return name
    body = name[len(PREFIX):] if name.startswith(PREFIX) else name
    sources = _sources()
    if body not in sources and not any(c in body for c in "[+"):  # one bare word: not a method at all
        raise MethodError(f"unknown method {name!r}; valid: {valid_method_names()}")
    try:
        parts = [parse_source_spec(p, sources).text for p in split_top_level(body, "+")]
    except SourceSpecError as exc:
        raise MethodError(f"method {name!r}: {exc}; valid methods: {valid_method_names()}") from None
    except ImportError as exc:  # a benchmark-only peer that is not installed: its message says how
        raise MethodError(f"method {name!r}: {exc}") from None
    if not parts:
        raise MethodError(f"unknown method {name!r}; valid: {valid_method_names()}")
    if len(set(parts)) != len(parts):
        raise MethodError(f"method {name!r} lists a draft source twice")
    return PREFIX + "+".join(parts)


def parse_methods(text: str | None) -> list[str]:
    """Canonical method names from a ``--methods`` comma list (None: the default list).

    ``baseline`` is always run, first, because every speedup and identity check is against it.
    """
    if text is None or not text.strip():
        return default_method_names()
    names: list[str] = []
    try:
        parts = split_top_level(text)
    except SourceSpecError as exc:
        raise MethodError(f"--methods: {exc}") from None
    for part in parts:
        name = _canonical(part)
        if name in names:
            raise MethodError(f"method {name!r} is listed twice in --methods")
        names.append(name)
    if not names:
        raise MethodError(f"--methods needs at least one method; valid: {valid_method_names()}")
    return [BASELINE] + [name for name in names if name != BASELINE]


# --------------------------------------------------------------------------------------------
# plain model.generate (baseline and transformers' prompt lookup)
# --------------------------------------------------------------------------------------------


@contextmanager
def _cache_lengths(model: Any) -> Iterator[list[int | None]]:
    """The KV-cache length at each of the model's forward calls inside the block (``None`` where it
    cannot be read), which gives the tokens each forward committed (:func:`_accept_lengths`). It is
    a forward pre-hook (a public torch API), so nothing in transformers is patched; the cost is one
    attribute read per call."""
    lengths: list[int | None] = []
    keyword = cache_keyword(model)  # generate() passes the cache under the keyword this release's forward takes

    def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        cache = kwargs.get(keyword)
        try:
            lengths.append(int(cache.get_seq_length()) if cache is not None else None)
        except Exception:  # an exotic cache type: fall back to counting calls only
            lengths.append(None)

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield lengths
    finally:
        handle.remove()


def _accept_lengths(lengths: list[int | None], prompt_length: int, new_tokens: int) -> list[int] | None:
    """Tokens committed per forward, if the cache lengths tell them consistently.

    The first forward sees the whole prompt; later ones start with the cache holding every
    committed token but the newest. So the committed length before forward ``k >= 1`` is
    ``cache_length_k + 1``, and the differences between successive committed lengths are the
    accept lengths. Anything inconsistent (a cache not reported, a step of 0) gives ``None``.
    """
    if not lengths or new_tokens == 0:
        return [] if new_tokens == 0 else None
    if any(v is None for v in lengths[1:]):
        return None
    committed = [prompt_length] + [v + 1 for v in lengths[1:]] + [prompt_length + new_tokens]  # type: ignore[operator]
    steps = [b - a for a, b in zip(committed, committed[1:])]
    if any(s < 1 for s in steps) or sum(steps) != new_tokens:
        return None
    return steps


class PlainGenerate:
    """``model.generate`` with fixed keyword arguments, timed like ``specdraft generate --compare``."""

    def __init__(self, name: str, model: Any, gen_kwargs: dict[str, Any], description: str) -> None:
        self.name = name
        self.model = model
        self.gen_kwargs = dict(gen_kwargs)
        self.description = description

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int, learn: bool = True) -> MethodResult:
        with _cache_lengths(self.model) as lengths:
            tokens, seconds = time_plain_generate(self.model, list(prompt_ids), max_new_tokens, **self.gen_kwargs)
        accept = _accept_lengths(lengths, len(prompt_ids), len(tokens))
        steps = len(accept) if accept is not None else len(lengths)
        return MethodResult(token_ids=list(tokens), wall_time=seconds, accept_lengths=accept, steps=steps)

    def get_state(self) -> None:
        return None  # model.generate keeps nothing between prompts

    def set_state(self, state: None) -> None:
        """Nothing to restore: the checkpoint holds this method's :meth:`get_state`, None."""


class StaticGenerate(PlainGenerate):
    """``generate-static`` as an informed user runs it: on an accelerator its compile is paid once,
    before the first timed prompt, by an untimed call whose static cache is long enough for the
    prompts that follow (:data:`WARM_CACHE_TOKENS`). transformers keeps a static cache at least as
    long as the longest one it made, so later prompts reuse the compiled step instead of each
    longer one compiling it again; timing the compile would make the baseline look minutes slow.
    It runs without the forward hook that counts the other methods' steps (see :meth:`run`)."""

    #: the cache length the untimed first call sizes the static cache for
    WARM_CACHE_TOKENS = 2048
    #: decode steps of the untimed call (the compiled step runs, and its graphs are recorded)
    WARM_STEPS = 4
    #: the cache length the last untimed call sized the static cache for (:meth:`warm_up`)
    warm_tokens = 0

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int, learn: bool = True) -> MethodResult:
        _warm_up_if_short(self, prompt_ids, max_new_tokens)
        # no forward hook here: inside the compiled forward its read of the cache length breaks
        # the graph and waits for the device at every step. Every forward commits one token.
        tokens, seconds = time_plain_generate(self.model, list(prompt_ids), max_new_tokens, **self.gen_kwargs)
        return MethodResult(token_ids=list(tokens), wall_time=seconds, accept_lengths=[1] * len(tokens),
                            steps=len(tokens))

    def warm_up(self, prompt_ids: Sequence[int], cache_tokens: int) -> None:
        """One untimed call whose prompt and new tokens fill ``cache_tokens`` positions."""
        length = cache_tokens - self.WARM_STEPS
        filler = (list(prompt_ids) * (length // max(1, len(prompt_ids)) + 1))[:length]
        time_plain_generate(self.model, filler, self.WARM_STEPS, **self.gen_kwargs)
        self.warm_tokens = cache_tokens


def _warm_up_if_short(method: StaticGenerate | SpecdraftMethod, prompt_ids: Sequence[int],
                      max_new_tokens: int) -> None:
    """On an accelerator, one untimed ``method.warm_up`` before the first prompt longer than the
    last warm-up sized for; on a CPU transformers compiles nothing and our decoder captures nothing."""
    needed = len(prompt_ids) + max_new_tokens
    if method.warm_tokens < needed and getattr(method.model, "device", None) is not None \
            and method.model.device.type != "cpu":
        method.warm_up(prompt_ids, max(needed, StaticGenerate.WARM_CACHE_TOKENS))


# --------------------------------------------------------------------------------------------
# ours
# --------------------------------------------------------------------------------------------


class SpecdraftMethod:
    """Our decoder with a fixed set of draft sources, kept for the whole run (see the module
    docstring on state across prompts)."""

    #: the cache length an untimed first call sized the decoder for (:meth:`warm_up`)
    warm_tokens = 0

    def __init__(self, name: str, model: Any, tokenizer: Any, source_names: Sequence[str],
                 max_tree_nodes: int | None = None, adaptive_budget: bool = True, cpu_kernels: str = DEFAULT_KERNELS,
                 exact: bool | None = None, drafting_pauses: bool = True, attention: str = "auto",
                 compile: bool = False, whole_tree_trial: bool = True) -> None:
        self.name = name
        self.source_names = list(source_names)
        #: ``Decoder``'s keyword arguments; the budget's two switches below are set on each decoder
        self.decoder_options = dict(max_tree_nodes=max_tree_nodes, adaptive_budget=adaptive_budget,
                                    cpu_kernels=cpu_kernels, exact=exact, attention=attention, compile=compile)
        self.drafting_pauses = drafting_pauses
        self.whole_tree_trial = whole_tree_trial
        self.description = (("specdraft Decoder with sources " + "+".join(self.source_names) if self.source_names
                             else "specdraft Decoder, plain decoding (no sources, max_tree_nodes=0)")
                            + ("" if adaptive_budget else ", fixed budget")
                            + ("" if drafting_pauses else ", no drafting pauses")
                            + ("" if whole_tree_trial else ", no whole-tree trial")
                            + f", cpu_kernels={cpu_kernels!r}"
                            + ("" if attention == "auto" else f", attention={attention!r}")
                            + (", compile=True" if compile else ""))
        self.model = model
        self.tokenizer = tokenizer
        self.sources = registry.make_sources(self.source_names, _sources())
        self.decoder = self._decoder_for(self.sources)
        self.description += ((f", max_tree_nodes={self.decoder.max_tree_nodes}" if self.source_names else "")
                             + f" ({self.decoder.kernels.describe()})")  # which path ran, what it costs
        if self.decoder.exact:
            self.description += f", exact mode ({self.decoder.engine.padding})"
        if "at most 5%" in self.decoder.exact_note:  # the default was priced on this machine: say how
            self.description += f"; {self.decoder.exact_note}"

    def _decoder_for(self, sources: list[Any], budget: Any = None) -> Any:
        """A Decoder over ``sources`` with this method's options; ``budget``: an adaptive budget to run
        instead of a fresh one (a copy, or one restored from a checkpoint)."""
        decoder = Decoder(self.model, self.tokenizer, sources=sources, **self.decoder_options)
        if not self.drafting_pauses:
            decoder.budget.drafting_share = 0.0
        if not self.whole_tree_trial:
            decoder.budget.whole_tree = None
        if budget is not None:
            decoder.budget = budget
        return decoder

    def _throwaway_decoder(self) -> Any:
        """A decoder for a repeat that must not teach the real one: copies of the draft sources
        *and* of the adaptive budget (its measured costs and acceptance), so the repeat is timed
        with what the method has learned so far, not with a fresh, still-warming-up budget."""
        try:  # one round trip for both, so references they share stay shared in the copy
            sources, budget = pickle.loads(dumps_with_locks((list(self.sources), self.decoder.budget)))
        except Exception as exc:
            raise RuntimeError(
                f"method {self.name}: a draft source cannot be copied ({type(exc).__name__}: {exc}), so repeated "
                "timings would let it learn from its own repeats; run with --repeats 1") from exc
        return self._decoder_for(sources, budget)

    def warm_up(self, prompt_ids: Sequence[int], cache_tokens: int) -> None:
        """On an accelerator, what ``generate-static`` gets (:class:`StaticGenerate`): one untimed
        call sized for ``cache_tokens`` positions (:meth:`specdraft.decoder.Decoder.warm_up`: the
        draft sources set aside, the graphs captured, the KV store sized), so no timed prompt pays
        for a capture or for the captures again after the store's buffers grow."""
        self.decoder.warm_up(cache_tokens)
        self.warm_tokens = cache_tokens

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int, learn: bool = True) -> MethodResult:
        _warm_up_if_short(self, prompt_ids, max_new_tokens)
        decoder = self.decoder if learn else self._throwaway_decoder()
        start = time.perf_counter()
        out = decoder.generate(list(prompt_ids), max_new_tokens=max_new_tokens, do_sample=False)
        seconds = time.perf_counter() - start
        stats = out.stats
        return MethodResult(token_ids=list(out.token_ids), wall_time=seconds,
                            accept_lengths=list(stats.accept_lengths), steps=stats.steps,
                            per_source={k: v.as_dict() for k, v in stats.per_source.items()},
                            skipped_drafts=stats.skipped_drafts)

    def get_state(self) -> dict[str, Any]:
        """The draft sources (which learn across prompts) and the adaptive budget (which has
        measured the step costs), as they stand now."""
        return {"sources": self.sources, "budget": self.decoder.budget}

    def set_state(self, state: dict[str, Any]) -> None:
        self.sources = list(state["sources"])
        self.decoder = self._decoder_for(self.sources, state["budget"])
        self.warm_tokens = 0


def build_method(name: str, model: Any, tokenizer: Any, max_tree_nodes: int | None = None, exact: bool | None = None
                 ) -> Method:
    """A method object for a canonical name (see :func:`parse_methods`); ``exact`` is
    ``Decoder(exact=...)`` for each of our methods without ``@exact`` (``None``: the library's
    default)."""
    if name == BASELINE:
        return PlainGenerate(name, model, {"do_sample": False}, "model.generate(do_sample=False)")
    if name == HF_PROMPT_LOOKUP:
        return PlainGenerate(name, model, {"do_sample": False, "prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_TOKENS},
                             f"model.generate(do_sample=False, prompt_lookup_num_tokens={HF_PROMPT_LOOKUP_TOKENS})")
    if name == STATIC_GENERATE:
        return StaticGenerate(name, model, {"do_sample": False, "cache_implementation": "static"},
                              'model.generate(do_sample=False, cache_implementation="static")')
    base, chosen = _split_suffixes(name)
    suffix = _suffixes(chosen)
    attention = chosen["attention"] or "auto"
    if chosen["exact"] is not None:
        exact = chosen["exact"]
    elif attention != "auto" or chosen["compile"]:
        exact = False  # another attention than the default, or compiled forwards, run without exact mode
    options = dict(cpu_kernels=chosen["kernels"], exact=exact, attention=attention, compile=chosen["compile"])
    if base == PLAIN:
        return SpecdraftMethod(PLAIN + suffix, model, tokenizer, [], 0, adaptive_budget=True, **options)
    budget = chosen["budget"]
    options.update(adaptive_budget=budget != "fixed", drafting_pauses=budget in ("adaptive", "notrial"),
                   whole_tree_trial=budget != "notrial")
    sources = "+".join(registry.default_source_names(getattr(model, "device", None))) if base == DEFAULT else base
    canonical = _canonical(sources)
    return SpecdraftMethod((DEFAULT if base == DEFAULT else canonical) + suffix, model, tokenizer,
                           split_top_level(canonical[len(PREFIX):], "+"), max_tree_nodes, **options)


def build_methods(names: Sequence[str], model: Any, tokenizer: Any, max_tree_nodes: int | None = None,
                  exact: bool | None = None) -> list[Method]:
    return [build_method(n, model, tokenizer, max_tree_nodes, exact) for n in names]
