"""Threads: decoders in several threads over one model and one set of shared sources, and one
decoder wrongly used from two threads at once.

A server runs one :class:`~specdraft.Decoder` per worker thread; the model and the draft sources
are shared (the sources lock their own state). Greedy output is a function of the model and the
prompt alone, whatever the drafts were, so each thread must produce exactly the text it produces
on its own -- even though the frequency trie and the shared n-gram learn from every thread's
requests and so draft differently than they would alone.

A decoder owns a KV cache and runs one request at a time. Used from a second thread while
busy, it must fail fast with a clear ``RuntimeError`` (not corrupt the running request, not
block), and both the running request and later ones must be unaffected.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from specdraft import Decoder
from specdraft.sources import Context, Draft, Feedback
from specdraft.sources.jacobi import JacobiLookahead
from specdraft.sources.ngram import MultiLevelNGram
from specdraft.sources.prompt_lookup import PromptLookup
from specdraft.sources.trie import FrequencyTrie

from conftest import reference_greedy, tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")

N_THREADS = 4
REQUESTS_PER_THREAD = 12


def shared_sources() -> list:
    return [PromptLookup(), FrequencyTrie(capacity=64, max_nodes=400), MultiLevelNGram(),
            MultiLevelNGram(shared=True, max_contexts=200, name="ngram-shared"), JacobiLookahead(pool_size=32)]


def workload(seed: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    return [([int(t) for t in rng.integers(3, 20, size=int(rng.integers(2, 14)))], int(rng.integers(1, 12)))
            for _ in range(REQUESTS_PER_THREAD)]


def run_threads(target, n: int) -> list[BaseException]:
    errors: list[BaseException] = []

    def wrapped(k: int) -> None:
        try:
            target(k)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=wrapped, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors


@pytest.mark.parametrize("adaptive", [True, False])
def test_decoders_in_threads_over_shared_sources_give_their_solo_outputs(adaptive: bool) -> None:
    model = tiny_model("llama")
    jobs = {k: workload(100 + k) for k in range(N_THREADS)}
    # alone: plain model.generate (the decoder's greedy output must equal it, drafts or not)
    solo = {k: [reference_greedy(model, prompt, n) for prompt, n in jobs[k]] for k in jobs}
    sources = shared_sources()
    outputs: dict[int, list[list[int]]] = {}
    barrier = threading.Barrier(N_THREADS)

    def work(k: int) -> None:
        dec = Decoder(model, sources=sources, max_tree_nodes=12, adaptive_budget=adaptive)
        barrier.wait()
        outputs[k] = [dec.generate(prompt, max_new_tokens=n).token_ids for prompt, n in jobs[k]]

    errors = run_threads(work, N_THREADS)
    assert not errors, errors
    assert outputs == solo
    # the shared state is consistent and nothing of any request is left
    trie = sources[1]
    trie.check_invariants()
    assert trie.active_requests == 0 and len(trie) > 0
    assert sources[2].active_requests == [] and sources[3].active_requests == []
    assert sources[4].active_requests == 0
    assert all(prompt == 0 for _, prompt in trie.snapshot().values())


class Gate:
    """A source that, at its first propose, signals that the request is running and waits until
    the test lets it go: a deterministic window in which the decoder is busy."""

    name = "gate"

    def __init__(self) -> None:
        self.running = threading.Event()
        self.release = threading.Event()
        self.armed = True

    def begin(self, context: Context) -> None:
        pass

    def propose(self, context: Context, budget: int) -> Draft:
        if self.armed:
            self.armed = False
            self.running.set()
            assert self.release.wait(timeout=60), "the test never released the gate"
        return Draft()

    def observe(self, feedback: Feedback) -> None:
        pass

    def end(self, context: Context) -> None:
        pass


def test_a_decoder_used_from_two_threads_fails_fast_and_stays_usable() -> None:
    model = tiny_model("llama")
    gate = Gate()
    dec = Decoder(model, sources=[PromptLookup(), gate, FrequencyTrie()], max_tree_nodes=8)
    prompt, n = [5, 6, 7, 5, 6], 10
    expected = reference_greedy(model, prompt, n)
    result: dict[str, list[int]] = {}

    def first() -> None:
        result["tokens"] = dec.generate(prompt, max_new_tokens=n).token_ids

    worker = threading.Thread(target=first)
    worker.start()
    try:
        assert gate.running.wait(timeout=60), "the first request never started"
        # the decoder is mid-request in the other thread: a second request fails at once, from
        # generate and from stream alike, and says why
        with pytest.raises(RuntimeError, match="busy"):
            dec.generate([1, 2, 3], max_new_tokens=3)
        with pytest.raises(RuntimeError, match="busy"):
            list(dec.stream([1, 2, 3], max_new_tokens=3))
    finally:
        gate.release.set()
        worker.join(timeout=60)
    assert not worker.is_alive()
    assert result["tokens"] == expected  # the running request was not disturbed
    # and the decoder serves the next requests normally
    assert dec.generate(prompt, max_new_tokens=n).token_ids == expected
    assert dec.generate([9, 8, 7], max_new_tokens=6).token_ids == reference_greedy(model, [9, 8, 7], 6)


def test_racing_threads_on_one_decoder_either_succeed_exactly_or_are_told_it_is_busy() -> None:
    """No deterministic window this time: threads start together on one decoder. Each request
    either runs to the exact output or fails with the busy error; none sees another's cache."""
    model = tiny_model("llama")
    dec = Decoder(model, sources=shared_sources(), max_tree_nodes=8)
    jobs = [([int(t) for t in np.random.default_rng(k).integers(3, 20, size=6)], 8) for k in range(6)]
    expected = [reference_greedy(model, p, n) for p, n in jobs]
    ok, busy = [0] * len(jobs), [0] * len(jobs)
    barrier = threading.Barrier(len(jobs))

    def work(k: int) -> None:
        prompt, n = jobs[k]
        barrier.wait()
        for _ in range(5):
            try:
                tokens = dec.generate(prompt, max_new_tokens=n).token_ids
            except RuntimeError as exc:
                assert "busy" in str(exc), exc
                busy[k] += 1
                continue
            assert tokens == expected[k]
            ok[k] += 1

    errors = run_threads(work, len(jobs))
    assert not errors, errors
    assert sum(ok) >= 1
    for k, (prompt, n) in enumerate(jobs):
        assert dec.generate(prompt, max_new_tokens=n).token_ids == expected[k]
