"""The public face: :class:`Decoder` checks arguments and runs them through the engine.

``generate`` and ``stream`` are a batch of one; ``generate_batch`` and ``stream_batch`` run many
requests, up to ``concurrency`` per forward. All four go through the same step
(:mod:`specdraft.engine`): draft, plan, lay out, forward, read back, settle.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from .batching import BatchRequest, BatchStream, stream_pieces
from .budget import Budget, WholeTreeTrial
from .checks import check_int
from .engine import BatchResult, Drafter, Engine, RequestSpec
from .engine.widths import RowWidths, exact_buckets, exact_default
from .model.static import COMPILE_BACKEND, Buckets
from .kernels.attention_cost import attention_seconds
from .kernels.exact_kernels import PRICE_LIMIT, ExactKernels, choose_exact_kernels
from .kernels.exact_rows import ExactRowsError, RowRule, load_or_probe
from .kernels.kernel_costs import choose_kernels
from .model.attention import ATTENTION_CHOICES, select_attention
from .model.exact_attention import CHUNK, check_exact_runs_on
from .model.runner import ModelRunner
from .sampling import resolve_settings
from .sources.base import DraftSource
from .sources.registry import default_sources
from .stats import GenerationStats
from .stopping import StopRule, eos_ids

#: The largest tree a decoder accepts: far past what pays on any hardware (trees of 16-80 nodes
#: are the useful range), and small enough that a typo cannot make every step a huge forward.
MAX_TREE_NODES = 1024

#: ``max_tree_nodes`` when none is given, by device kind (:func:`default_max_tree_nodes`).
DEFAULT_MAX_TREE_NODES = {"cpu": 32, "cuda": 63}


def default_max_tree_nodes(device: Any = None) -> int:
    """The largest tree a decoder checks by default on ``device``. On a CPU every row of a forward
    costs, and the adaptive budget rarely checks more than about 16 nodes there, so 32 leaves it
    room. On a CUDA GPU a forward of 64 rows, the widest captured width, costs little more than
    one of 1 (``benchmarks/results/gpu-h200-2026-11-27-1ab377a``: the matrix products alike, the
    rest 22% dearer), and a tree that fills it accepts more: on MT-Bench, with Token Recycling's
    80-node template among the sources, fixed trees of 64 nodes commit 2.29 tokens per step and
    trees of 32 nodes 2.00 (``benchmarks/results/tree-width-*``). The budget still sizes each step
    below the cap."""
    kind = torch.device(device).type if device is not None else "cpu"
    return DEFAULT_MAX_TREE_NODES.get(kind, DEFAULT_MAX_TREE_NODES["cpu"])


#: Steps every decoder gives its sources at the full budget before the budget judges them.
WARMUP_STEPS = 3


@dataclass
class GenerationOutput:
    """The result of :meth:`Decoder.generate`: new tokens only (the prompt is not repeated)."""

    token_ids: list[int]
    text: str | None
    stats: GenerationStats


def _check_options(model: Any, max_tree_nodes: Any, attention: Any, exact: Any, compile: Any) -> None:
    """Refuse a :class:`Decoder` option outside what is allowed, naming the value and what is."""
    if isinstance(max_tree_nodes, bool) or not isinstance(max_tree_nodes, int) \
            or not 0 <= max_tree_nodes <= MAX_TREE_NODES:
        raise ValueError(f"max_tree_nodes must be an int in [0, {MAX_TREE_NODES}] (0 = plain decoding), "
                         f"got {max_tree_nodes!r}")
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"attention must be one of {list(ATTENTION_CHOICES)}, got {attention!r}")
    if not isinstance(compile, bool):
        raise ValueError(f"compile must be True or False, got {compile!r}")
    if exact and compile:
        raise ValueError("exact=True pads forwards to widths probed on the eager kernels; compile=True runs "
                         "others, so the two cannot be combined (pass exact=False, or compile=False)")
    device = getattr(model, "device", torch.device("cpu"))
    if compile and getattr(device, "type", None) != "cuda":
        raise ValueError(f"compile=True compiles the decode forwards that a CUDA GPU captures as graphs; the "
                         f"model is on {device} (leave compile=False there)")
    if exact not in (None, True, False):
        raise ValueError(f"exact must be True, False or None (the default per device and dtype), got {exact!r}")
    if exact and attention not in ("auto", "exact"):
        raise ValueError(f"exact=True runs its own attention; it cannot be combined with attention={attention!r} "
                         "(leave attention='auto')")


class Decoder:
    """Lossless speculative decoding of a Hugging Face causal LM with draft-model-free sources.

    >>> dec = Decoder(model, tokenizer, sources=[PromptLookup()], max_tree_nodes=32)
    >>> out = dec.generate("def add(a, b):", max_new_tokens=64)
    >>> out.text, out.stats.mean_accepted

    Greedy output equals ``model.generate(do_sample=False)`` token for token; sampled output has
    the distribution of ``model.generate(do_sample=True)`` with the same settings. One decoder
    runs one call at a time (it owns its KV cache); make one per thread, or give many requests to
    one :meth:`generate_batch` call, which decodes them together in one forward per step. Sources
    may be shared.

    ``max_tree_nodes`` caps the draft nodes checked per forward (``None``: 32 on a CPU, 63 on a
    CUDA GPU, :func:`default_max_tree_nodes`). With ``adaptive_budget`` (the
    default) each step's tree is sized below that cap from measured acceptance and step cost, down
    to plain one-token decoding when drafts do not pay (see :mod:`specdraft.budget`); on a CUDA
    GPU, where width is nearly free, it also measures its choice against the whole tree and runs
    the one that commits more tokens per second (:mod:`specdraft.budget.whole_tree`); pass
    ``adaptive_budget=False`` to always use the cap, e.g. to benchmark fixed budgets.
    ``attention`` picks the backend (see :func:`specdraft.model.attention.select_attention`):
    ``"auto"``, ``"sdpa"``, ``"eager"`` or ``"flash"``; the decoder switches the model's attention
    implementation to it through transformers' public ``set_attn_implementation`` for each call
    and back after it, so ``model.generate`` and other decoders over the same model keep theirs.
    ``cpu_kernels="packed"`` runs the model's linear layers on weights packed once for oneDNN
    (float32 or bfloat16 on a CPU), which makes a forward of many tree tokens nearly as cheap as
    a one-token one; ``"fbgemm"`` runs them on FBGEMM's float16-weight kernel where float16 holds
    the weights exactly (bfloat16 and float16 checkpoints: the fast bfloat16 path on CPUs without
    AVX512-BF16). Both hold a second copy of the linear weights until :meth:`close` and may round
    differently from stock kernels in the order of their additions (see
    :mod:`specdraft.kernels.cpu_kernels`). The default ``"auto"`` measures these paths on first use
    on a machine (cached) and runs each forward width on the cheapest
    (:mod:`specdraft.kernels.kernel_costs`, :attr:`kernels` says what it picked); ``"stock"`` uses
    the model's own modules.

    ``exact=True`` makes every logit row of a decode forward bit for bit what a plain one-token
    step of this decoder computes for the same prefix, whatever else shares the forward (other
    tree nodes, side blocks, other requests, padding): each forward is padded to a width at which
    the linear and normalization layers compute every row alike
    (:mod:`specdraft.kernels.exact_rows`, probed once per machine and model) and attention runs
    :mod:`specdraft.model.exact_attention`. Then
    speculation gives the very tokens of plain decoding in bfloat16 and float16 too, where
    rounding otherwise parts them at near-ties. On a CPU it runs one kernel path at every width,
    the one whose padded forwards cost least here (:mod:`specdraft.kernels.exact_kernels`). The
    default (``None``) is on where it costs at most 5%, with ``attention="auto"``: bfloat16 and
    float16 models on a CPU whose measured price is that low (AMD EPYCs; not an Intel Xeon with
    AMX, where oneDNN's rows agree only from 37 rows), and bfloat16 on a CUDA GPU where exact
    attention's Triton kernels run (:func:`~specdraft.engine.widths.exact_default`).
    :attr:`exact_note` says which and why.

    ``compile=True`` (CUDA only) runs the decode forwards through ``torch.compile`` before they
    are captured as CUDA graphs: the compiler fuses the model's many small kernels (norms, rotary
    embeddings, activations), which a graph replays one after another. The first requests pay
    two compiles, tens of seconds in all (call :meth:`warm_up` before serving). Like transformers'
    compiled ``generate``, the fused kernels round differently from eager ones, so greedy outputs
    may part from eager ``model.generate`` at near-ties. It runs without exact mode, whose widths
    are probed on the eager kernels (a width-1 forward and a wider one compile to different
    kernels). Where compiling fails, the forwards run uncompiled and ``runner.static.note`` says why.
    """

    def __init__(self, model: Any, tokenizer: Any = None, sources: Sequence[DraftSource] | None = None,
                 max_tree_nodes: int | None = None, adaptive_budget: bool = True, attention: str = "auto",
                 cpu_kernels: str = "auto", exact: bool | None = None, compile: bool = False) -> None:
        if max_tree_nodes is None:
            max_tree_nodes = default_max_tree_nodes(getattr(model, "device", None))
        _check_options(model, max_tree_nodes, attention, exact, compile)
        exact, exact_kernels, note = self._choose_exact(model, cpu_kernels, attention, exact, compile)
        #: whether forwards are padded and attention is exact (see the class docstring)
        self.exact: bool = exact
        #: why exact mode is on or off, and on a CPU which kernels it runs and what it costs
        self.exact_note: str = note
        #: the draft sources (a list the engine reads: a source added or removed here takes part
        #: from the next request on)
        self.sources: list[DraftSource] = (list(sources) if sources is not None
                                           else default_sources(getattr(model, "device", None)))
        if len(self.sources) > 62:
            raise ValueError(f"at most 62 sources can be combined, got {len(self.sources)}")
        for s in self.sources:
            if isinstance(s, type):
                raise TypeError(f"{s.__name__} is a class, not a DraftSource: pass an instance, {s.__name__}()")
            if not isinstance(s, DraftSource):
                raise TypeError(f"{s!r} is not a DraftSource: it needs name, begin, propose, observe and end")
        self.model = model
        self.tokenizer = tokenizer
        self.max_tree_nodes = max_tree_nodes
        #: whether decode forwards run through ``torch.compile`` (see the class docstring)
        self.compile = compile
        previous = getattr(model.config, "_attn_implementation", None)
        if self.exact:
            check_exact_runs_on(getattr(model, "device", torch.device("cpu")))
        self.attention = select_attention(model, "exact" if self.exact else attention)
        runner = ModelRunner(model)
        #: the CPU kernels per forward width and their measured costs (see :mod:`specdraft.kernels.kernel_costs`)
        self.kernels = exact_kernels.kernels if exact_kernels is not None else choose_kernels(model, cpu_kernels)
        self.cpu_kernels = cpu_kernels
        #: the packed linear weights swapped in around each forward (``cpu_kernels="auto"``,
        #: ``"packed"`` or ``"fbgemm"``; ``None``: stock kernels)
        self.packed_weights = self.kernels.release_packed()
        drafter = Drafter(self.sources, max_tree_nodes, runner.vocab_size, runner.max_positions)
        budget = Budget(max_tree_nodes, len(self.sources), adaptive=adaptive_budget,
                        cost_curve=self.kernels.curve if adaptive_budget else None,
                        attention_seconds=attention_seconds(model) if adaptive_budget else 0.0,
                        warmup=max(WARMUP_STEPS, drafter.warmup_steps))
        self.engine = Engine(runner, drafter, budget, kernels=self._kernels_context, text=self._text,
                             attention=self.attention)
        self._widths(exact_kernels.rule if exact_kernels is not None else None)
        if runner.device.type == "cuda":  # width is nearly free: the whole tree may pay more than rates say
            budget.whole_tree = WholeTreeTrial()
        if previous is not None and previous != self.attention:  # the engine switches it per call
            model.set_attn_implementation(previous)

    @classmethod
    def from_pretrained(cls, name_or_path: str, sources: Sequence[DraftSource] | None = None,
                        dtype: str | torch.dtype = "float32", max_tree_nodes: int | None = None,
                        adaptive_budget: bool = True, attention: str = "auto",
                        cpu_kernels: str = "auto") -> "Decoder":
        """Load model and tokenizer (a checkpoint dir, a ``.gguf`` file or a hub id, see
        :func:`specdraft.models.load_model`) and wrap them in a decoder."""
        from .models import load_model

        model, tokenizer = load_model(name_or_path, dtype=dtype)
        return cls(model, tokenizer, sources=sources, max_tree_nodes=max_tree_nodes,
                   adaptive_budget=adaptive_budget, attention=attention, cpu_kernels=cpu_kernels)

    # -- what the engine holds, for inspection and for tools that swap parts ------------------

    @property
    def budget(self) -> Budget:
        """The budget with everything it has learned (costs, acceptance); assign one to restore it."""
        return self.engine.budget

    @budget.setter
    def budget(self, budget: Budget) -> None:
        self.engine.budget = budget
        budget.costs.padding = self.engine.padding

    @property
    def runner(self) -> ModelRunner:
        return self.engine.runner

    @runner.setter
    def runner(self, runner: ModelRunner) -> None:
        self.engine.runner = runner

    @property
    def clock(self) -> Callable[[], float]:
        """The timer behind the statistics and the budget's step costs."""
        return self.engine.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.engine.clock = clock

    @property
    def row_choices(self) -> str:
        """How each step chooses every tree row's token: "auto", "batched" or "walk" (see
        :attr:`specdraft.engine.Engine.batched_rows`)."""
        return self.engine.row_choices

    @row_choices.setter
    def row_choices(self, value: str) -> None:
        if value not in ("auto", "batched", "walk"):
            raise ValueError(f"row_choices must be 'auto', 'batched' or 'walk', got {value!r}")
        self.engine.row_choices = value

    @property
    def hide_host_work(self) -> bool | None:
        """Whether the host work a step's read does not need runs behind the forward: ``None``
        (the default) on an accelerator, ``True`` or ``False`` to force it (see
        :meth:`specdraft.engine.step.Step.behind_forward`). Outputs are the same either way."""
        return self.engine.hide_host_work

    @hide_host_work.setter
    def hide_host_work(self, value: bool | None) -> None:
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"hide_host_work must be True, False or None, got {value!r}")
        self.engine.hide_host_work = value

    def close(self) -> None:
        """Free what the decoder holds beyond the model: the packed weights of
        ``cpu_kernels="packed"`` or ``"fbgemm"`` (once no other decoder over the model holds them). The decoder
        then runs on stock kernels."""
        self.packed_weights = None
        self.cpu_kernels = "stock"
        self.budget.set_cost_curve(None)  # the packed curve no longer describes what runs
        self._widths()  # the stock layers may agree at other widths

    @staticmethod
    def _choose_exact(model: Any, cpu_kernels: str, attention: str, exact: bool | None,
                      compile: bool) -> tuple[bool, ExactKernels | None, str]:
        """Whether exact mode runs, the kernels it runs on a CPU (``None`` where it does not run
        or runs elsewhere), and a line saying why.

        Asked for, it runs (on a CPU on the kernel path whose padded forwards cost least,
        :func:`~specdraft.kernels.exact_kernels.choose_exact_kernels`). By default it runs where
        :func:`~specdraft.engine.widths.exact_default` allows it and, on a CPU, where its price
        measured on this machine and model is at most
        :data:`~specdraft.kernels.exact_kernels.PRICE_LIMIT`."""
        on_cpu = torch.device(getattr(model, "device", "cpu")).type == "cpu"
        if exact is not None:
            kernels = choose_exact_kernels(model, cpu_kernels, priced=False) if exact and on_cpu else None
            return exact, kernels, f"exact mode {'on' if exact else 'off'}, as asked" + (
                f": {kernels.describe()}" if kernels is not None else "")
        if compile or not exact_default(model, attention):
            return False, None, "exact mode off: not the default for this device, dtype and attention"
        if not on_cpu:
            return True, None, "exact mode on: the default for this device and dtype"
        try:
            kernels = choose_exact_kernels(model, cpu_kernels, priced=True)
        except ExactRowsError as exc:
            return False, None, f"exact mode off: {exc}"
        verdict = "on" if kernels.cheap else "off (exact=True turns it on)"
        note = (f"exact mode {verdict}: the default where it costs at most {PRICE_LIMIT:.0%}; "
                f"its cheapest kernels here: {kernels.describe()}")
        if not kernels.cheap:
            kernels.kernels.release_packed()  # (the kernels without exact mode are packed next)
            return False, None, note
        return True, kernels, note

    def _widths(self, rule: RowRule | None = None) -> None:
        """The widths forwards run at: in exact mode, those the layers that run now compute every
        row alike at (``rule`` where the caller has it); on a GPU, a few buckets whose forwards are
        captured as CUDA graphs (:mod:`specdraft.model.static`); elsewhere, as they come."""
        if self.exact and rule is None:
            rule = load_or_probe(self.model, self.packed_weights)
        # exact attention at fixed shapes reads committed tokens in place from chunk boundaries
        self.runner.store.align = CHUNK if self.exact else 1
        if self.runner.device.type != "cuda":
            self.engine.padding = RowWidths(rule) if rule is not None else None
            return
        # on a GPU: the buckets, in exact mode those at which the rule holds (fixed widths serve both)
        buckets = Buckets(exact_buckets(rule), mixes_prompts=rule.wider) if rule is not None else Buckets()
        if self.runner.static is None or self.runner.static.widths != buckets.widths:
            self.runner.use_static(buckets.widths, compile_backend=COMPILE_BACKEND if self.compile else None)
        # captured together: the widths one request's trees fill (wider ones, for batches and
        # side blocks, at their first use)
        self.runner.static.together = buckets.up_to(self.max_tree_nodes + 1)
        self.engine.padding = buckets

    def _kernels_context(self):
        """Around each forward: the packed layers in the model (and back out after), or nothing."""
        return self.packed_weights.swapped() if self.packed_weights is not None else nullcontext()

    def _text(self, ids: Sequence[int]) -> str | None:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True) if self.tokenizer is not None else None

    # -- one request ------------------------------------------------------------------------

    def warm_up(self, context_tokens: int = 2048) -> None:
        """Pay the decoder's one-time costs now, before real requests: one plain request of about
        ``context_tokens`` positions (at most the model's context), its output discarded.

        On a GPU that captures the CUDA graphs of the widths the decoder's trees fill and sizes the
        KV store, so a later request up to that length neither waits for a capture in the middle
        of its answer nor makes the store grow (which means capturing again); elsewhere it makes
        the first request's kernel choices. The draft sources are set aside for the call, so they
        learn nothing from it. Call it before serving, not while another call runs."""
        check_int("context_tokens", context_tokens, 2)
        limit = self.runner.max_positions
        total = min(context_tokens, limit) if limit is not None else context_tokens
        new = min(4, total - 1)
        vocab = self.runner.vocab_size
        filler = [1 + i % max(1, min(vocab - 1, 1000)) for i in range(total - new)]
        kept = list(self.sources)
        self.sources.clear()
        try:
            self.generate(filler, max_new_tokens=new, do_sample=False)
        finally:
            self.sources[:] = kept

    def generate(self, prompt: str | Sequence[int] | torch.Tensor, max_new_tokens: int = 128,
                 do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
                 top_p: float | None = None, repetition_penalty: float | None = None, seed: int | None = None,
                 stop: Sequence[str] | str | None = None, **options: Any) -> GenerationOutput:
        """Generate up to ``max_new_tokens`` tokens after ``prompt``.

        Options left as ``None`` take the model's ``generation_config`` value, then transformers'
        default (so ``do_sample=True`` alone means top-k 50, as in ``model.generate``). ``seed``
        fixes the sampling stream; without it the global torch RNG is used, as in transformers.
        Any other keyword raises, naming what is supported.
        """
        spec = self._spec(prompt, max_new_tokens, stop, seed, do_sample=do_sample, temperature=temperature,
                          top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty, **options)
        batch = self.engine.run([spec], 1)
        for _ in batch:
            pass
        output = batch.outputs[0]
        if output.error is not None:
            raise output.error
        return GenerationOutput(token_ids=output.token_ids, text=output.text, stats=output.stats)

    def stream(self, prompt: str | Sequence[int] | torch.Tensor, max_new_tokens: int = 128,
               do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
               top_p: float | None = None, repetition_penalty: float | None = None, seed: int | None = None,
               stop: Sequence[str] | str | None = None, stats: GenerationStats | None = None,
               **options: Any) -> Iterator[str | list[int]]:
        """Like :meth:`generate`, but yield output as it is committed: text pieces when the decoder
        has a tokenizer (held back while a character is incomplete), else lists of token ids.
        Pass a :class:`GenerationStats` as ``stats`` to read the statistics afterwards."""
        spec = self._spec(prompt, max_new_tokens, stop, seed, do_sample=do_sample, temperature=temperature,
                          top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty, **options)
        return self._stream(self.engine.run([spec], 1, [stats]))

    def _stream(self, batch) -> Iterator[str | list[int]]:
        for _, piece in stream_pieces(batch, self.tokenizer):
            yield piece
        output = batch.outputs[0]
        if output is not None and output.error is not None:
            raise output.error

    # -- many requests at once ------------------------------------------------------------

    def generate_batch(self, prompts: Sequence[Any], max_new_tokens: int = 128, concurrency: int = 8,
                       do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
                       top_p: float | None = None, repetition_penalty: float | None = None,
                       seed: int | None = None, stop: Sequence[str] | str | None = None,
                       **options: Any) -> BatchResult:
        """Generate for every prompt, up to ``concurrency`` requests per forward (see
        :mod:`specdraft.engine`). A prompt is a string, token ids, or a :class:`BatchRequest` with
        its own ``max_new_tokens``, stop strings and sampling settings (its ``None`` fields take
        the values given here). Each request's output is what :meth:`generate` gives it alone:
        greedy token for token, sampled with the same law (and, with a seed, the same draws).

        Returns a :class:`~specdraft.engine.BatchResult`: one :class:`~specdraft.engine.BatchOutput`
        per prompt, in order, and the batch's totals in ``.stats``. A request whose draft source
        raises ends alone, with the error in its output's ``error``; the others go on."""
        return self.stream_batch(prompts, max_new_tokens, concurrency, do_sample, temperature, top_k, top_p,
                                 repetition_penalty, seed, stop, **options).result()

    def stream_batch(self, prompts: Sequence[Any], max_new_tokens: int = 128, concurrency: int = 8,
                     do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
                     top_p: float | None = None, repetition_penalty: float | None = None,
                     seed: int | None = None, stop: Sequence[str] | str | None = None,
                     **options: Any) -> BatchStream:
        """Like :meth:`generate_batch`, but iterate the result for ``(request index, new text)`` as
        tokens commit; ``.cancel(index)`` ends one request and the others go on. Every request's
        arguments are checked before anything runs."""
        check_int("concurrency", concurrency, 1)
        if isinstance(prompts, (str, torch.Tensor)) or not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a list of prompts (str, token ids or BatchRequest), got "
                            f"{type(prompts).__name__}; for one prompt use generate()")
        defaults = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k,
                        top_p=top_p, repetition_penalty=repetition_penalty, seed=seed, stop=stop, **options)
        specs = []
        for index, prompt in enumerate(prompts):
            mine = dict(defaults)
            if isinstance(prompt, BatchRequest):
                mine.update({k: v for k, v in vars(prompt).items() if k != "prompt" and v is not None})
                prompt = prompt.prompt
            try:
                specs.append(self._spec(prompt, **mine))
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"request {index}: {exc}") from exc
        return BatchStream(self.engine.run(specs, concurrency), self.tokenizer)

    # -- checking a request -----------------------------------------------------------------

    def _spec(self, prompt: Any, /, max_new_tokens: int, stop: Any, seed: int | None,
              **options: Any) -> RequestSpec:
        """Check one request's arguments (each bad one raises, naming it) and resolve them: the
        prompt's ids, the sampling settings over the model's generation config, the stop rule."""
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
                                 or not -2**63 <= int(seed) < 2**64):
            raise ValueError(f"seed must be an int in [-2**63, 2**64) or None, got {seed!r}")
        prompt_ids = self._encode(prompt)
        check_int("max_new_tokens", max_new_tokens, 0)
        limit = self.runner.max_positions
        if limit is not None and len(prompt_ids) + max_new_tokens > limit:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens + max_new_tokens={max_new_tokens} exceeds the model's context "
                f"of {limit} tokens; shorten the prompt or lower max_new_tokens")
        settings = resolve_settings(getattr(self.model, "generation_config", None), **options)
        if stop is not None and not isinstance(stop, (str, list, tuple)):
            raise TypeError(f"stop must be a string, a list of strings or None, got {stop!r}")
        stop_strings = [stop] if isinstance(stop, str) else list(stop or [])
        rule = StopRule(eos_ids(self.model), max_new_tokens, stop_strings, self.tokenizer)
        return RequestSpec(prompt_ids, settings, rule, None if seed is None else int(seed))

    def _encode(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a string prompt needs a tokenizer: pass tokenizer= to Decoder, or pass token ids")
            ids = self.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, torch.Tensor):
            if prompt.dim() == 2 and prompt.shape[0] == 1:
                prompt = prompt[0]
            if prompt.dim() != 1:
                raise ValueError(f"a tensor prompt must be 1-D token ids (or [1, n]), got shape {tuple(prompt.shape)}; "
                                 "for many prompts use generate_batch()")
            ids = prompt.tolist()
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            array = np.asarray(prompt, dtype=object) if len(prompt) else np.zeros(0)
            if array.ndim != 1:
                raise ValueError(f"a prompt must be one sequence of token ids, got a nested sequence of shape "
                                 f"{array.shape}; for many prompts use generate_batch()")
            ids = list(array.tolist())
        else:
            raise TypeError(f"prompt must be a str, a list of token ids or a 1-D tensor, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty: give at least one token (e.g. the BOS token)")
        vocab = self.runner.vocab_size
        bad = [t for t in ids if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer))
               or not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be ints in [0, {vocab}), got {bad[:5]}")
        return [int(t) for t in ids]

