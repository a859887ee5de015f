"""Host work behind the forward: on an accelerator, what the next read does not need runs while
the device computes.

Two pieces of host work wait for the launch of a forward instead of running between forwards:
the learning of sources that observe late (``observes_late``: the trie, Token Recycling, and the
n-gram model and suffix trees, whose drafts catch up by themselves), one step late, and the sources' indexing of a prompt, behind the forward that ends it. These tests
pin the order (on the simulated device, where the engine hides host work as on a GPU, and on the
CPU, where it does not), check that every feedback still arrives once, in order and before the
end, that outputs do not change, and that a late observe that raises ends its request alone.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import OracleSource, reference_greedy, tiny_model
from specdraft import BatchRequest, Decoder
from specdraft.engine.pause import DraftPause
from specdraft.simulated_device import SimulatedDevice
from specdraft.sources.base import Draft, observes_late
from specdraft.sources.registry import DEFAULT_SOURCES, make_sources
from specdraft.sources.trie import FrequencyTrie

PROMPT = [1, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 5, 6, 7]
NEW = 12


class Recorder:
    """A source that proposes what followed the root's last earlier occurrence and logs every call,
    with how many forwards had started at that moment. With ``fail_at``, its observe raises for
    the first request it sees once that request has committed ``fail_at`` tokens."""

    def __init__(self, name: str, log: list, forwards: list[int], late: bool, fail_at: int | None = None) -> None:
        self.name = name
        self.observes_late = late
        self.log, self.forwards, self.fail_at = log, forwards, fail_at
        self.observed: dict[int, list[int]] = {}
        self.first_request: int | None = None

    def _note(self, event: str, context) -> None:
        self.log.append((self.name, event, context.request_id, len(context.tokens), self.forwards[0]))

    def begin(self, context) -> None:
        self._note("begin", context)
        if self.first_request is None:
            self.first_request = context.request_id

    def propose(self, context, budget: int) -> Draft:
        self._note("propose", context)
        tokens = list(context.tokens)
        for i in range(len(tokens) - 2, -1, -1):
            if tokens[i] == tokens[-1]:
                return Draft(branches=[tokens[i + 1 : i + 1 + budget]] if budget else [])
        return Draft()

    def observe(self, feedback) -> None:
        self._note("observe", feedback.context)
        seen = self.observed.setdefault(feedback.context.request_id, [])
        seen.extend(feedback.committed)
        if self.fail_at is not None and feedback.context.request_id == self.first_request \
                and len(seen) >= self.fail_at:
            raise RuntimeError(f"{self.name} fails after {len(seen)} tokens")

    def end(self, context) -> None:
        self._note("end", context)

    def abort(self, context) -> None:
        self._note("abort", context)


def counting(model: torch.nn.Module) -> list[int]:
    forwards = [0]

    def started(*_):
        forwards[0] += 1

    model.register_forward_pre_hook(started)
    return forwards


def events(log: list, name: str) -> list[tuple[str, int, int]]:
    return [(event, length, forwards) for who, event, _, length, forwards in log if who == name]


def test_a_late_source_learns_behind_the_next_forward_on_an_accelerator() -> None:
    model = copy.deepcopy(tiny_model("llama", "sdpa"))
    forwards = counting(model)
    sim = SimulatedDevice()
    sim.adopt(model)
    log: list = []
    late, now = Recorder("late", log, forwards, True), Recorder("now", log, forwards, False)
    with sim, sim.patched_generator():
        dec = Decoder(model, None, sources=[late, now], max_tree_nodes=6, adaptive_budget=False)
        assert dec.engine.hides_host_work
        stream = dec.stream(PROMPT, max_new_tokens=NEW)
        first = next(stream)
        begun_before_first_token = [e for e in log if e[1] == "begin"]
        out = first + [t for chunk in stream for t in chunk]
    assert out == reference_greedy(tiny_model("llama", "sdpa"), PROMPT, NEW)
    # the prompt is indexed behind the prefill, before the first token is read
    assert len(begun_before_first_token) == 2 and all(e[4] == 1 for e in begun_before_first_token)
    for name in ("late", "now"):
        kinds = [e[0] for e in events(log, name)]
        assert kinds[0] == "begin" and kinds[-1] == "end" and kinds.count("propose") == kinds.count("observe")
    # the source that observes now hears each step before the next draft
    now_events = events(log, "now")[1:-1]
    assert [e[0] for e in now_events] == ["propose", "observe"] * (len(now_events) // 2)
    # the late one hears step t after step t+1's draft and the launch of its forward, in order
    late_events = events(log, "late")[1:-1]
    proposes = [e for e in late_events if e[0] == "propose"]
    observes = [e for e in late_events if e[0] == "observe"]
    assert [e[1] for e in observes] == sorted(e[1] for e in observes)  # in step order
    assert late.observed == now.observed  # every committed token heard, once
    for step, observe in enumerate(observes[:-1]):
        assert observe[2] == proposes[step + 1][2] + 1, late_events  # behind the next step's launch
        assert late_events.index(observe) > late_events.index(proposes[step + 1])
    assert observes[-1][2] == forwards[0]  # the last step's, at the end (no forward left to hide behind)


def test_on_a_cpu_every_source_learns_at_once_and_indexes_after_the_first_token() -> None:
    model = copy.deepcopy(tiny_model("llama", "sdpa"))
    forwards = counting(model)
    log: list = []
    late = Recorder("late", log, forwards, True)
    dec = Decoder(model, None, sources=[late], max_tree_nodes=6, adaptive_budget=False)
    assert not dec.engine.hides_host_work
    stream = dec.stream(PROMPT, max_new_tokens=NEW)
    next(stream)
    assert log == []  # nothing read the prompt before the first token
    list(stream)
    kinds = [e[0] for e in events(log, "late")]
    assert kinds == ["begin"] + ["propose", "observe"] * ((len(kinds) - 2) // 2) + ["end"]


@pytest.mark.parametrize("sources", [["trie"], ["recycle"], ["ngram"], ["suffix"], list(DEFAULT_SOURCES) + ["recycle"]])
def test_learning_late_changes_no_output_alone_or_batched(sources: list[str]) -> None:
    model = tiny_model("llama", "sdpa")
    prompts = [PROMPT, PROMPT[3:] + [12, 5, 6], [2, 9, 9, 4, 9, 9, 4, 9]]
    expected = [reference_greedy(model, p, NEW) for p in prompts]
    for hide in (False, True):
        dec = Decoder(model, None, sources=make_sources(sources), max_tree_nodes=8)
        dec.hide_host_work = hide
        assert [dec.generate(p, max_new_tokens=NEW).token_ids for p in prompts] == expected
        batch = dec.generate_batch(prompts, max_new_tokens=NEW, concurrency=3)
        assert [o.token_ids for o in batch] == expected


def test_the_ngram_model_and_suffix_trees_learn_late_and_their_drafts_catch_up_alone() -> None:
    """Their ``observe`` only catches their counts up with the context, and a draft does that
    itself: so they observe late, and a step without a draft (a paused one, or the budget's 0)
    learns behind the next forward. Drafts from a source that was never fed back read the whole
    context and equal those of one fed every step."""
    from specdraft.sources.base import Context, Feedback

    for name in ("ngram", "suffix"):
        fed, unfed = make_sources([name, name])
        assert observes_late(fed) and observes_late(unfed)
        tokens = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6]
        for source in (fed, unfed):
            source.begin(Context(tokens[:4], 4, 1))
        for n in range(5, len(tokens) + 1):
            context = Context(tokens[:n], 4, 1)
            fed.observe(Feedback(committed=[tokens[n - 1]], context=context))
        context = Context(tokens, 4, 1)
        assert fed.propose(context, 8).branches == unfed.propose(context, 8).branches


def test_learning_late_leaves_the_shared_trie_as_learning_at_once_does() -> None:
    model = tiny_model("llama", "sdpa")
    tries = []
    for hide in (False, True):
        trie = FrequencyTrie(decoding_length=8, branch_length=4)
        dec = Decoder(model, None, sources=[trie], max_tree_nodes=8, adaptive_budget=False)
        dec.hide_host_work = hide
        dec.generate_batch([PROMPT, PROMPT[4:], [3, 4, 3, 4, 3]], max_new_tokens=NEW, concurrency=2)
        trie.check_invariants()
        assert trie.active_requests == 0
        tries.append(trie.snapshot())
    assert tries[0] == tries[1] and tries[0]


@pytest.mark.parametrize("fail_at", [3, NEW - 1])
def test_a_late_observe_that_raises_ends_its_request_alone(fail_at: int) -> None:
    """Raised behind a forward (``fail_at=3``) or at the request's end, when the last step's
    feedback is delivered (``fail_at=NEW - 1``: the first token, from the prefill, is not observed): that request fails with the error, its sources abort,
    and the other request of the batch completes as it would alone."""
    model = tiny_model("llama", "sdpa")
    other = [2, 9, 9, 4, 9, 9, 4, 9]
    alone = Decoder(model, None, sources=[Recorder("bad", [], [0], True)], max_tree_nodes=6,
                    adaptive_budget=False).generate(other, max_new_tokens=NEW).token_ids
    log: list = []
    bad = Recorder("bad", log, [0], True, fail_at=fail_at)
    dec = Decoder(model, None, sources=[bad], max_tree_nodes=6, adaptive_budget=False)
    dec.hide_host_work = True
    outputs = dec.generate_batch([PROMPT, other], max_new_tokens=NEW, concurrency=2)
    assert isinstance(outputs[0].error, RuntimeError) and "bad fails" in str(outputs[0].error)
    assert outputs[1].error is None and outputs[1].token_ids == alone
    ends = [(e[1], e[2]) for e in log if e[1] in ("end", "abort")]
    assert ("abort", bad.first_request) in ends and ("end", bad.first_request) not in ends


def test_the_decoder_switch_takes_a_bool_or_none() -> None:
    dec = Decoder(tiny_model("llama", "sdpa"), None, sources=[], max_tree_nodes=4)
    assert dec.hide_host_work is None and not dec.engine.hides_host_work
    dec.hide_host_work = True
    assert dec.engine.hides_host_work
    with pytest.raises(ValueError, match="hide_host_work must be True, False or None, got 'yes'"):
        dec.hide_host_work = "yes"


def test_observes_late_must_be_a_bool() -> None:
    source = FrequencyTrie()
    assert observes_late(source) and not observes_late(object())
    source.observes_late = 1
    with pytest.raises(ValueError, match="observes_late=1.*True or False"):
        observes_late(source)


def test_a_one_token_request_indexes_no_prompt() -> None:
    """Its one token comes from the prompt step, so no draft will read the index."""
    log: list = []
    source = Recorder("late", log, [0], True)
    dec = Decoder(tiny_model("llama", "sdpa"), None, sources=[source], max_tree_nodes=6, adaptive_budget=False)
    dec.hide_host_work = True
    assert dec.generate(PROMPT, max_new_tokens=1).token_ids == reference_greedy(tiny_model("llama", "sdpa"), PROMPT, 1)
    assert log == []
    stream = dec.stream(PROMPT, max_new_tokens=2)
    next(stream)
    assert [e[1] for e in log] == ["begin"]  # indexed behind the prefill, before the first token
    list(stream)


def test_the_acceptance_walk_and_statistics_behind_the_forward_learn_what_they_learn_at_once() -> None:
    """With a source that observes at once and a fixed tree wide enough for all it drafts, neither
    the drafts nor the trees depend on what was learned when, so the tracker's learned rates and
    the requests' statistics must come out the same whether they were learned between the
    forwards or behind them."""
    model = tiny_model("llama", "sdpa")
    learned = []
    for hide in (False, True):
        dec = Decoder(model, None, sources=make_sources(["prompt"]), max_tree_nodes=64, adaptive_budget=False)
        dec.hide_host_work = hide
        outputs = [dec.generate(p, max_new_tokens=NEW) for p in (PROMPT, PROMPT[2:], [4, 8, 4, 8, 4, 8])]
        tracker = dec.engine.budget.acceptance
        stats = [(o.stats.steps, o.stats.accept_lengths, o.stats.tree_sizes,
                  {k: vars(v) for k, v in o.stats.per_source.items()}) for o in outputs]
        assert all(sum(o.stats.accept_lengths) == len(o.token_ids) for o in outputs)
        learned.append((list(tracker.long_run_ranks), list(tracker.long_run_sources), stats))
    assert learned[0] == learned[1]


def test_a_finished_requests_sources_end_behind_the_next_forward() -> None:
    """Its output is kept at once (with its last tokens); its sources' end waits for the next
    forward of the requests still running, and comes before the call returns."""
    model = copy.deepcopy(tiny_model("llama", "sdpa"))
    forwards = counting(model)
    log: list = []
    source = Recorder("late", log, forwards, True)
    dec = Decoder(model, None, sources=[source], max_tree_nodes=6, adaptive_budget=False)
    dec.hide_host_work = True
    short, long = BatchRequest(PROMPT, max_new_tokens=4), BatchRequest(PROMPT[5:], max_new_tokens=NEW)
    stream = dec.stream_batch([short, long], concurrency=2)
    got: list[int] = []
    for index, tokens in stream:
        if index == 0:
            got += tokens
            if len(got) == 4:
                assert stream.outputs[0] is not None and stream.outputs[0].token_ids == got
                assert not [e for e in log if e[1] == "end"]  # not yet: behind the next forward
    short_id = source.first_request
    mine = [e for e in log if e[2] == short_id]
    last_step = max(e[4] for e in mine if e[1] == "propose") + 1  # the forward of its last step
    assert [e[4] for e in mine if e[1] == "end"] == [last_step + 1]
    assert [o.token_ids for o in stream.result()] == [reference_greedy(tiny_model("llama", "sdpa"), p, n) for p, n
                                                      in ((PROMPT, 4), (PROMPT[5:], NEW))]
    assert {e[2] for e in log if e[1] == "end"} == {short_id, short_id + 1}


class ProtocolOracle(OracleSource):
    """The oracle, checking the source protocol: per request, every ``observe`` follows a
    ``propose`` made since the last ``observe``."""

    def __init__(self, sequence, name: str = "oracle") -> None:
        super().__init__(sequence, name=name)
        self.open: dict[int, bool] = {}

    def propose(self, context, budget: int) -> Draft:
        self.open[context.request_id] = True
        return super().propose(context, budget)

    def observe(self, feedback) -> None:
        assert self.open.pop(feedback.context.request_id, False), "observe without a propose before it"


@pytest.mark.parametrize("hidden", [True, False])
def test_a_pause_on_an_accelerator_drafts_behind_the_forward_for_the_next_step(monkeypatch, hidden: bool) -> None:
    """Every step a drafting pause's step: on an accelerator no source is asked before the
    forward; each drafts behind it, from the context before the step's tokens, and the next step
    checks what of those drafts follows them, so the oracle's drafts are still accepted, a step
    late. On a CPU the pause's steps check nothing. Outputs are generate's either way, alone and
    batched, and each observe still follows a propose."""
    model = tiny_model("llama")
    prompts = [PROMPT, PROMPT[3:]]
    refs = [reference_greedy(model, p, 24) for p in prompts]
    monkeypatch.setattr(DraftPause, "skip", lambda self: True)
    oracle = ProtocolOracle(prompts[0] + refs[0])
    dec = Decoder(model, None, sources=[oracle, *make_sources(list(DEFAULT_SOURCES))], max_tree_nodes=8,
                  adaptive_budget=False)
    dec.engine.hide_host_work = hidden
    out = dec.generate(prompts[0], max_new_tokens=24)
    assert out.token_ids == refs[0]
    assert out.stats.skipped_drafts == out.stats.steps - 1  # every tree step (the first token: the prompt's)
    if hidden:
        assert out.stats.steps <= 24 // 2  # the lagged drafts were checked and accepted
        assert sum(a > 1 for a in out.stats.accept_lengths) >= 2
    else:
        assert out.stats.steps == 24
    result = dec.generate_batch(prompts, max_new_tokens=24, concurrency=2)
    assert [o.token_ids for o in result] == refs
