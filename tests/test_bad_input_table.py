"""Bad input, table-driven: every public entry point and CLI flag against wrong types, empty, huge
and negative values, unknown names, foreign token ids and context-length edges.

Each row names the call, the exception it must raise (or ``None`` for a documented non-error
behaviour) and fragments the message must contain: the bad value and what is allowed. After every
failed request the shared draft-source state (trie nodes and counts, the shared n-gram's table,
live per-request states, Jacobi windows) must be exactly what it was before: a deep snapshot is
compared. ``tests/test_bad_input.py`` holds the hand-written cases (prompt shapes, sampling
options, stop-rule unit tests, model kinds); rows here do not repeat them.

A request that fails *after* it started (a source raising in its first ``propose``) must leave the
shared state exactly as it was too: the decoder aborts its sources, which undo what it taught them
(``tests/test_failed_request.py`` covers every source and every way to fail).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pytest

from specdraft import Decoder, UnsupportedOptionError
from specdraft.cli import main
from specdraft.source_spec import SourceSpecError
from specdraft.sources import Context, Feedback
from specdraft.sources.jacobi import JacobiLookahead
from specdraft.sources.ngram import MultiLevelNGram
from specdraft.sources.prompt_lookup import PromptLookup
from specdraft.sources.registry import parse_source_names
from specdraft.sources.trie import FrequencyTrie

from conftest import VOCAB, generation_config_override, reference_greedy, tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")

CONTEXT = 256  # max_position_embeddings of the tiny models
FOREIGN = 151_936  # a token id range from another (the default model's) vocabulary



class LetterTokenizer:
    """Ids 0..25 decode to single letters, 26.. to '<id>'; enough for stop strings."""

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("a") + int(i)) if int(i) < 26 else f"<{int(i)}>" for i in ids)

    def __call__(self, text: str):
        return {"input_ids": [ord(c) - ord("a") for c in text]}


# -- shared sources and their deep snapshot -----------------------------------------------------------


def warmed_sources() -> dict[str, Any]:
    """One of each source, with learnt state (as in a server that has run for a while)."""
    trie = FrequencyTrie(capacity=40, max_nodes=300)
    shared = MultiLevelNGram(shared=True, max_contexts=200, name="ngram-shared")
    rng = np.random.default_rng(7)
    for rid in range(1, 9):
        stream = [int(t) for t in rng.integers(3, 20, size=20)]
        trie.insert(stream)
        shared.begin(Context(tuple(stream[:10]), 10, -rid))
        shared.observe(Feedback(committed=stream[10:], context=Context(tuple(stream), 10, -rid)))
        shared.end(Context(tuple(stream), 10, -rid))
    return dict(prompt=PromptLookup(), trie=trie, ngram=MultiLevelNGram(), shared=shared, jacobi=JacobiLookahead())


def live(source) -> int:
    value = source.active_requests
    return value if isinstance(value, int) else len(value)


def snapshot(sources: dict[str, Any]) -> dict[str, Any]:
    """Everything a request could leave behind in the shared sources, as plain comparable data."""
    trie, shared = sources["trie"], sources["shared"]
    table = {}
    for n in range(2, shared.max_ngram + 1):
        table.update(shared.shared_model.counts(n))
    return dict(trie=(trie.snapshot(), trie.tree_sizes(), live(trie), trie.prunes, trie.pruned_nodes),
                shared=(table, live(shared)), ngram=live(sources["ngram"]), jacobi=live(sources["jacobi"]),
                prompt=dict(vars(sources["prompt"])))


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture
def env(model):
    sources = warmed_sources()
    dec = Decoder(model, sources=list(sources.values()), max_tree_nodes=8)
    text_dec = Decoder(model, tokenizer=LetterTokenizer(), sources=list(sources.values()), max_tree_nodes=8)
    return dict(model=model, sources=sources, dec=dec, text_dec=text_dec)


# -- Decoder.generate -----------------------------------------------------------------------------------


@dataclass
class Row:
    id: str
    call: Callable[[dict[str, Any]], Any]
    error: type[BaseException] | None
    fragments: tuple[str, ...] = ()
    check: Callable[[dict[str, Any], Any], None] | None = field(default=None, repr=False)


def gen(prompt, **kwargs) -> Callable[[dict[str, Any]], Any]:
    return lambda env: env["dec"].generate(prompt, **kwargs)


def text_gen(prompt, **kwargs) -> Callable[[dict[str, Any]], Any]:
    return lambda env: env["text_dec"].generate(prompt, **kwargs)


def same_as_generate(prompt, n):
    def check(env, out) -> None:
        assert out.token_ids == reference_greedy(env["model"], prompt, n)
    return check


GENERATE_ROWS = [
    # token limits
    Row("max_new_tokens huge", gen([3, 4], max_new_tokens=10**9), ValueError, ("1000000000", f"{CONTEXT}")),
    Row("max_new_tokens negative", gen([3, 4], max_new_tokens=-7), ValueError, ("-7", ">= 0")),
    Row("max_new_tokens float", gen([3, 4], max_new_tokens=2.0), ValueError, ("2.0", "int")),
    Row("max_new_tokens bool", gen([3, 4], max_new_tokens=True), ValueError, ("True", "int")),
    Row("max_new_tokens zero", gen([3, 4], max_new_tokens=0), None,
        check=lambda env, out: (out.token_ids == [] and out.stats.steps == 0) or pytest.fail(str(out))),
    # the context length
    Row("prompt beyond the context", gen([3] * (CONTEXT + 1), max_new_tokens=0), ValueError,
        (f"{CONTEXT + 1} tokens", f"{CONTEXT}")),
    Row("prompt filling the context, one more token", gen([3] * CONTEXT, max_new_tokens=1), ValueError,
        (f"{CONTEXT} tokens", "max_new_tokens=1", f"context of {CONTEXT}")),
    Row("prompt filling the context, no new token", gen([3] * CONTEXT, max_new_tokens=0), None,
        check=lambda env, out: out.token_ids == [] or pytest.fail(str(out))),
    Row("prompt one short of the context", gen([3, 4] * ((CONTEXT - 1) // 2) + [5], max_new_tokens=1), None,
        check=same_as_generate([3, 4] * ((CONTEXT - 1) // 2) + [5], 1)),
    # token ids
    Row("token id = vocab size", gen([5, VOCAB], max_new_tokens=2), ValueError, (f"{VOCAB}", f"[0, {VOCAB})")),
    Row("token id of another vocabulary", gen([5, FOREIGN - 1], max_new_tokens=2), ValueError,
        (f"{FOREIGN - 1}", f"[0, {VOCAB})")),
    Row("token id huge", gen([2**40], max_new_tokens=2), ValueError, (f"{2**40}", f"[0, {VOCAB})")),
    Row("token id negative in numpy", gen(np.array([4, -3]), max_new_tokens=2), ValueError, ("-3", f"[0, {VOCAB})")),
    Row("token ids as strings", gen(["4", "5"], max_new_tokens=2), ValueError, ("'4'", "ints")),
    Row("token ids as bools", gen([True, 5], max_new_tokens=2), ValueError, ("True", "ints")),
    Row("prompt None", gen(None, max_new_tokens=2), TypeError, ("NoneType", "str", "token ids")),
    Row("prompt a dict", gen({"input_ids": [1, 2]}, max_new_tokens=2), TypeError, ("dict", "str", "token ids")),
    # seeds and sampling options
    Row("seed a string", gen([3, 4], max_new_tokens=2, do_sample=True, seed="x"), (ValueError, TypeError),
        ("seed", "'x'", "int")),
    Row("seed a float", gen([3, 4], max_new_tokens=2, do_sample=True, seed=1.5), (ValueError, TypeError),
        ("seed", "1.5", "int")),
    Row("seed a bool", gen([3, 4], max_new_tokens=2, do_sample=True, seed=True), (ValueError, TypeError),
        ("seed", "True")),
    Row("do_sample a string", gen([3, 4], max_new_tokens=2, do_sample="yes"), (ValueError, TypeError),
        ("do_sample", "'yes'")),
    Row("temperature a string", gen([3, 4], max_new_tokens=2, do_sample=True, temperature="hot"),
        (ValueError, TypeError), ("temperature", "'hot'")),
    Row("top_k a float", gen([3, 4], max_new_tokens=2, do_sample=True, top_k=2.5), (ValueError, TypeError),
        ("top_k", "2.5")),
    # stop strings
    Row("stop an int", text_gen("abc", max_new_tokens=2, stop=5), (ValueError, TypeError), ("stop", "5")),
    Row("stop string empty", text_gen("abc", max_new_tokens=2, stop=[""]), ValueError, ("non-empty", "''")),
    Row("stop string not a str", text_gen("abc", max_new_tokens=2, stop=["a", 3]), ValueError, ("non-empty str", "3")),
]


@pytest.mark.parametrize("row", [pytest.param(r, id=r.id) for r in GENERATE_ROWS])
def test_generate_table(env, row: Row) -> None:
    before = snapshot(env["sources"])
    if row.error is None:
        out = row.call(env)
        row.check(env, out)
    else:
        with pytest.raises(row.error) as info:
            row.call(env)
        message = str(info.value)
        for fragment in row.fragments:
            assert fragment in message, f"{fragment!r} not in {message!r}"
    if row.error is not None or row.id.endswith(("zero", "no new token")):
        assert snapshot(env["sources"]) == before, "a refused request changed the shared sources"
    # and the decoder still serves a normal request
    assert env["dec"].generate([3, 4, 5], max_new_tokens=3).token_ids == reference_greedy(env["model"], [3, 4, 5], 3)


# -- documented edge behaviour ----------------------------------------------------------------------------


def test_eos_as_the_first_new_token_ends_the_request_like_generate(env) -> None:
    model, prompt = env["model"], [7, 8, 9, 7]
    first = reference_greedy(model, prompt, 1)[0]
    with generation_config_override(model, eos_token_id=first):
        out = env["dec"].generate(prompt, max_new_tokens=10)
        assert out.token_ids == [first] == reference_greedy(model, prompt, 10)
        # an EOS inside the prompt does not stop anything (as in model.generate)
        prompt2 = [first, 3, 4]
        assert env["dec"].generate(prompt2, max_new_tokens=5).token_ids == reference_greedy(model, prompt2, 5)
    assert all(live(s) == 0 for s in env["sources"].values() if hasattr(s, "active_requests"))


def test_stop_strings_match_the_generated_text_only(env) -> None:
    """A stop string that would start in the prompt's text and end in the output does not fire
    (stop strings are matched in the generated text, as ``StopRule.cut`` documents); one that
    spans two generated tokens does, right after the token that completes it."""
    model, tok = env["model"], LetterTokenizer()
    prompt = [0, 1, 2]  # "abc"
    with generation_config_override(model, eos_token_id=None):
        ref = reference_greedy(model, prompt, 12)
        text = tok.decode(ref)
        straddle = "c" + text[0]  # last prompt char + first generated char
        if straddle not in text:  # (it would legitimately fire later in the output)
            out = env["text_dec"].generate(prompt, max_new_tokens=12, stop=straddle)
            assert out.token_ids == ref
        pieces = [tok.decode([t]) for t in ref]
        stop = pieces[2][-1] + pieces[3][0]  # spans generated tokens 2 and 3
        end = next(k for k in range(1, 13) if stop in tok.decode(ref[:k]))
        assert env["text_dec"].generate(prompt, max_new_tokens=12, stop=stop).token_ids == ref[:end]


# -- sources whose state was built on another vocabulary ------------------------------------------------


def foreign_trie() -> FrequencyTrie:
    trie = FrequencyTrie(capacity=40, max_nodes=1000)
    for t in range(VOCAB):  # after every token of ours, tokens of a bigger vocabulary
        trie.insert([t, FOREIGN - 1 - t, FOREIGN - 2])
    return trie


def foreign_ngram() -> MultiLevelNGram:
    shared = MultiLevelNGram(shared=True, name="ngram-shared")
    stream = [x for t in range(VOCAB) for x in (t, FOREIGN - 1 - t)]
    shared.begin(Context(tuple(stream), len(stream), -1))
    shared.end(Context(tuple(stream), len(stream), -1))
    return shared


@pytest.mark.parametrize("make, name", [(foreign_trie, "trie"), (foreign_ngram, "ngram-shared")])
def test_a_source_built_on_another_vocabulary_is_named(model, make, name) -> None:
    source = make()
    dec = Decoder(model, sources=[PromptLookup(), source], max_tree_nodes=8, adaptive_budget=False)
    with pytest.raises(ValueError) as info:
        dec.generate([3, 4, 5], max_new_tokens=6)
    message = str(info.value)
    assert repr(name) in message and f"[0, {VOCAB})" in message and str(FOREIGN - 1 - 0)[:3] in message
    # nothing of the failed request is left running, and no prompt count of it stays
    assert live(source) == 0
    if isinstance(source, FrequencyTrie):
        assert all(prompt == 0 for _, prompt in source.snapshot().values())
        source.check_invariants()
    # the decoder itself is fine: with a clean source it serves the next request exactly
    dec.sources[1:] = []
    assert dec.generate([3, 4, 5], max_new_tokens=6).token_ids == reference_greedy(model, [3, 4, 5], 6)


@pytest.mark.parametrize("make", [foreign_trie, foreign_ngram], ids=["trie", "ngram-shared"])
def test_a_request_failing_mid_way_leaves_shared_state_exactly_as_it_was(model, make) -> None:
    source = make()
    sources = dict(prompt=PromptLookup(), trie=source if isinstance(source, FrequencyTrie) else FrequencyTrie(),
                   ngram=MultiLevelNGram(),
                   shared=source if isinstance(source, MultiLevelNGram) else MultiLevelNGram(shared=True),
                   jacobi=JacobiLookahead())
    dec = Decoder(model, sources=list(sources.values()), max_tree_nodes=8, adaptive_budget=False)
    before = snapshot(sources)
    with pytest.raises(ValueError):
        dec.generate([3, 4, 5], max_new_tokens=6)
    assert snapshot(sources) == before


# -- constructors and names ---------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, fragments", [
    ("bogus", ("'bogus'", "allowed: prompt", "trie")),
    ("trie,Trie", ("'Trie'", "allowed")),
    ("ngram[max_ngram=x]", ("max_ngram", "'x'", ">= 2")),
    ("ngram[max_ngram=1]", ("max_ngram", ">= 2", "1")),
    ("ngram[num_tokens=0]", ("num_tokens", ">= 1", "0")),
    ("ngram[max_contexts=many]", ("max_contexts", "'many'", ">= 1")),
    ("ngram[max_requests=-1]", ("max_requests", ">= 1", "-1")),
    ("prompt[num_tokens=x]", ("num_tokens", "'x'", ">= 1")),
    ("prompt[max_branches=1.5]", ("max_branches", "1.5", ">= 1")),
    ("prompt[min_ngram=4,max_ngram=2]", ("min_ngram=4", "max_ngram=2")),
    ("trie[prompt_weight=x]", ("prompt_weight", "'x'", ">= 1")),
    ("trie[prune_to=2]", ("prune_to", "[0, 1]", "2")),
    ("suffix[max_spec_factor=true]", ("max_spec_factor", "True", "> 0")),
    ("suffix[max_spec_offset=inf]", ("max_spec_offset", "inf", "finite")),
    ("suffix[min_token_prob=1.5]", ("min_token_prob", "1.5", "[0, 1]")),
    ("trie[capacity=0]", ("capacity", ">= 1", "0")),
    ("trie[max_nodes=1e9]", ("max_nodes", "1000000000.0", ">= 1")),
    ("trie[mode=flat]", ("mode", "'flat'", "hierarchical")),
    ("jacobi[window=0]", ("window", ">= 1", "0")),
    ("jacobi[ngram=2]", ("ngram", ">= 3", "2")),
    ("jacobi[advance=sideways]", ("advance", "'sideways'", "one")),
    ("trie[capacity=1,capacity=2]", ("capacity", "twice")),
    ("trie[bogus=1]", ("bogus",)),
])
def test_source_specs_name_the_bad_value_and_what_is_allowed(spec: str, fragments: tuple[str, ...]) -> None:
    with pytest.raises(SourceSpecError) as info:
        parse_source_names(spec)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"


@pytest.mark.parametrize("kwargs, fragments", [
    pytest.param(dict(attention="fast"), ("'fast'", "sdpa"), id="attention"),
    pytest.param(dict(max_tree_nodes=-3), ("max_tree_nodes", "-3"), id="max_tree_nodes negative"),
    pytest.param(dict(max_tree_nodes=10**8), ("max_tree_nodes", "100000000", "1024"), id="max_tree_nodes huge"),
    pytest.param(dict(sources=["trie"]), ("'trie'", "DraftSource"), id="source name instead of a source"),
    pytest.param(dict(compile=True), ("compile=True", "CUDA", "cpu"), id="compile on a CPU"),
    pytest.param(dict(compile="yes"), ("compile", "'yes'"), id="compile not a bool"),
    pytest.param(dict(compile=True, exact=True), ("exact=True", "compile=True", "exact=False"), id="compile and exact"),
])
def test_decoder_construction(model, kwargs, fragments) -> None:
    with pytest.raises((ValueError, TypeError)) as info:
        Decoder(model, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value)


# -- the command line -------------------------------------------------------------------------------------


def cli(capsys, argv: list[str]) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


PRELOAD_ROWS = [
    # (argv after the subcommand, fragments of the message)
    (["generate", "--prompt", "x", "--seed", "x"], ("--seed", "'x'")),
    (["generate", "--prompt", "x", "--max-new-tokens", "-5"], ("--max-new-tokens", ">= 1", "-5")),
    (["generate", "--prompt", "x", "--max-new-tokens", "1e3"], ("--max-new-tokens", "'1e3'")),
    (["generate", "--prompt", "x", "--max-tree-nodes", "1.5"], ("--max-tree-nodes", "'1.5'")),
    (["generate", "--prompt", "x", "--threads", "0"], ("--threads", ">= 1")),
    (["generate", "--prompt", "x", "--sample", "--top-k", "-1"], ("--top-k", ">= 0", "-1")),
    (["generate", "--prompt", "x", "--sample", "--top-p", "0"], ("--top-p", "> 0", "0")),
    (["generate", "--prompt", "x", "--sample", "--temperature", "inf"], ("--temperature", "finite", "inf")),
    (["generate", "--prompt", "x", "--repetition-penalty", "nan"], ("--repetition-penalty", "nan")),
    (["generate", "--prompt", "x", "--attention", "fast"], ("--attention", "'fast'", "sdpa")),
    (["generate", "--prompt", "x", "--sources", "trie,bogus"], ("'bogus'", "allowed: prompt")),
    (["generate", "--prompt", "x", "--sources", ""], ("at least one draft source",)),
    (["generate", "--prompt", "x", "--sources", "ngram[max_ngram=x]"], ("max_ngram", "'x'", ">= 2")),
    (["generate", "--prompt", "x", "--sources", "prompt[num_tokens=x]"], ("num_tokens", "'x'", ">= 1")),
    (["generate", "--prompt", "x", "--sources", "trie[prompt_weight=x]"], ("prompt_weight", "'x'")),
    (["generate", "--prompt", "x", "--sources", "jacobi[window=0]"], ("window", ">= 1")),
    (["generate", "--prompt", "x", "--sources", "trie["], ("unbalanced", "trie[")),
    (["generate", "--prompt", "x", "--compile", "--device", "cpu"], ("--compile", "CUDA", "--device cpu")),
    (["generate", "--prompt", "x", "--compile", "--exact"], ("--compile", "exact mode", "drop --exact")),
    (["bench", "--dataset", "humaneval", "--limit", "-1"], ("--limit", ">= 0", "-1")),
    (["bench", "--dataset", "humaneval", "--repeats", "0"], ("--repeats", ">= 1", "0")),
    (["bench", "--dataset", "humaneval", "--max-new-tokens", "0"], ("--max-new-tokens", ">= 1", "0")),
    (["bench", "--dataset", "humaneval", "--max-tree-nodes", "-3"], ("--max-tree-nodes", ">= 0", "-3")),
    (["bench", "--dataset", "humaneval", "--methods", "specdraft:bogus"], ("'specdraft:bogus'", "baseline")),
    (["bench", "--dataset", "humaneval", "--methods", "specdraft:ngram[max_ngram=x]"], ("max_ngram", "'x'")),
    (["bench", "--dataset", ""], ("--dataset", "humaneval")),
    (["bench", "--dataset", "humaneval,humaneval"], ("'humaneval'", "twice")),
]


@pytest.mark.usefixtures("offline_cache")
@pytest.mark.parametrize("argv, fragments", PRELOAD_ROWS, ids=[" ".join(a[:1] + a[-2:]) for a, _ in PRELOAD_ROWS])
def test_cli_refuses_bad_flags_before_loading_the_model(capsys, monkeypatch, tmp_path, argv, fragments) -> None:
    monkeypatch.setattr("specdraft.models.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.chdir(tmp_path)  # bench writes nothing, but if it did, not into the checkout
    code, err = cli(capsys, [argv[0], "--model", "some-model", *argv[1:]])
    assert code == 2 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in {err!r}"


@pytest.mark.usefixtures("offline_cache")
@pytest.mark.parametrize("words, max_new, fragments", [
    pytest.param(CONTEXT + 40, 3, (f"context of {CONTEXT}",), id="prompt beyond the context"),
    pytest.param(3, 100_000, ("max_new_tokens=100000", f"{CONTEXT}"), id="max-new-tokens beyond the context"),
    pytest.param(0, 3, ("empty",), id="empty prompt"),
])
def test_cli_generate_context_and_empty_prompts(capsys, tiny_dir, words, max_new, fragments) -> None:
    code, err = cli(capsys, ["generate", "--model", str(tiny_dir), "-q", "--prompt", " ".join(["a"] * words),
                             "--max-new-tokens", str(max_new)])
    assert code == 2 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err


@pytest.mark.usefixtures("offline_cache")
def test_cli_generate_prompt_just_inside_the_context(capsys, tiny_dir) -> None:
    code = main(["generate", "--model", str(tiny_dir), "-q", "--json", "--prompt", " ".join(["a"] * (CONTEXT - 4)),
                 "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert '"new_tokens": ' in out
