"""The decoding loop: draft, merge into a tree, check it in one forward pass, verify, compact.

One step, in order:

1. every source proposes branches (and optionally a side block) for the current context;
2. the branches merge into one :class:`~specdraft.tree.TokenTree` of at most ``max_tree_nodes``
   draft nodes below the root (the last committed token, not yet in the cache), best first by
   each source's acceptance learned so far (:mod:`specdraft.calibration`);
3. one forward of ``[root, tree nodes, side tokens]`` over the KV cache, with an ancestor mask
   and depth-based positions (the first new token comes from the prompt's prefill instead, as in
   ``model.generate``);
4. the verifier walks the tree and commits the accepted path plus one token of the model's own,
   so even a step whose drafts all fail commits one token, like plain decoding;
5. stop rules cut the step's tokens; the cache keeps only the root and the accepted path;
   sources learn from what was committed (and, if they asked, the model's top-k at every row);
   the budget learns the step's cost and, through the full tree, which ranks would have paid;
   the calibration learns, through the same full tree, which sources' nodes would have.

The loop runs 4-5 first, on the prefill: its last row is verified on a root-only tree, so the
first new token takes the same commit path as every later one.

The decoder knows the sources, the verifier and the runner; none of them knows the decoder.
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from .attention import ATTENTION_CHOICES, select_attention
from .attention_cost import attention_seconds
from .batch import BatchLoop, BatchRequest, BatchResult, BatchStream
from .batch_budget import BatchBudget
from .batch_runner import BatchRunner
from .budget import AdaptiveBudget, Budget, BudgetDecision, FixedBudget, StepOutcome
from .calibration import AcceptanceCalibration
from .kernel_costs import choose_kernels
from .row_draws import RowDraws, request_draws
from .runner import ModelRunner
from .sampling import NodeScorer, PenaltyPrefix, SamplingSettings, resolve_settings
from .sources.base import Context, Draft, DraftSource, Feedback, SideBlock, source_option
from .sources.registry import default_sources
from .stats import GenerationStats, SourceStats
from .step import Request as _Request
from .step import Step as _Step
from .step import eos_ids as _eos_ids
from .step import request_ids
from .step import finish_sources as _finish_sources
from .step import path_tokens as _path_tokens
from .step import step_input as _step_input
from .stopping import StopRule
from .topk import top_k_ids
from .tree import TokenTree
from .verify import Verdict, verify_greedy, verify_sampling, walk_choices

#: Cache slots reserved per request beyond prompt + new tokens + tree: room for side blocks (a
#: request that needs more grows its cache once, by doubling).
_CACHE_SLACK = 64

#: The largest tree a decoder accepts: far past what pays on any hardware (trees of 16-80 nodes
#: are the useful range), and small enough that a typo cannot make every step a huge forward.
MAX_TREE_NODES = 1024


@dataclass
class GenerationOutput:
    """The result of :meth:`Decoder.generate`: new tokens only (the prompt is not repeated)."""

    token_ids: list[int]
    text: str | None
    stats: GenerationStats


class Decoder:
    """Lossless speculative decoding of a Hugging Face causal LM with draft-model-free sources.

    >>> dec = Decoder(model, tokenizer, sources=[PromptLookup()], max_tree_nodes=32)
    >>> out = dec.generate("def add(a, b):", max_new_tokens=64)
    >>> out.text, out.stats.mean_accepted

    Greedy output equals ``model.generate(do_sample=False)`` token for token; sampled output has
    the distribution of ``model.generate(do_sample=True)`` with the same settings. One decoder
    runs one call at a time (it owns its KV caches); make one per thread, or give many requests to
    one :meth:`generate_batch` call, which decodes them together in one forward per step. Sources
    may be shared.

    ``max_tree_nodes`` caps the draft nodes checked per forward. With ``adaptive_budget`` (the
    default) each step's tree is sized below that cap from measured acceptance and step cost, down
    to plain one-token decoding when drafts do not pay (see :mod:`specdraft.budget`); pass
    ``adaptive_budget=False`` to always use the cap, e.g. to benchmark fixed budgets.
    ``attention`` picks the backend (see :func:`specdraft.attention.select_attention`): ``"auto"``,
    ``"sdpa"``, ``"eager"`` or ``"flash"``; choosing one switches the model's attention
    implementation through transformers' public ``set_attn_implementation``.
    ``cpu_kernels="packed"`` runs the model's linear layers on weights packed once for oneDNN
    (float32 or bfloat16 on a CPU), which makes a forward of many tree tokens nearly as cheap as
    a one-token one; ``"fbgemm"`` runs them on FBGEMM's float16-weight kernel where float16 holds
    the weights exactly (bfloat16 and float16 checkpoints: the fast bfloat16 path on CPUs without
    AVX512-BF16). Both hold a second copy of the linear weights until :meth:`close` and may round
    differently from stock kernels in the order of their additions (see
    :mod:`specdraft.cpu_kernels`). The default ``"auto"`` measures these paths on first use on a
    machine (cached) and runs each forward width on the cheapest (:mod:`specdraft.kernel_costs`,
    :attr:`kernels` says what it picked); ``"stock"`` uses the model's own modules.
    """

    def __init__(self, model: Any, tokenizer: Any = None, sources: Sequence[DraftSource] | None = None,
                 max_tree_nodes: int = 32, adaptive_budget: bool = True, attention: str = "auto",
                 cpu_kernels: str = "auto") -> None:
        if isinstance(max_tree_nodes, bool) or not isinstance(max_tree_nodes, int) \
                or not 0 <= max_tree_nodes <= MAX_TREE_NODES:
            raise ValueError(f"max_tree_nodes must be an int in [0, {MAX_TREE_NODES}] (0 = plain decoding), "
                             f"got {max_tree_nodes!r}")
        if attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention must be one of {list(ATTENTION_CHOICES)}, got {attention!r}")
        self.sources: list[DraftSource] = list(sources) if sources is not None else default_sources()
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
        self.attention = select_attention(model, attention)
        self.runner = ModelRunner(model)
        #: the CPU kernels per forward width and their measured costs (see :mod:`specdraft.kernel_costs`)
        self.kernels = choose_kernels(model, cpu_kernels)
        self.cpu_kernels = cpu_kernels
        #: packed linear weights swapped in around each forward (``cpu_kernels="auto"``, ``"packed"`` or ``"fbgemm"``)
        self._packed = self.kernels.release_packed()
        # a source may say how many steps it needs before its drafts mean anything (Jacobi fills its
        # window first): the controller keeps the full budget that long before judging
        warmup = max([3] + [source_option(s, "warmup_steps") for s in self.sources])
        self.budget: Budget = (AdaptiveBudget(max_tree_nodes, warmup=warmup, cost_curve=self.kernels.curve)
                               if adaptive_budget else FixedBudget(max_tree_nodes))
        #: each source's learned acceptance by depth, which orders the merged tree (:mod:`specdraft.calibration`)
        self.calibration = AcceptanceCalibration(len(self.sources))
        # sources that read the model's top-k (Token Recycling): one topk per step for the largest k
        self._wants_top = [source_option(s, "top_k") > 0 for s in self.sources]
        self._top_k = max([source_option(s, "top_k") for s in self.sources], default=0)
        self._source_names = _unique_names([s.name for s in self.sources])
        self._busy = threading.Lock()  # one call (request or batch) at a time; a second caller fails fast
        #: what step 0 (the prefill's token, verified on a root-only tree) counts as
        self._decision0 = BudgetDecision(0, 1.0, 0.0, side_blocks=False)
        #: The timer behind the statistics and the adaptive budget's step costs. A replay of recorded
        #: outputs on a simulated clock (``benchmarks/budget_replay.py``) swaps it, with the runner.
        self.clock: Callable[[], float] = time.perf_counter
        #: how each step chooses every tree row's token: "auto" (all rows at once on an
        #: accelerator, node by node on a CPU), "batched" or "walk"; see :meth:`_batched_rows`
        self.row_choices: str = "auto"
        #: the packed cache and the shared budget of :meth:`generate_batch`, made at its first use
        self._batch_runner: BatchRunner | None = None
        self._batch_budget: BatchBudget | None = None

    @classmethod
    def from_pretrained(cls, name_or_path: str, sources: Sequence[DraftSource] | None = None,
                        dtype: str | torch.dtype = "float32", max_tree_nodes: int = 32,
                        adaptive_budget: bool = True, attention: str = "auto",
                        cpu_kernels: str = "auto") -> "Decoder":
        """Load model and tokenizer (a checkpoint dir, a ``.gguf`` file or a hub id, see
        :func:`specdraft.models.load_model`) and wrap them in a decoder."""
        from .models import load_model

        model, tokenizer = load_model(name_or_path, dtype=dtype)
        return cls(model, tokenizer, sources=sources, max_tree_nodes=max_tree_nodes,
                   adaptive_budget=adaptive_budget, attention=attention, cpu_kernels=cpu_kernels)

    # -- public API -----------------------------------------------------------------------

    def close(self) -> None:
        """Free what the decoder holds beyond the model: the packed weights of
        ``cpu_kernels="packed"`` or ``"fbgemm"`` (once no other decoder over the model holds them). The decoder
        then runs on stock kernels."""
        self._packed = None
        self.cpu_kernels = "stock"
        if hasattr(self.budget, "set_cost_curve"):  # the packed curve no longer describes what runs
            self.budget.set_cost_curve(None)
        if self._batch_budget is not None:
            self._batch_budget.set_cost_curve(None)

    def _kernels(self):
        """Around each forward: the packed layers in the model (and back out after), or nothing."""
        return self._packed.swapped() if self._packed is not None else nullcontext()

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
        tokens: list[int] = []
        stats = GenerationStats()
        for chunk in self._steps(prompt, max_new_tokens, stats, stop, seed, dict(
                do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                repetition_penalty=repetition_penalty, **options)):
            tokens.extend(chunk)
        text = self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else None
        return GenerationOutput(token_ids=tokens, text=text, stats=stats)

    def stream(self, prompt: str | Sequence[int] | torch.Tensor, max_new_tokens: int = 128,
               do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
               top_p: float | None = None, repetition_penalty: float | None = None, seed: int | None = None,
               stop: Sequence[str] | str | None = None, stats: GenerationStats | None = None,
               **options: Any) -> Iterator[str | list[int]]:
        """Like :meth:`generate`, but yield output as it is committed: text pieces when the decoder
        has a tokenizer (held back while a character is incomplete), else lists of token ids.
        Pass a :class:`GenerationStats` as ``stats`` to read the statistics afterwards."""
        stats = stats if stats is not None else GenerationStats()
        steps = self._steps(prompt, max_new_tokens, stats, stop, seed, dict(
            do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
            repetition_penalty=repetition_penalty, **options))
        if self.tokenizer is None:
            yield from steps
            return
        tokens: list[int] = []
        shown = 0
        for chunk in steps:
            tokens.extend(chunk)
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            if text.endswith("\ufffd"):
                continue  # a multi-byte character is split across tokens: wait for the rest
            if len(text) > shown:
                yield text[shown:]
                shown = len(text)
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if len(text) > shown:
            yield text[shown:]

    # -- many requests at once ------------------------------------------------------------

    def generate_batch(self, prompts: Sequence[Any], max_new_tokens: int = 128, concurrency: int = 8,
                       do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
                       top_p: float | None = None, repetition_penalty: float | None = None,
                       seed: int | None = None, stop: Sequence[str] | str | None = None,
                       **options: Any) -> BatchResult:
        """Generate for every prompt, up to ``concurrency`` requests per forward (see
        :mod:`specdraft.batch`). A prompt is a string, token ids, or a :class:`BatchRequest` with
        its own ``max_new_tokens``, stop strings and sampling settings (its ``None`` fields take
        the values given here). Each request's output is what :meth:`generate` gives it alone:
        greedy token for token, sampled with the same law (and, with a seed, the same draws).

        Returns a :class:`~specdraft.batch.BatchResult`: one :class:`~specdraft.batch.BatchOutput`
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
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be an int >= 1, got {concurrency!r}")
        if isinstance(prompts, (str, torch.Tensor)) or not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a list of prompts (str, token ids or BatchRequest), got "
                            f"{type(prompts).__name__}; for one prompt use generate()")
        defaults = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k,
                        top_p=top_p, repetition_penalty=repetition_penalty, seed=seed, stop=stop, **options)
        requests = []
        for index, prompt in enumerate(prompts):
            mine = dict(defaults)
            if isinstance(prompt, BatchRequest):
                mine.update({k: v for k, v in vars(prompt).items() if k != "prompt" and v is not None})
                prompt = prompt.prompt
            new_tokens, stop_here, seed_here = mine.pop("max_new_tokens"), mine.pop("stop"), mine.pop("seed")
            try:
                prompt_ids, settings, rule = self._prepare(prompt, new_tokens, stop_here, seed_here, mine)
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"request {index}: {exc}") from exc
            requests.append((prompt_ids, settings, rule, seed_here))
        if self._batch_runner is None:
            self._batch_runner = BatchRunner(self.model)
            adaptive = isinstance(self.budget, AdaptiveBudget)
            # the measured kernel curve (seconds of the linear layers by width) and what attention
            # adds per row and cached position: together, what a batched forward costs
            curve = self.kernels.curve if adaptive and self.budget.costs.curve is not None else None
            self._batch_budget = BatchBudget(self.max_tree_nodes, curve, adaptive=adaptive,
                                             attention_seconds=attention_seconds(self.model) if adaptive else 0.0)
        loop = BatchLoop(self, self._batch_runner, self._batch_budget, requests, concurrency)
        return BatchStream(loop, self.tokenizer)

    # -- the loop -------------------------------------------------------------------------

    def _steps(self, prompt: Any, max_new_tokens: int, stats: GenerationStats, stop: Any, seed: int | None,
               options: dict[str, Any]) -> Iterator[list[int]]:
        """Run one request, yielding the tokens committed by each step."""
        prompt_ids, settings, rule = self._prepare(prompt, max_new_tokens, stop, seed, options)
        stats.per_source = {name: SourceStats() for name in self._source_names}
        if max_new_tokens == 0:
            return
        yield from self._decode(prompt_ids, settings, rule, stats, seed)

    def _prepare(self, prompt: Any, max_new_tokens: int, stop: Any, seed: int | None, options: dict[str, Any]
                 ) -> tuple[list[int], SamplingSettings, StopRule]:
        """Check one request's arguments (each bad one raises, naming it) and resolve them: the
        prompt's ids, the sampling settings over the model's generation config, the stop rule."""
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
                                 or not -2**63 <= int(seed) < 2**64):
            raise ValueError(f"seed must be an int in [-2**63, 2**64) or None, got {seed!r}")
        prompt_ids = self._encode(prompt)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        limit = self.runner.max_positions
        if limit is not None and len(prompt_ids) + max_new_tokens > limit:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens + max_new_tokens={max_new_tokens} exceeds the model's context "
                f"of {limit} tokens; shorten the prompt or lower max_new_tokens")
        settings = resolve_settings(getattr(self.model, "generation_config", None), **options)
        if stop is not None and not isinstance(stop, (str, list, tuple)):
            raise TypeError(f"stop must be a string, a list of strings or None, got {stop!r}")
        stop_strings = [stop] if isinstance(stop, str) else list(stop or [])
        rule = StopRule(_eos_ids(self.model), max_new_tokens, stop_strings, self.tokenizer)
        return prompt_ids, settings, rule

    def _decode(self, prompt_ids: list[int], settings: SamplingSettings, rule: StopRule, stats: GenerationStats,
                seed: int | None) -> Iterator[list[int]]:
        """The loop of the module docstring. The prefill is step 0: its last row is verified on a
        root-only tree, so the first token takes the same commit path as every later one.

        The sources index the prompt (``begin``) after the first token is out, just before the
        first draft: a request's first token never waits for them. (Indexing on a worker thread
        during the prefill was measured and rejected: on a CPU the thread holds the interpreter lock
        between the forward's ops, which stretched a 42 ms prefill of 4k tokens to 350 ms.)
        Each step reads the device once (:meth:`_verdict`) and uploads once (``runner.forward``)."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("this Decoder is busy with another request (a stream() not yet exhausted or closed, "
                               "or another thread); finish or close() it first, or use one Decoder per thread")
        started = self.clock()
        scorer = NodeScorer(settings)
        request = _Request(list(prompt_ids), len(prompt_ids), next(request_ids))
        begun: list[DraftSource] = []
        failed = False
        try:
            capacity = len(prompt_ids) + rule.max_new_tokens + self.max_tree_nodes + _CACHE_SLACK
            with self._kernels():
                logits = self.runner.prefill(request.committed, capacity)[None]
            stats.prefill_time = self.clock() - started
            device = logits.device
            batched = self._batched_rows(device)
            draw, row_draws = request_draws(device, seed, batched, settings.do_sample)
            penalty = PenaltyPrefix(logits.shape[-1], device, request.committed) if settings.needs_prefix else None
            if penalty is not None:
                penalty.add(self.runner.prefill_ids)
            step = _Step(TokenTree(request.root), [], [None] * len(self.sources), None, self._decision0, started)
            pending_top: tuple[np.ndarray, np.ndarray] | None = None
            unmarked: list[int] = []  # committed tokens the device's penalty mask does not hold yet
            while True:
                # 4. verify; 5. stop rules, compaction, commit, feedback
                verdict, side_argmax, top = self._verdict(step, logits, settings, scorer, penalty, draw, row_draws,
                                                          len(request.committed), batched)
                tokens, done = rule.cut(request.output, verdict.tokens)
                self._record(stats, step.tree, verdict, len(tokens))
                if not done:
                    self.runner.compact([0] + verdict.path)
                start = request.commit(tokens)
                if penalty is not None:
                    if batched:
                        unmarked = list(tokens)  # they ride the next step's upload
                    else:
                        penalty.add(tokens)
                if top is not None and pending_top is not None:
                    top = (np.concatenate([pending_top[0], top[0]]), np.concatenate([pending_top[1], top[1]]))
                if step.forward_input is not None:  # the prefill's token answers no proposal: nobody observes it
                    self._feed_back(step, tokens, request.context(), logits, side_argmax, top)
                    pending_top = None
                    self.budget.observe(StepOutcome(step.decision, step.tree, [d.branches for d in step.drafts],
                                                    request.committed, start, step.width, self.clock() - step.started))
                    self.calibration.observe(request.request_id, step.tree, tokens)
                else:
                    pending_top = top
                stats.new_tokens += len(tokens)
                stats.wall_time = self.clock() - started
                if tokens:
                    yield tokens
                if done:
                    return
                if step.forward_input is None:  # the first draft: the sources read the prompt now
                    prompt = request.prompt_context()
                    for source in self.sources:
                        source.begin(prompt)
                        begun.append(source)
                    self.budget.start_request()
                    self.calibration.start_request(request.request_id)
                # 1. draft; 2. merge under the budget; 3. one forward
                step = self._draft(request, rule)
                riders = []
                if penalty is not None and batched:
                    riders = [np.asarray(unmarked, dtype=np.int64), _path_tokens(step.tree)]
                with self._kernels():
                    logits = self.runner.forward(*step.forward_input, riders=riders)
                if riders:
                    penalty.add(self.runner.rider_tensors[0])
                    step.path_tokens = self.runner.rider_tensors[1]
        except GeneratorExit:  # the caller closed the stream: a normal early stop, not a failure
            raise
        except BaseException:
            failed = True
            raise
        finally:
            try:
                _finish_sources(begun, request.context(), failed)
            finally:
                stats.wall_time = self.clock() - started
                self._busy.release()

    def _batched_rows(self, device: torch.device) -> bool:
        """Whether each step scores every tree row on the device at once (one read per step) rather
        than walking node by node (a read per node visited). On a CPU a read costs nothing and the
        walk touches only the rows it visits, so it stays the cheaper; elsewhere one read per step
        is what keeps the device busy. ``row_choices`` ("auto", "batched", "walk") overrides it."""
        if self.row_choices == "auto":
            return device.type != "cpu"
        return self.row_choices == "batched"

    def _verdict(self, step: "_Step", logits: torch.Tensor, settings: SamplingSettings, scorer: NodeScorer,
                 penalty: PenaltyPrefix | None, draw, row_draws: RowDraws | None, position0: int, batched: bool
                 ) -> tuple[Verdict, list[list[int] | None], tuple[np.ndarray, np.ndarray] | None]:
        """Verify the step's tree and read what the sources asked for, with one read of the device:
        each row's choice (greedy argmax or one draw, on the device), each side block's argmax and
        the top-k of every tree row, concatenated and fetched together. Returns the verdict, each
        source's side-block argmax (``None`` where it had no block) and the (top-k ids, row tokens)."""
        parts = self._verdict_parts(step, logits, settings, scorer, penalty, row_draws, position0, batched)
        fetched = parts.tolist() if parts is not None else []  # the step's one read
        return self._verdict_from(step, fetched, logits, settings, scorer, penalty, draw, batched)

    def _verdict_parts(self, step: "_Step", logits: torch.Tensor, settings: SamplingSettings, scorer: NodeScorer,
                       penalty: PenaltyPrefix | None, row_draws: RowDraws | None, position0: int, batched: bool
                       ) -> torch.Tensor | None:
        """What :meth:`_verdict` reads from the device, as one int64 tensor on it (``None``: nothing):
        the batched rows' choices, the side blocks' argmax, the tree rows' top-k. A batch of
        requests concatenates every request's parts and reads them all at once."""
        n = len(step.tree)
        rows = logits[:n]
        parts: list[torch.Tensor] = []
        if batched:
            scores = rows if scorer.is_identity else scorer.process_rows(rows.to(torch.float32),
                                                                         self._node_masks(step, penalty, n))
            if settings.do_sample:  # row_draws: the root row samples ``position0``, a row at depth d ``position0 + d``
                assert row_draws is not None, "sampling on batched rows needs the request's RowDraws"
                probs = torch.softmax(scores.to(torch.float32), dim=-1)
                parts.append(row_draws.choose(probs, step.tree.depth[:n], position0))
            else:
                parts.append(scores.argmax(dim=-1))
        parts.extend(logits[side].argmax(dim=-1) for side in step.side_slices if side is not None)
        k = min(self._top_k, logits.shape[-1]) if self._top_k else 0
        if k:
            parts.append(top_k_ids(rows, k).reshape(-1))
        return torch.cat([p.to(torch.int64) for p in parts]) if parts else None

    def _verdict_from(self, step: "_Step", fetched: list[int], logits: torch.Tensor, settings: SamplingSettings,
                      scorer: NodeScorer, penalty: PenaltyPrefix | None, draw, batched: bool
                      ) -> tuple[Verdict, list[list[int] | None], tuple[np.ndarray, np.ndarray] | None]:
        """:meth:`_verdict` from what was read: walk the tree (on the batched choices, or node by
        node on the logits), and split out the side blocks' argmax and the top-k."""
        tree = step.tree
        n = len(tree)
        at = 0
        if batched:
            verdict, at = walk_choices(tree, fetched[:n]), n
        else:
            verdict = self._verify(tree, logits[:n], settings, scorer, penalty if penalty is not None else [], draw)
        side_argmax: list[list[int] | None] = []
        for side in step.side_slices:
            if side is None:
                side_argmax.append(None)
            else:
                width = side.stop - side.start
                side_argmax.append(fetched[at : at + width])
                at += width
        top = None
        k = min(self._top_k, logits.shape[-1]) if self._top_k else 0
        if k:
            top = (np.asarray(fetched[at : at + n * k], dtype=np.int64).reshape(n, k),
                   np.asarray(tree.tokens, dtype=np.int64))
        return verdict, side_argmax, top

    @staticmethod
    def _node_masks(step: "_Step", penalty: PenaltyPrefix | None, n: int) -> torch.Tensor | None:
        """Each tree row's seen-token mask for a repetition penalty: the committed tokens plus the
        tokens on the node's own path (uploaded with the step's input)."""
        if penalty is None:
            return None
        masks = penalty.seen.expand(n, -1)
        if step.path_tokens is None:
            return masks
        return masks.clone().scatter_(1, step.path_tokens, True)

    def _draft(self, request: "_Request", rule: StopRule) -> "_Step":
        """Steps 1-2: every source drafts (branches cut so a step never commits past the token
        limit), the budget picks the tree size, the branches merge into the tree."""
        started = self.clock()
        drafts, sides = self._drafts(request, rule, self.runner.cache_len)
        decision = self.budget.choose(sum(len(side.tokens) for side in sides if side is not None))
        return self._step(request.root, drafts, sides, decision, started, request.request_id)

    def _drafts(self, request: "_Request", rule: StopRule, cache_len: int
                ) -> tuple[list[Draft], list[SideBlock | None]]:
        """Step 1: every source's draft for the request (branches cut so a step never commits past
        the token limit) and the side blocks that fit after ``cache_len`` cached positions."""
        context = request.context()
        depth_limit = rule.max_new_tokens - len(request.output) - 1  # the bonus token takes the last slot
        drafts = [self._propose(source, context, depth_limit) for source in self.sources]
        return drafts, self._fit_side_blocks(drafts, cache_len)

    def _step(self, root: int, drafts: list[Draft], sides: list[SideBlock | None], decision: BudgetDecision,
              started: float, request_id: int | None = None) -> "_Step":
        """Step 2: the branches merged best first by the request's calibrated acceptance (the
        full tree, which the budget learns from) and cut to the budget, laid out for the forward."""
        return self._lay_out(self._full_tree(root, drafts, request_id), drafts, sides, decision, started)

    def _full_tree(self, root: int, drafts: list[Draft], request_id: int | None = None) -> TokenTree:
        """Every source's branches merged best first by the request's calibrated acceptance, up to
        ``max_tree_nodes`` (the tree the budget learns from; a step checks a prefix of it)."""
        return TokenTree.from_drafts(root, [d.branches for d in drafts], self.max_tree_nodes,
                                     self.calibration.rates(request_id))

    @staticmethod
    def _lay_out(full: TokenTree, drafts: list[Draft], sides: list[SideBlock | None], decision: BudgetDecision,
                 started: float) -> "_Step":
        """The step of ``decision.nodes`` nodes of ``full`` (and the side blocks, if the decision
        keeps them), laid out for the forward."""
        if not decision.keeps_side_blocks:
            sides = [None] * len(sides)
        tree = full.prefix(decision.nodes)
        tokens, offsets, block, side_slices = _step_input(tree, sides)
        return _Step(tree, drafts, side_slices, (tokens, offsets, block), decision, started)

    def _feed_back(self, step: "_Step", tokens: list[int], after: Context, logits: torch.Tensor,
                   side_argmax: list[list[int] | None], top: tuple[np.ndarray, np.ndarray] | None) -> None:
        """Tell every source what its step committed, with its side block's logits and argmax and,
        for sources that asked (``top_k``), the top-k of every tree row."""
        for source, side, argmax, wants_top in zip(self.sources, step.side_slices, side_argmax, self._wants_top):
            side_logits = logits[side].to(torch.float32) if side is not None else None
            top_ids, row_tokens = top if (wants_top and top is not None) else (None, None)
            source.observe(Feedback(committed=list(tokens), context=after, side_logits=side_logits,
                                    top_ids=top_ids, row_tokens=row_tokens, side_argmax=argmax))

    def _propose(self, source: DraftSource, context: Context, depth_limit: int) -> Draft:
        """Ask one source for a draft of up to ``max_tree_nodes`` nodes (the full tree: the adaptive
        budget checks a prefix of it and learns from the rest); cut its branches so a step never
        commits past the token limit; refuse token ids the model does not have. The source's own
        draft is left as it gave it: what the decoder uses is a new one."""
        draft = source.propose(context, self.max_tree_nodes)
        vocab = self.runner.vocab_size
        side = draft.side_block
        for tokens in [*draft.branches, side.tokens if side is not None else []]:
            bad = [t for t in tokens if not 0 <= int(t) < vocab]
            if bad:
                raise ValueError(f"draft source {source.name!r} proposed token ids {bad[:5]} outside the model's "
                                 f"vocabulary [0, {vocab})")
        if self.max_tree_nodes == 0 or depth_limit < 1:
            return Draft(side_block=side)
        return Draft(branches=[list(b[:depth_limit]) for b in draft.branches if len(b)], side_block=side)

    def _fit_side_blocks(self, drafts: Sequence[Draft], cache_len: int) -> list[SideBlock | None]:
        """The side blocks that fit after ``cache_len`` cached positions: one reaching past the
        model's context (near the end of a long sequence) is left out, and its source gets
        ``side_logits=None`` for this step."""
        limit = self.runner.max_positions
        sides: list[SideBlock | None] = []
        for draft in drafts:
            side = draft.side_block
            if side is not None and limit is not None and side.tokens and \
                    cache_len + max(side.positions) >= limit:
                side = None
            sides.append(side)
        return sides

    @staticmethod
    def _verify(tree: TokenTree, logits: torch.Tensor, settings: SamplingSettings, scorer: NodeScorer,
                committed: Sequence[int] | PenaltyPrefix, draw) -> Verdict:
        """The node-by-node walk (on a CPU, where a read per node costs nothing): ``committed`` is
        the prefix a prefix-dependent processor sees (the penalty's token set, or nothing)."""
        if settings.do_sample:
            return verify_sampling(tree, logits, scorer, committed, draw)
        return verify_greedy(tree, logits, None if scorer.is_identity else scorer, committed)

    def _record(self, stats: GenerationStats, tree: TokenTree, verdict: Verdict, kept: int) -> None:
        stats.steps += 1
        stats.accept_lengths.append(kept)
        stats.tree_sizes.append(len(tree))
        accepted_nodes = verdict.path[:kept]
        for index, name in enumerate(self._source_names):
            bit = 1 << index
            per = stats.per_source[name]
            per.proposed += sum(1 for s in tree.sources[1:] if s & bit)
            per.accepted += sum(1 for n in accepted_nodes if tree.sources[n] & bit)

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
                                 "batches are not supported yet")
            ids = prompt.tolist()
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            array = np.asarray(prompt, dtype=object) if len(prompt) else np.zeros(0)
            if array.ndim != 1:
                raise ValueError(f"a prompt must be one sequence of token ids, got a nested sequence of shape "
                                 f"{array.shape}; batches are not supported yet")
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


def _unique_names(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return out
