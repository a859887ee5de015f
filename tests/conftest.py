"""Shared helpers for the fast test suite: tiny random models, a reference decoder, toy draft sources.

Everything here is deterministic and CPU-only. Models are float64, so KV caches can be compared to
1e-10 and logits (which specdraft hands back in float32, as ``model.generate`` also argmaxes them)
to one float32 ulp, and greedy argmaxes are never decided by float noise. Models are built once per
process (``functools.lru_cache``) and are shared between tests: a test that changes a model's
``generation_config`` must use :func:`generation_config_override` so the change is undone.

The toy sources satisfy the :class:`specdraft.sources.DraftSource` protocol and are meant to be
imported by other test modules (``from conftest import RandomGuess``; pytest puts ``tests/`` on
``sys.path``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import subprocess
import sys
import tempfile
import warnings
from typing import Any, Iterator, Sequence

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings

# Tiny models are fastest on one thread, and on a loaded 2-core machine two threads can make a
# tiny forward 10-30x slower; every test module gets one thread (the single_thread fixture below
# remains for modules that want to be explicit).
torch.set_num_threads(1)

# Kernel-cost measurements (``cpu_kernels="auto"``, specdraft.kernels.kernel_costs) and exact mode's
# row probes (a model shape's in bfloat16 takes about 15 s) are cached in the user's cache directory;
# the tests' go to a directory of their own, gone with the machine's temp files. The processes of
# one run (pytest-xdist's workers, and the subprocesses they start, which inherit it) share it, so
# each shape is probed once per run; cache files are written whole, through a rename.
if "SPECDRAFT_TEST_RUN_CACHE" not in os.environ:  # (a test's subprocess inherits its process's)
    os.environ["SPECDRAFT_TEST_RUN_CACHE"] = tempfile.mkdtemp(prefix="specdraft-tests-cache-")
os.environ["XDG_CACHE_HOME"] = os.environ["SPECDRAFT_TEST_RUN_CACHE"]

from specdraft.budget import Budget, Grant
from specdraft.sources import Context, Draft, Feedback, SideBlock


def pytest_configure(config: pytest.Config) -> None:
    """pytest-xdist's workers of one run share one cache directory, named by the run's id."""
    run = getattr(config, "workerinput", {}).get("testrunuid")
    if run:
        shared = os.path.join(tempfile.gettempdir(), f"specdraft-tests-cache-{run}")
        os.makedirs(shared, exist_ok=True)
        os.environ["SPECDRAFT_TEST_RUN_CACHE"] = os.environ["XDG_CACHE_HOME"] = shared


#: Vocabulary size of every tiny model.
VOCAB = 80

#: Architectures :func:`tiny_model` can build.
ARCHS = ("llama", "qwen2", "qwen2_swa", "mistral", "phi", "gpt2", "gemma3")

#: Sliding windows of the sliding-window archs (small, so prompts of ~20 tokens exceed them).
SLIDING_WINDOW = {"mistral": 7, "gemma3": 5, "qwen2_swa": 6}

# Random init scale per arch, picked so that greedy output is neither constant nor pure noise
# (tiny models at the default 0.02 mostly repeat one token; Gemma 3 scales its embeddings by
# sqrt(hidden) and saturates above ~0.05).
_INIT_RANGE = {"llama": 0.3, "qwen2": 0.3, "qwen2_swa": 0.3, "mistral": 0.3, "phi": 0.3, "gpt2": 0.5, "gemma3": 0.02}
_SEEDS = {arch: 1000 + i for i, arch in enumerate(ARCHS)}

#: Settings shared by every hypothesis test here: deterministic, no example database, no deadline.
FAST = settings(derandomize=True, database=None, deadline=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

logging.getLogger("transformers").setLevel(logging.ERROR)
try:  # transformers' own logger ignores the stdlib level once it has configured itself
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
except Exception:  # pragma: no cover
    pass


# -- models ------------------------------------------------------------------------------------


def _config(arch: str, overrides: dict[str, Any]):
    from transformers import (Gemma3TextConfig, GPT2Config, LlamaConfig, MistralConfig, PhiConfig,
                              Qwen2Config)

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=_INIT_RANGE[arch], bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        cfg = dict(common)
        cls = LlamaConfig
    elif arch == "qwen2":
        cfg = dict(common)
        cls = Qwen2Config
    elif arch == "qwen2_swa":  # layer 0 full attention, layer 1 sliding: a hybrid model
        cfg = dict(common, use_sliding_window=True, sliding_window=SLIDING_WINDOW[arch], max_window_layers=1)
        cls = Qwen2Config
    elif arch == "mistral":
        cfg = dict(common, sliding_window=SLIDING_WINDOW[arch])
        cls = MistralConfig
    elif arch == "phi":
        cfg = dict(common)
        cls = PhiConfig
    elif arch == "gpt2":
        cfg = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256,
                   initializer_range=_INIT_RANGE[arch], bos_token_id=1, eos_token_id=2)
        cls = GPT2Config
    elif arch == "gemma3":
        cfg = dict(common, head_dim=8, sliding_window=SLIDING_WINDOW[arch],
                   layer_types=["sliding_attention", "full_attention"])
        cls = Gemma3TextConfig
    else:
        raise ValueError(f"unknown arch {arch!r}; known: {ARCHS}")
    if "max_position_embeddings" in overrides and arch == "gpt2":
        overrides = dict(overrides)
        overrides["n_positions"] = overrides.pop("max_position_embeddings")
    cfg.update(overrides)
    return cls(**cfg)


@functools.lru_cache(maxsize=None)
def _build_tiny_model(arch: str, attn: str, **overrides: Any):
    from transformers import AutoModelForCausalLM

    config = _config(arch, overrides)
    torch.manual_seed(_SEEDS[arch])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float64)
    model.eval()
    assert model.config._attn_implementation == attn
    return model


def tiny_model(arch: str, attn: str = "sdpa", **overrides: Any):
    """A tiny random float64 causal LM of ``arch`` (hidden 32, 2 layers, 4 heads, 2 kv heads,
    vocab 80), in eval mode, built once per (arch, attn, overrides) (``functools.lru_cache``) and
    shared. Do not mutate it: change its generation config only through
    :func:`generation_config_override`, and do not hand it to ``Decoder(attention="flash")`` or
    ``select_attention`` (that switches the shared model's attention; build your own model for it).
    A switched backend is put back here, with a warning, so one test cannot skew the others."""
    model = _build_tiny_model(arch, attn, **overrides)
    if model.config._attn_implementation != attn:
        warnings.warn(f"a test switched the shared tiny {arch} model from {attn!r} to "
                      f"{model.config._attn_implementation!r}; switching it back")
        model.set_attn_implementation(attn)
    return model


tiny_model.cache_clear = _build_tiny_model.cache_clear  # type: ignore[attr-defined]


@contextlib.contextmanager
def generation_config_override(model, **fields: Any) -> Iterator[None]:
    """Temporarily set ``model.generation_config.<field>`` values (restored on exit)."""
    cfg = model.generation_config
    missing = object()
    saved = {k: getattr(cfg, k, missing) for k in fields}
    try:
        for k, v in fields.items():
            setattr(cfg, k, v)
        yield
    finally:
        for k, v in saved.items():
            if v is missing:
                delattr(cfg, k)
            else:
                setattr(cfg, k, v)


def ancestor_block(parents: Sequence[int]) -> np.ndarray:
    """``block[i, j]``: node ``i`` attends to node ``j`` (its ancestors and itself), found by walking
    parent pointers one by one: the brute-force twin of ``TokenTree.ancestor_mask``."""
    n = len(parents)
    block = np.zeros((n, n), dtype=bool)
    for i in range(n):
        j = i
        while j >= 0:
            block[i, j] = True
            j = parents[j]
    return block


def random_tree(n: int, seed: int) -> list[int]:
    """Parents of a random tree of ``n`` nodes in topological order (node 0 the root), bushy and deep."""
    rng = np.random.default_rng(seed)
    return [-1] + [int(rng.integers(max(0, i - 4), i)) for i in range(1, n)]


class AttentionModule(torch.nn.Module):
    """What an attention function reads of its layer: the query heads per key/value head."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.eval()


def exact_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed) -> torch.Tensor:
    """The exact attention of batch entry 0, ``[q, H, D]``, with the ``[q, kv]`` mask ``allowed``
    (made on the query's device; ``None``: causal)."""
    from specdraft.model.exact_attention import exact_attention

    mask = None if allowed is None else torch.as_tensor(allowed, device=q.device)[None, None]
    out, _ = exact_attention(AttentionModule(q.shape[1] // k.shape[1]), q, k, v, mask)
    return out[0]


def check_exact_attention_matches_sdpa() -> None:
    """The exact attention (whichever layout is switched on) equals ``sdpa`` up to float32
    rounding, for any mask (rows seeing scattered columns too) and without one (causal); a row
    that sees nothing gets zeros. Shared by the host layout's tests, the fixed layout's and the
    Triton kernels' (in the interpreter)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 14, 9, 64, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 2, 300, 64, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 2, 300, 64, generator=gen, dtype=torch.float64)
    allowed = torch.rand(9, 300, generator=gen) < 0.7
    allowed[:, 0] = True
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed[None, None],
                                                                enable_gqa=True).transpose(1, 2)[0]
    got = exact_attend(q.float(), k.float(), v.float(), allowed)
    assert torch.allclose(got.double(), expected, atol=2e-6), float((got.double() - expected).abs().max())
    causal = exact_attend(q[:, :, :3].float(), k[:, :, :3].float(), v[:, :, :3].float(), None)  # no mask: causal
    expected = torch.nn.functional.scaled_dot_product_attention(q[:, :, :3], k[:, :, :3], v[:, :, :3], is_causal=True,
                                                                enable_gqa=True).transpose(1, 2)[0]
    assert torch.allclose(causal.double(), expected, atol=2e-6)
    allowed[4] = False
    assert torch.equal(exact_attend(q.float(), k.float(), v.float(), allowed)[4], torch.zeros(14, 64))


def wide_llama(dtype: torch.dtype, attn: str = "sdpa", layers: int = 2):
    """Issue 43's random 896-wide Llama (two layers, MLP 4864, 14 heads on 2 key/value heads,
    vocabulary 512) in ``dtype``: wide enough that a forward of several rows computes a row's
    logits in other last bits than a one-row forward (the effect exact mode removes). Built anew
    per call (seeded), so that callers may cache, move or convert their own copy; ``layers``
    shortens it where a test's time goes by layers."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=512, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(43)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    return model.eval().requires_grad_(False)


def repetitive_prompt(seed: int, vocab: int = 512) -> list[int]:
    """A prompt that repeats itself with small edits: drafts are long and often right."""
    rng = np.random.default_rng(seed)
    unit = rng.integers(3, vocab, size=int(rng.integers(6, 14))).tolist()
    prompt = []
    for _ in range(int(rng.integers(3, 6))):
        edited = list(unit)
        edited[int(rng.integers(len(edited)))] = int(rng.integers(3, vocab))
        prompt += edited
    return prompt


@torch.inference_mode()
def reference_greedy(model, prompt: Sequence[int], n: int, **generate_kwargs: Any) -> list[int]:
    """The new tokens of plain ``model.generate(do_sample=False)`` (the ground truth)."""
    if n == 0:
        return []
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             **generate_kwargs)
    return out[0, ids.shape[1]:].tolist()


@torch.inference_mode()
def full_logits(model, tokens: Sequence[int]) -> torch.Tensor:
    """Logits ``[len(tokens), vocab]`` of one fresh, cache-free forward (the model's own masks)."""
    ids = torch.tensor([list(tokens)], dtype=torch.long)
    return model(input_ids=ids, use_cache=False).logits[0]


def assert_float32_logits_match(actual: torch.Tensor, expected: torch.Tensor, model=None) -> None:
    """``actual`` are specdraft's float32 logits, ``expected`` float64 ones of the same numbers.

    Under SDPA both come from float64 computations that agree to ~1e-13, so after rounding to
    float32 they differ by at most one float32 ulp (relative 6e-8). transformers' *eager*
    attention takes its softmax in float32 even for a float64 model, so there two different but
    equivalent masks legitimately differ by ~1e-7 relative; we allow 2e-5 there. A wrong mask
    moves logits by ~1e-2.
    """
    eager = model is not None and model.config._attn_implementation == "eager"
    rtol, atol = (2e-5, 2e-6) if eager else (2e-7, 1e-12)
    torch.testing.assert_close(actual.to(torch.float64), expected.to(torch.float64), rtol=rtol, atol=atol)


# -- the tree merge, re-derived ------------------------------------------------------------------


def reference_merge(sources: Sequence[Sequence[Sequence[int]]], budget: int, rate=None):
    """Brute force of ``TokenTree.from_drafts``: every proposed node (a token path, as a tuple)
    with its ``(source, rank)`` proposers, the ``budget`` best by value (the product of each node's
    combined rate along its path), ties to the node met first reading the branches in turns.
    A node is worth at most its parent and its parent is met first, so this global sort never
    puts a node before its parent. Returns (path -> set of sources, the selected paths in order)."""
    import math

    from specdraft.tree import prior_rate

    rate = prior_rate if rate is None else rate
    met: list[tuple[int, ...]] = []
    proposers: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    rounds = max((len(s) for s in sources), default=0)
    for r in range(rounds):
        for si, branches in enumerate(sources):
            if r >= len(branches):
                continue
            for k in range(1, len(branches[r]) + 1):
                seq = tuple(int(t) for t in branches[r][:k])
                if seq not in proposers:
                    met.append(seq)
                    proposers[seq] = []
                if all(s != si for s, _ in proposers[seq]):
                    # rank: children of the same parent this source proposed before this one
                    rank = sum(1 for other in met
                               if other != seq and other[:-1] == seq[:-1] and any(s == si for s, _ in proposers[other]))
                    proposers[seq].append((si, rank))

    def cost(seq: tuple[int, ...]) -> float:
        total = 0.0
        for k in range(1, len(seq) + 1):
            total -= math.log(_noisy_or(proposers[seq[:k]], k, rate))
        return total

    order = sorted(met, key=lambda seq: (cost(seq), met.index(seq)))[:budget]
    return {seq: {s for s, _ in proposers[seq]} for seq in order}, order


# -- looking inside sources ----------------------------------------------------------------------


def ngram_model_for(source, request_id: int):
    """The model a :class:`MultiLevelNGram` request drafts from (in shared mode the running
    requests' view, an overlay of the shared model), or, for a request not running, the shared
    model (``None`` in per-request mode)."""
    state = source._requests.get(request_id)
    return source.shared_model if state is None else state.model


def max_bucket(pool) -> int:
    """The largest number of continuations a Jacobi :class:`NGramPool` stores under one key."""
    return max((len(b) for b in pool._by_key.values()), default=0)


# -- toy draft sources ---------------------------------------------------------------------------


def _rng(seed: int, context: Context) -> np.random.Generator:
    """A generator that depends on the seed and the context only (not on test order)."""
    return np.random.default_rng([seed, len(context.tokens), *[int(t) for t in context.tokens[-64:]]])


class RandomGuess:
    """Proposes a few random branches: some copied (and maybe mutated) from what followed an
    earlier occurrence of a context token, some pure noise; duplicates, prefixes of each other and
    empty branches included on purpose. Wrong most of the time, right now and then."""

    def __init__(self, seed: int = 0, vocab_size: int = VOCAB, max_branches: int = 4, max_len: int = 6,
                 copy_prob: float = 0.6, name: str = "random") -> None:
        self.seed = seed
        self.vocab_size = vocab_size
        self.max_branches = max_branches
        self.max_len = max_len
        self.copy_prob = copy_prob
        self.name = name
        self.active: set[int] = set()
        self.calls = 0

    def begin(self, context: Context) -> None:
        self.active.add(context.request_id)

    def end(self, context: Context) -> None:
        self.active.discard(context.request_id)

    def observe(self, feedback: Feedback) -> None:
        assert feedback.context.request_id in self.active

    def propose(self, context: Context, budget: int) -> Draft:
        assert context.request_id in self.active
        self.calls += 1
        rng = _rng(self.seed, context)
        toks = list(context.tokens)
        branches: list[list[int]] = []
        left = budget
        for _ in range(int(rng.integers(0, self.max_branches + 1))):
            if left <= 0:
                break
            length = int(rng.integers(1, self.max_len + 1))
            r = rng.random()
            if r < self.copy_prob and len(toks) > 1:
                # what followed an earlier occurrence of the root (or of a random token)
                hits = [i for i in range(len(toks) - 1) if toks[i] == toks[-1]]
                start = (int(rng.choice(hits)) if hits else int(rng.integers(0, len(toks) - 1))) + 1
                branch = toks[start:start + length]
                if branch and rng.random() < 0.3:
                    branch[int(rng.integers(0, len(branch)))] = int(rng.integers(0, self.vocab_size))
            elif r < self.copy_prob + 0.1 and branches:
                branch = list(branches[int(rng.integers(0, len(branches)))])
                branch = branch[: int(rng.integers(0, len(branch) + 1))]  # a prefix (maybe empty)
            else:
                branch = rng.integers(0, self.vocab_size, size=length).tolist()
            branch = [int(t) for t in branch][:left]
            left -= len(branch)
            branches.append(branch)
        return Draft(branches=branches)


class PassiveSource:
    """The three members of :class:`~specdraft.sources.base.DraftSource` that a source which
    learns nothing leaves empty (``begin``, ``end``, ``observe``); subclasses add ``name`` and
    ``propose``."""

    def begin(self, context: Context) -> None:
        pass

    def end(self, context: Context) -> None:
        pass

    def observe(self, feedback: Feedback) -> None:
        pass


class Oracles(PassiveSource):
    """Knows several requests' answers: drafts the true continuation (past EOS and past the limit)
    of whichever one the context is a prefix of, as a shared source would for a batch: long
    accepted runs, so stops fall inside a step."""

    name = "oracles"

    def __init__(self, sequences: Sequence[Sequence[int]]) -> None:
        self.sequences = [list(s) for s in sequences]

    def propose(self, context: Context, budget: int) -> Draft:
        tokens = list(context.tokens)
        for seq in self.sequences:
            if seq[: len(tokens)] == tokens and len(seq) > len(tokens):
                return Draft(branches=[seq[len(tokens) : len(tokens) + budget]])
        return Draft()


class OracleSource(PassiveSource):
    """Proposes the exact continuation of ``sequence`` (prompt + reference output) while the
    context is a prefix of it, using the whole budget, so long runs are accepted; its draft runs
    past EOS and past ``max_new_tokens`` whenever ``sequence`` does. With ``decoy`` it also
    proposes, before the true branch, a branch that shares the true first token and then goes
    wrong, and a wrong single token."""

    def __init__(self, sequence: Sequence[int], decoy: bool = False, vocab_size: int = VOCAB,
                 name: str = "oracle") -> None:
        self.sequence = [int(t) for t in sequence]
        self.decoy = decoy
        self.vocab_size = vocab_size
        self.name = name
        self.proposed_lengths: list[int] = []

    def propose(self, context: Context, budget: int) -> Draft:
        n = len(context.tokens)
        if tuple(self.sequence[:n]) != tuple(context.tokens) or budget <= 0:
            return Draft()
        true = self.sequence[n:n + budget]
        branches = [true] if true else []
        if self.decoy and true:
            wrong = (true[0] + 1) % self.vocab_size
            decoys = [[wrong]]
            if len(true) > 1:
                decoys.insert(0, [true[0], (true[1] + 1) % self.vocab_size, true[0]])
            branches = decoys + branches
        self.proposed_lengths.append(len(true))
        return Draft(branches=branches)


def _noisy_or(proposers, depth: int, rate) -> float:
    """The merge's rate of a node several ``(source, rank)`` pairs proposed, clipped to (0, 1)."""
    miss = 1.0
    for source_index, rank in proposers:
        miss *= 1.0 - rate(source_index, depth, rank)
    return min(max(1.0 - miss, 1e-6), 1.0 - 1e-6)


def add_branch(tree, branch) -> int:
    """Insert ``branch`` below the root of ``tree`` in the order given (a hand-built tree, as in a
    paper's figure), reusing the nodes of a shared prefix; returns the nodes created."""
    node, created = 0, 0
    for token in branch:
        token = int(token)
        child = tree.child(node, token)
        if child is None:
            child = len(tree.tokens)
            tree.tokens.append(token)
            tree.parents.append(node)
            tree.depth.append(tree.depth[node] + 1)
            tree.sources.append(1)
            tree.proposers.append(((0, 0),))
            tree._children.append({})
            tree._children[node][token] = child
            created += 1
        node = child
    return created


class OneSequence:
    """One sequence over a :class:`~specdraft.model.runner.ModelRunner`, driven as the engine drives
    a request alone (one region at row 0): prefill, tree forwards, keeping a path."""

    def __init__(self, model, capacity: int = 256) -> None:
        from specdraft.model.runner import ModelRunner

        self.runner = ModelRunner(model)
        self.region = self.runner.store.allocate(capacity)

    @property
    def mask_kind(self) -> str:
        return self.runner.mask_kind

    @property
    def cache_len(self) -> int:
        return self.region.length + self.region.pending

    @property
    @torch.inference_mode()
    def cache(self):
        """The committed rows' keys and values, per layer (views; the pending moves, which the
        engine lets ride the next forward's upload, applied first)."""
        store = self.runner.store
        sources, destinations = store.take_moves()
        layers = [layer for layer in store.layers if layer.key_buffer is not None]
        if sources and layers:
            device = layers[0].key_buffer.device
            store.apply_moves(torch.as_tensor(sources, device=device), torch.as_tensor(destinations, device=device))
        rows = slice(self.region.start, self.region.start + self.region.length)
        return [(layer.key_buffer[..., rows, :], layer.value_buffer[..., rows, :]) for layer in layers]

    def prefill(self, tokens):
        """Put ``tokens`` in the cache (all committed); the last one's logits (``None`` for none)."""
        from specdraft.model.runner import Segment

        if not tokens:
            return None
        n = len(tokens)
        out = self.runner.forward([Segment(self.region, list(tokens), np.arange(self.region.length,
                                                                                 self.region.length + n),
                                           None, [n - 1])])
        self.runner.store.keep_all(self.region)
        return out.logits[0]

    def forward(self, tokens, offsets, block):
        """Run ``tokens`` at ``offsets`` after the cached ones with ``block`` among them; their logits."""
        from specdraft.model.runner import Segment

        segment = Segment(self.region, list(tokens), np.asarray(offsets) + self.region.length, np.asarray(block),
                          range(len(tokens)))
        return self.runner.forward([segment]).logits

    def compact(self, keep) -> None:
        """Keep the rows ``keep`` of the last forward; drop the rest."""
        self.runner.store.keep(self.region, list(keep))


class AlternatingBudget(Budget):
    """A budget that forces a plain step (0 nodes) every other step and the full tree on the others,
    so a test sees both kinds of step in one short generation; it still learns as the real one does."""

    def __init__(self, max_nodes: int, num_sources: int = 1, **options) -> None:
        super().__init__(max_nodes, num_sources, **options)
        self.calls = 0

    @property
    def chooses(self) -> bool:
        """Its plain steps are forced, not chosen for cost: no drafting pause follows them."""
        return False

    def allocate(self, asks):
        if not any(a.decoding for a in asks):  # a prompt's forward: no tree to size
            return [Grant(0, False)] * len(asks)
        self.calls += 1
        if self.calls % 2 == 0:
            return [Grant(0, False)] * len(asks)
        return [Grant(min(a.offered, self.max_nodes), True) if a.decoding else Grant(0, False) for a in asks]


class SideBlockToy:
    """Asks for a side block of a few random tokens every step and records the logits it gets back.

    ``mode``:
      * ``"chain"``: tokens s1..sm at offsets 1..m, lower-triangular mask, sees the root -- side
        token j is then exactly "the model after committed + s1..sj";
      * ``"forest"``: each side token's parent is the root or an earlier side token, offset =
        depth, mask = ancestors-or-self, sees the root -- side token j is "the model after
        committed + the path to j";
      * ``"wild"``: random offsets >= 1, a random lower-triangular mask, ``sees_root`` random: no
        exact expectation, used to check the side block never disturbs the tree. Each token sees
        itself unless ``allow_blind`` (a token that sees no key at all trips a known eager-attention
        bug, see test_runner.py::test_side_token_that_sees_nothing_does_not_corrupt_the_tree).

    ``records`` holds one dict per step: the context tokens at proposal time, the side tokens,
    their parents (-1 = root; ``None`` in wild mode) and the side logits from ``observe``.
    With ``branches=True`` it also proposes one random branch, so it is in the tree as well.
    """

    def __init__(self, seed: int = 0, vocab_size: int = VOCAB, max_side: int = 4, mode: str = "chain",
                 branches: bool = False, allow_blind: bool = False, name: str = "side") -> None:
        if mode not in ("chain", "forest", "wild"):
            raise ValueError(mode)
        self.seed = seed
        self.vocab_size = vocab_size
        self.max_side = max_side
        self.mode = mode
        self.branches = branches
        self.allow_blind = allow_blind
        self.name = name
        self.records: list[dict[str, Any]] = []
        self.dropped = 0  # steps whose side block the decoder dropped (past the model's context)
        self._pending: dict[int, dict[str, Any]] = {}

    def begin(self, context: Context) -> None:
        self._pending.pop(context.request_id, None)

    def end(self, context: Context) -> None:
        self._pending.pop(context.request_id, None)

    def propose(self, context: Context, budget: int) -> Draft:
        rng = _rng(self.seed + 7, context)
        m = int(rng.integers(1, self.max_side + 1))
        tokens = rng.integers(0, self.vocab_size, size=m).tolist()
        sees_root = True
        if self.mode == "chain":
            parents = list(range(-1, m - 1))
        elif self.mode == "forest":
            parents = [int(rng.integers(-1, j)) for j in range(m)]  # -1 = the root
        else:
            parents = None
        if parents is not None:
            depth, mask = [], np.zeros((m, m), dtype=bool)
            for j, p in enumerate(parents):
                depth.append(1 if p < 0 else depth[p] + 1)
                if p >= 0:
                    mask[j] = mask[p]
                mask[j, j] = True
            positions = depth
        else:
            positions = rng.integers(1, 12, size=m).tolist()
            mask = np.tril(rng.random((m, m)) < 0.6)
            if not self.allow_blind:
                mask |= np.eye(m, dtype=bool)
            sees_root = bool(rng.random() < 0.7)
        side = SideBlock(tokens=[int(t) for t in tokens], positions=[int(p) for p in positions], mask=mask,
                         sees_root=sees_root)
        self._pending[context.request_id] = dict(context=tuple(context.tokens), tokens=side.tokens,
                                                 parents=parents, positions=side.positions)
        branch = [rng.integers(0, self.vocab_size, size=int(rng.integers(1, 4))).tolist()] if self.branches else []
        return Draft(branches=branch, side_block=side)

    def observe(self, feedback: Feedback) -> None:
        rec = self._pending.pop(feedback.context.request_id)
        if feedback.side_logits is None:
            # the decoder drops a side block that would reach past the model's context (documented);
            # anywhere else a missing answer is a bug, which the tests see through ``dropped``
            self.dropped += 1
            return
        rec["side_logits"] = feedback.side_logits.detach().clone()
        rec["committed"] = list(feedback.committed)
        self.records.append(rec)

    @staticmethod
    def path(rec: dict[str, Any], j: int) -> list[int]:
        """Side tokens on the path root -> side token j (j included)."""
        out = []
        while j >= 0:
            out.append(rec["tokens"][j])
            j = rec["parents"][j]
        return out[::-1]


def check_side_records(model, records: Sequence[dict[str, Any]]) -> int:
    """Assert every chain/forest side logit equals a fresh forward of context + path; return the
    number of side tokens checked."""
    checked = 0
    for rec in records:
        if rec["parents"] is None:
            continue
        logits = rec["side_logits"]
        assert logits.shape == (len(rec["tokens"]), model.config.get_text_config().vocab_size)
        for j in range(len(rec["tokens"])):
            expected = full_logits(model, list(rec["context"]) + SideBlockToy.path(rec, j))[-1]
            assert_float32_logits_match(logits[j], expected, model)
            checked += 1
    return checked


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def single_thread():
    """Run a module's tiny-model tests on one torch thread (restored afterwards).

    Tiny matrices gain nothing from a second thread, and when the machine is oversubscribed
    (parallel CI jobs, benchmarks) OpenMP's spinning threads slow tiny forwards down ~10x.
    Opt in with ``pytestmark = pytest.mark.usefixtures("single_thread")``.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def make_model():
    """The :func:`tiny_model` factory as a fixture."""
    return tiny_model


@pytest.fixture
def offline_cache(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """No hub access and a throw-away user cache, for tests of model resolution and the CLI."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "specdraft-cache"))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random Llama checkpoint with a tokenizer, saved once per module."""
    from _tiny_checkpoint import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-llama")


class RerunGraph:
    """What a CUDA graph does, on any device (``graph_kind`` of ``use_static`` on a CPU): two
    warm-up runs at capture, then every replay runs the forward again over the buffers' current
    contents."""

    def __init__(self, fn) -> None:
        self.fn = fn
        for _ in range(2):
            fn()

    def replay(self) -> torch.Tensor:
        return self.fn()


def in_triton_interpreter(module: str, setup: str, check: str, sanitize_overflow: bool = True) -> None:
    """Run ``check()`` of the test module ``module`` in a fresh process with Triton's interpreter
    on (it is chosen when Triton is first imported, and transformers imports it early), after
    ``setup``: statements over ``t``, that module (switching its kernels on). ``sanitize_overflow``
    off skips the interpreter's overflow check of each integer operation (a debug-mode check on a
    GPU; most of the interpreter's time in a long check)."""
    pytest.importorskip("triton", reason="the Triton kernels need the triton package (pip install triton)")
    if not sanitize_overflow:
        setup += ("; import dataclasses, triton.runtime.interpreter as i; b = i.interpreter_builder; "
                  "b.options = dataclasses.replace(b.options, sanitize_overflow=False)")
    code = f"import sys; sys.path.insert(0, sys.argv[1]); import {module} as t; {setup}; t.{check}()"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__))], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
