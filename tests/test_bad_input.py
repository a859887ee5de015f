"""Bad input fails early with a clear message; edge inputs (0 tokens, stop strings) behave exactly."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from specdraft import Decoder, PromptLookup, UnsupportedOptionError
from specdraft.model.runner import UnsupportedModelError
from specdraft.sources import Draft
from specdraft.stopping import StopRule

from conftest import VOCAB, OracleSource, RandomGuess, generation_config_override, reference_greedy, tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture
def dec(model):
    return Decoder(model, sources=[PromptLookup()], max_tree_nodes=8)


class LetterTokenizer:
    """A fake tokenizer: id i <-> a fixed string; ids 0..25 are single letters, a few are longer."""

    MULTI = {26: "xyz", 27: "ab", 28: " ", 29: "bc"}

    def piece(self, i: int) -> str:
        i = int(i)
        if i in self.MULTI:
            return self.MULTI[i]
        return chr(ord("a") + i % 26) if i < 26 else f"<{i}>"

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(self.piece(i) for i in ids)

    def __call__(self, text: str):
        inverse = {self.piece(i): i for i in range(26)}
        return {"input_ids": [inverse[c] for c in text]}


# -- prompts ---------------------------------------------------------------------------------------


def test_empty_prompt_list(dec) -> None:
    with pytest.raises(ValueError, match="empty"):
        dec.generate([], max_new_tokens=3)
    with pytest.raises(ValueError, match="empty"):
        dec.generate(torch.tensor([], dtype=torch.long), max_new_tokens=3)
    with pytest.raises(ValueError, match="empty"):
        dec.generate(np.zeros(0, dtype=np.int64), max_new_tokens=3)


def test_empty_string_prompt(model) -> None:
    with pytest.raises(ValueError, match="empty"):
        Decoder(model, tokenizer=LetterTokenizer()).generate("", max_new_tokens=3)
    # without a tokenizer a string (even empty) cannot be encoded at all
    with pytest.raises(ValueError, match="tokenizer"):
        Decoder(model).generate("", max_new_tokens=3)


def test_string_prompt_without_tokenizer(dec) -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        dec.generate("hello", max_new_tokens=3)


def test_string_prompt_with_tokenizer_matches_ids(model) -> None:
    tok = LetterTokenizer()
    dec = Decoder(model, tokenizer=tok)
    out = dec.generate("abcab", max_new_tokens=6)
    assert out.token_ids == reference_greedy(model, [0, 1, 2, 0, 1], 6)
    assert out.text == tok.decode(out.token_ids)


@pytest.mark.parametrize("bad", [[1, VOCAB], [VOCAB + 100], [-1, 3], [3, -5]])
def test_token_id_out_of_vocab(dec, bad) -> None:
    with pytest.raises(ValueError, match=rf"\[0, {VOCAB}\)") as info:
        dec.generate(bad, max_new_tokens=3)
    offending = [t for t in bad if not 0 <= t < VOCAB]
    assert str(offending[0]) in str(info.value)


def test_non_integer_token_ids(dec) -> None:
    with pytest.raises(ValueError, match="ints"):
        dec.generate([1.5, 2.0], max_new_tokens=3)
    with pytest.raises(ValueError, match="ints"):
        dec.generate(torch.tensor([1.0, 2.0]), max_new_tokens=3)


def test_unsupported_prompt_type(dec) -> None:
    with pytest.raises(TypeError, match="prompt must be"):
        dec.generate(42, max_new_tokens=3)


def test_batch_tensor(dec) -> None:
    with pytest.raises(ValueError, match=r"1-D.*\(2, 3\)|\(2, 3\).*1-D") as info:
        dec.generate(torch.tensor([[1, 2, 3], [4, 5, 6]]), max_new_tokens=3)
    assert "batch" in str(info.value)
    with pytest.raises(ValueError, match="1-D"):
        dec.generate(torch.ones(1, 2, 3, dtype=torch.long), max_new_tokens=3)


def test_single_row_batch_tensor_is_accepted(dec, model) -> None:
    assert dec.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4).token_ids == reference_greedy(model, [5, 6, 7], 4)


@pytest.mark.parametrize("batch", [[[1, 2, 3], [4, 5, 6]], np.array([[1, 2, 3], [4, 5, 6]])])
def test_batch_as_nested_list_is_refused(dec, batch) -> None:
    with pytest.raises(ValueError, match="1-D|batch"):
        dec.generate(batch, max_new_tokens=3)


def test_prompt_longer_than_context() -> None:
    model = tiny_model("llama")
    assert model.config.max_position_embeddings == 256
    dec = Decoder(model)
    with pytest.raises(ValueError, match="256") as info:
        dec.generate([3] * 300, max_new_tokens=1)
    assert "300" in str(info.value)
    # prompt fits but prompt + max_new_tokens does not
    with pytest.raises(ValueError, match="max_new_tokens=20"):
        dec.generate([3] * 250, max_new_tokens=20)
    gpt2 = tiny_model("gpt2")  # n_positions instead of max_position_embeddings
    with pytest.raises(ValueError, match="256"):
        Decoder(gpt2).generate([3] * 257, max_new_tokens=0)


def test_prompt_filling_the_context_exactly(model) -> None:
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, VOCAB, size=250)]
    out = Decoder(model, sources=[PromptLookup(), RandomGuess(1)]).generate(prompt, max_new_tokens=6).token_ids
    assert out == reference_greedy(model, prompt, 6)


# -- options ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, -100])
def test_negative_max_new_tokens(dec, bad) -> None:
    with pytest.raises(ValueError, match=rf"max_new_tokens.*>= 0.*{bad}"):
        dec.generate([1, 2], max_new_tokens=bad)


@pytest.mark.parametrize("bad", [1.5, "3", None])
def test_non_int_max_new_tokens(dec, bad) -> None:
    with pytest.raises((ValueError, TypeError), match="max_new_tokens"):
        dec.generate([1, 2], max_new_tokens=bad)


def test_zero_max_new_tokens(dec, model) -> None:
    out = dec.generate([1, 2, 3], max_new_tokens=0)
    assert out.token_ids == []
    assert out.stats.steps == 0 and out.stats.new_tokens == 0
    assert list(dec.stream([1, 2, 3], max_new_tokens=0)) == []
    # and the decoder still works afterwards
    assert dec.generate([1, 2, 3], max_new_tokens=3).token_ids == reference_greedy(model, [1, 2, 3], 3)


def test_unknown_option(dec) -> None:
    with pytest.raises(UnsupportedOptionError, match="foo") as info:
        dec.generate([1, 2], max_new_tokens=3, foo=1)
    assert "unknown" in str(info.value)
    assert "repetition_penalty" in str(info.value)  # lists what is supported
    with pytest.raises(UnsupportedOptionError, match="foo"):
        list(dec.stream([1, 2], max_new_tokens=3, foo=1))


@pytest.mark.parametrize("option", [dict(no_repeat_ngram_size=2), dict(num_beams=4), dict(typical_p=0.9),
                                    dict(min_new_tokens=3)])
def test_hf_option_not_supported(dec, option) -> None:
    (name,) = option
    with pytest.raises(UnsupportedOptionError, match=name) as info:
        dec.generate([1, 2], max_new_tokens=3, **option)
    assert "not supported" in str(info.value)


@pytest.mark.parametrize("option", [dict(top_k=5), dict(top_p=0.5), dict(temperature=0.7), dict(min_p=0.1)])
def test_sampling_only_option_with_greedy(dec, option) -> None:
    (name,) = option
    with pytest.raises(UnsupportedOptionError, match=name) as info:
        dec.generate([1, 2], max_new_tokens=3, **option)
    assert "do_sample" in str(info.value)
    with pytest.raises(UnsupportedOptionError, match=name):
        dec.generate([1, 2], max_new_tokens=3, do_sample=False, **option)


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_temperature_not_positive_with_sampling(dec, temperature) -> None:
    with pytest.raises(UnsupportedOptionError, match="temperature") as info:
        dec.generate([1, 2], max_new_tokens=3, do_sample=True, temperature=temperature)
    assert str(temperature) in str(info.value)


@pytest.mark.parametrize("option, name", [(dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
                                          (dict(top_k=-1), "top_k"), (dict(repetition_penalty=0.0), "repetition_penalty"),
                                          (dict(min_p=2.0), "min_p")])
def test_out_of_range_sampling_values(dec, option, name) -> None:
    with pytest.raises(UnsupportedOptionError, match=name):
        dec.generate([1, 2], max_new_tokens=3, do_sample=True, **option)


def test_model_generation_config_with_unsupported_field(model, dec) -> None:
    with generation_config_override(model, no_repeat_ngram_size=3):
        with pytest.raises(UnsupportedOptionError, match="no_repeat_ngram_size") as info:
            dec.generate([1, 2], max_new_tokens=3)
        assert "generation_config" in str(info.value) and "3" in str(info.value)
    with generation_config_override(model, num_beams=2):
        with pytest.raises(UnsupportedOptionError, match="num_beams"):
            dec.generate([1, 2], max_new_tokens=3)
    assert dec.generate([1, 2], max_new_tokens=3).token_ids == reference_greedy(model, [1, 2], 3)


def test_stop_strings_need_a_tokenizer(dec) -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        dec.generate([1, 2], max_new_tokens=3, stop="x")


# -- decoder construction --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 1.5, "8", True])
def test_bad_max_tree_nodes(model, bad) -> None:
    with pytest.raises(ValueError, match="max_tree_nodes") as info:
        Decoder(model, max_tree_nodes=bad)
    assert repr(bad) in str(info.value)


def test_max_tree_nodes_left_out_is_the_devices_default(model) -> None:
    from specdraft.decoder import default_max_tree_nodes

    assert Decoder(model).max_tree_nodes == Decoder(model, max_tree_nodes=None).max_tree_nodes == 32
    assert default_max_tree_nodes("cpu") == default_max_tree_nodes(None) == 32
    assert default_max_tree_nodes("cuda:0") == 63  # the widest captured width (64 rows) with its root


@pytest.mark.parametrize("bad", [object(), "prompt", PromptLookup, 3])
def test_not_a_draft_source(model, bad) -> None:
    with pytest.raises(TypeError, match="DraftSource"):
        Decoder(model, sources=[PromptLookup(), bad])


def test_too_many_sources(model) -> None:
    with pytest.raises(ValueError, match="62"):
        Decoder(model, sources=[PromptLookup() for _ in range(63)])


def test_base_model_without_lm_head() -> None:
    from transformers import AutoModel

    from conftest import _config

    base = AutoModel.from_config(_config("llama", {}))
    with pytest.raises(UnsupportedModelError, match="AutoModelForCausalLM") as info:
        Decoder(base)
    assert "LlamaModel" in str(info.value)


@pytest.mark.parametrize("kind", ["bart", "t5"])
def test_encoder_decoder_model(kind) -> None:
    from transformers import AutoModelForSeq2SeqLM, BartConfig, T5Config

    if kind == "bart":
        cfg = BartConfig(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                         decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, max_position_embeddings=64)
    else:
        cfg = T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=16, num_layers=1, num_heads=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForSeq2SeqLM.from_config(cfg)
    with pytest.raises(UnsupportedModelError, match="encoder-decoder") as info:
        Decoder(model)
    assert "AutoModelForCausalLM" in str(info.value)


def test_masked_lm_is_refused() -> None:
    from transformers import BertConfig, BertForMaskedLM

    model = BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=16, max_position_embeddings=64)).eval()
    assert not model.can_generate()
    with pytest.raises(UnsupportedModelError, match="BertForMaskedLM") as info:
        Decoder(model).generate([1, 2, 3], max_new_tokens=2)
    assert "AutoModelForCausalLM" in str(info.value)


# -- failures mid-request leave the decoder usable ---------------------------------------------------


class Exploding:
    name = "boom"

    def __init__(self, at: int) -> None:
        self.at, self.calls, self.ended = at, 0, 0

    def begin(self, context) -> None:
        pass

    def propose(self, context, budget):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("source exploded")
        return Draft(branches=[[context.root]])

    def observe(self, feedback) -> None:
        pass

    def end(self, context) -> None:
        self.ended += 1


def test_source_failure_ends_request_and_decoder_recovers(model) -> None:
    boom = Exploding(at=3)
    prompt = [4, 5, 6, 4, 5, 6, 4]
    with generation_config_override(model, eos_token_id=None):
        ref = reference_greedy(model, prompt, 12)
        dec = Decoder(model, sources=[PromptLookup(), boom, OracleSource(prompt + ref)], max_tree_nodes=3)
        with pytest.raises(RuntimeError, match="exploded"):
            dec.generate(prompt, max_new_tokens=12)
        assert boom.ended == 1
        assert dec.generate(prompt, max_new_tokens=12).token_ids == ref
        assert boom.ended == 2


def test_abandoned_stream_ends_request(model) -> None:
    boom = Exploding(at=-1)
    dec = Decoder(model, sources=[boom], max_tree_nodes=2)
    stream = dec.stream([4, 5, 6], max_new_tokens=10)
    next(stream)  # the prefill's token: the sources begin only before the first draft
    next(stream)
    stream.close()
    assert boom.ended == 1
    stream = dec.stream([4, 5, 6], max_new_tokens=10)
    next(stream)
    stream.close()  # closed after the first token: the sources never began, so nothing to end
    assert boom.ended == 1
    assert dec.generate([4, 5, 6], max_new_tokens=5).token_ids == reference_greedy(model, [4, 5, 6], 5)


# -- StopRule, with a fake tokenizer -------------------------------------------------------------------

A, B, C, D, E, X = 0, 1, 2, 3, 4, 23
EOS = 25  # "z"


def rule(stops=(), max_new=100, eos=(EOS,)):
    return StopRule(eos, max_new, list(stops), LetterTokenizer())


def test_stop_rule_no_stop() -> None:
    assert rule(["q"]).cut([A], [B, C, D]) == ([B, C, D], False)
    assert rule().cut([], [A]) == ([A], False)


def test_stop_string_spanning_two_tokens_of_one_step() -> None:
    assert rule(["bc"]).cut([A], [A, B, C, D, E]) == ([A, B, C], True)
    assert rule(["cde"]).cut([], [A, B, C, D, E]) == ([A, B, C, D, E], True)
    # inside a single multi-character token
    assert rule(["y"]).cut([A], [B, 26, C]) == ([B, 26], True)
    # the earliest of several stop strings wins, whichever is listed first
    assert rule(["de", "bc"]).cut([], [A, B, C, D, E]) == ([A, B, C], True)


def test_stop_string_straddling_previous_step() -> None:
    assert rule(["bc"]).cut([A, B], [C, D]) == ([C], True)
    assert rule(["abcd"]).cut([X, A, B], [C, D, E]) == ([C, D], True)
    # a multi-character token in the previous step supplies the start of the stop string
    assert rule(["bcd"]).cut([A, 27], [C, D, E]) == ([C, D], True)
    # longer generated text: only the tail matters
    assert rule(["ab"]).cut([X] * 50 + [A], [B]) == ([B], True)


def test_stop_string_already_in_the_prompt_or_far_back_does_not_fire_again() -> None:
    # "bc" occurred long ago (it would have stopped then, unless it was in the prompt, which
    # is not part of `generated`); nothing new completes it now
    assert rule(["bc"], max_new=100).cut([], [X, X]) == ([X, X], False)


def test_eos_before_stop_string() -> None:
    assert rule(["bc"]).cut([], [A, EOS, B, C]) == ([A, EOS], True)
    assert rule(["bc"]).cut([B], [EOS, C]) == ([EOS], True)


def test_stop_string_before_eos() -> None:
    assert rule(["bc"]).cut([], [B, C, EOS]) == ([B, C], True)
    assert rule(["bc"]).cut([], [B, C, D, EOS]) == ([B, C], True)


def test_several_eos_ids() -> None:
    r = rule(eos=(D, EOS))
    assert r.cut([], [A, B, D, EOS]) == ([A, B, D], True)
    assert r.cut([], [A, EOS, D]) == ([A, EOS], True)


def test_max_new_tokens_cut() -> None:
    assert rule(max_new=5).cut([A, A, A], [B, C, D, E]) == ([B, C], True)
    assert rule(max_new=5).cut([A, A, A], [B]) == ([B], False)
    assert rule(max_new=5).cut([A, A, A, A], [B, C]) == ([B], True)
    # a stop string or an EOS completed only beyond the limit does not matter
    assert rule(["bcd"], max_new=5).cut([A, A, A], [B, C, D]) == ([B, C], True)
    assert rule(max_new=2).cut([A], [B, EOS]) == ([B], True)
    # the limit and a stop string hit on the same token
    assert rule(["bc"], max_new=3).cut([A], [B, C, D]) == ([B, C], True)


def test_stop_rule_validation() -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        StopRule([EOS], 10, ["x"], None)
    with pytest.raises(ValueError, match="non-empty"):
        StopRule([EOS], 10, [""], LetterTokenizer())


def _first_stop(text_of, tokens, stops):
    for m in range(1, len(tokens) + 1):
        if any(s in text_of(tokens[:m]) for s in stops):
            return m
    return None


@pytest.mark.parametrize("budget", [0, 4, 16])
def test_decoder_stop_strings_end_to_end(model, budget) -> None:
    """With a tokenizer, ``stop=`` cuts the greedy output right after the first stop-string completion,
    however the step boundaries fall (drafts from the oracle run straight past the stop string)."""
    tok = LetterTokenizer()
    prompt = [5, 6, 7, 5, 6, 7, 8]
    with generation_config_override(model, eos_token_id=None):
        ref = reference_greedy(model, prompt, 30)
        for start in (0, 3, 9, 20):
            stop = tok.decode(ref[start:start + 3])[1:4]  # straddles token boundaries when pieces are long
            if not stop:
                continue
            m = _first_stop(tok.decode, ref, [stop])
            assert m is not None
            dec = Decoder(model, tokenizer=tok, sources=[OracleSource(prompt + ref), PromptLookup()],
                          max_tree_nodes=budget)
            out = dec.generate(prompt, max_new_tokens=30, stop=stop)
            assert out.token_ids == ref[:m], (stop, m)
            assert "".join(dec.stream(prompt, max_new_tokens=30, stop=[stop, "\x00"])) == tok.decode(ref[:m])


class OutOfVocab:
    name = "oov"

    def begin(self, context) -> None:
        pass

    def end(self, context) -> None:
        pass

    def observe(self, feedback) -> None:
        pass

    def propose(self, context, budget):
        return Draft(branches=[[VOCAB + 5], [context.root]])


def test_out_of_vocab_draft_is_dropped_or_named(model) -> None:
    dec = Decoder(model, sources=[OutOfVocab(), PromptLookup()])
    try:
        out = dec.generate([5, 6, 5], max_new_tokens=4)
    except ValueError as exc:
        assert "oov" in str(exc)
        return
    assert out.token_ids == reference_greedy(model, [5, 6, 5], 4)
