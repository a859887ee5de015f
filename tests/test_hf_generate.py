"""specdraft inside ``model.generate`` (``specdraft.hf``): the same outputs as ``generate`` itself.

Every check compares against transformers' own ``generate`` on the same inputs, on tiny random
float32 models (the precision the exactness promise is made in):

- greedy output, token for token, for batches of 1-3 left-padded prompts, with EOS ids that stop
  rows mid-run, ``min_new_tokens``, a repetition penalty, a pad token, draft sources that are
  right (oracles that draft past EOS and the limit), wrong, or the defaults (hypothesis);
- sampling: one prompt fed the same random stream gives the very tokens ``generate`` samples
  (temperature, top-k, top-p, min-p, repetition penalty, and transformers' defaults); in a padded
  batch each row keeps the plain-sampling law (chi-square against the law enumerated from
  ``generate``'s own scores, float64);
- stop strings, a stateful custom stopping criterion (called with the very ``input_ids``
  ``generate`` calls it with, in the same order), the streamer (the same ``put`` calls), the
  return types, pipelines, and the ``custom_generate/`` folder loaded from a local path;
- every generation option that cannot be applied exactly raises ``UnsupportedOptionError``
  naming it.

On transformers releases before 5.x the same file runs (``scripts/run_tests.sh`` runs it on the
oldest declared release); the one behaviour that differs there (the repetition penalty counts
the padding of left-padded rows, which the decoder cannot reproduce) must raise.
"""

from __future__ import annotations

import functools
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, LlamaConfig, StoppingCriteria, pipeline
from transformers.generation import GenerateDecoderOnlyOutput
from transformers.generation.logits_process import (LogitsProcessor, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

import specdraft.hf
from specdraft import PromptLookup, UnsupportedOptionError

from conftest import FAST, Oracles, RandomGuess, _config, generation_config_override
import test_sampling_stats as law_test

ROOT = Path(__file__).resolve().parent.parent


def _penalty_skips_padding() -> bool:
    """Whether the installed transformers' generate skips a left-padded row's padding in its
    repetition penalty (5.x); older releases penalise the padding tokens too."""
    from transformers import GPT2Config

    seen: list[Any] = []

    def probe(model, input_ids, logits_processor=None, **kwargs):
        seen.extend(p for p in logits_processor if isinstance(p, RepetitionPenaltyLogitsProcessor))
        return input_ids

    model = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=8, n_embd=8, n_layer=1, n_head=1, n_positions=16))
    model.generate(input_ids=torch.tensor([[0, 3], [4, 5]]), attention_mask=torch.tensor([[0, 1], [1, 1]]),
                   max_new_tokens=1, repetition_penalty=1.5, pad_token_id=0, custom_generate=probe)
    return isinstance(getattr(seen[0], "prompt_ignore_length", None), torch.Tensor)


PENALTY_SKIPS_PADDING = _penalty_skips_padding()

#: Whether the installed transformers hands a ``custom_generate`` callable its streamer and builds
#: stop strings for it (4.x does; 5.x drops both, which ``specdraft.hf.generate`` works around).
CALLABLE_GETS_STREAMER = not hasattr(
    __import__("transformers.generation.utils", fromlist=["GenerationMixin"]).GenerationMixin,
    "_extract_generation_mode_kwargs")


# -- models ------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def float32_model(arch: str, attn: str = "sdpa"):
    """conftest's tiny ``arch`` (vocabulary 80, EOS 2), in float32: the precision the promise is made in."""
    torch.manual_seed(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(_config(arch, {}), attn_implementation=attn, dtype=torch.float32)
    return model.eval()


@functools.lru_cache(maxsize=None)
def byte_tokenizer():
    """A byte-level BPE tokenizer trained here on a few lines (transformers' stop strings need a
    tokenizer whose tokens decode to their own text, as GPT-2's and Qwen's do)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = ["def add(a, b):\n    return a + b\n", "the cat sat on the mat. the dog sat on the log.",
              "for i in range(10):\n    print(i)\n"] * 20
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   padding_side="left", model_input_names=["input_ids", "attention_mask"])


@functools.lru_cache(maxsize=None)
def text_model():
    """A tiny float32 Llama over :func:`byte_tokenizer`'s vocabulary (pad 0, BOS 1, EOS 2)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(byte_tokenizer()), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def batch_of(prompts: Sequence[Sequence[int]], pad: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded ``input_ids`` and ``attention_mask``, as a tokenizer with padding_side='left' gives."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return {"input_ids": ids, "attention_mask": mask}


def plain(model, **kwargs) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(**kwargs)


# -- greedy: token for token ---------------------------------------------------------------


prompt_lists = st.lists(st.lists(st.integers(3, 79), min_size=1, max_size=12), min_size=1, max_size=3)


@FAST
@given(arch=st.sampled_from([("llama", "sdpa"), ("qwen2_swa", "sdpa"), ("mistral", "eager"), ("gpt2", "sdpa")]),
       prompts=prompt_lists,
       new=st.integers(1, 24), stop_at=st.none() | st.integers(0, 23), min_new=st.none() | st.integers(1, 8),
       penalty=st.sampled_from([None, 1.3]), pad=st.sampled_from([None, 0]),
       sources=st.sampled_from(["oracle", "random", "prompt", "default"]), nodes=st.sampled_from([0, 4, 16]))
def test_greedy_equals_generate(arch, prompts, new, stop_at, min_new, penalty, pad, sources, nodes):
    model = float32_model(*arch)
    inputs = batch_of(prompts, pad=0)
    unstopped = plain(model, **inputs, max_new_tokens=new + 8, do_sample=False, eos_token_id=None,
                      pad_token_id=0)[:, inputs["input_ids"].shape[1]:].tolist()
    options: dict[str, Any] = dict(max_new_tokens=new, do_sample=False)
    if stop_at is not None:  # a token the first row really generates becomes an extra EOS id
        options["eos_token_id"] = [2, unstopped[0][min(stop_at, len(unstopped[0]) - 1)]]
    if min_new is not None:
        options["min_new_tokens"] = min_new
    if penalty is not None:
        options["repetition_penalty"] = penalty
    if pad is not None:
        options["pad_token_id"] = pad
    source_list = {"oracle": lambda: [Oracles([p + u for p, u in zip(prompts, unstopped)])],
                   "random": lambda: [RandomGuess(seed=len(prompts))], "prompt": lambda: [PromptLookup()],
                   "default": lambda: None}[sources]()
    loop = specdraft.hf.loop(sources=source_list, max_tree_nodes=nodes)
    expected = plain(model, **inputs, **options)
    padded = len({len(p) for p in prompts}) > 1
    if penalty is not None and padded and not PENALTY_SKIPS_PADDING:
        with pytest.raises(UnsupportedOptionError, match="RepetitionPenaltyLogitsProcessor"):
            model.generate(**inputs, **options, custom_generate=loop)
        return
    got = model.generate(**inputs, **options, custom_generate=loop)
    assert got.tolist() == expected.tolist()


def test_greedy_reuses_the_decoder_and_its_sources():
    model = float32_model("llama")
    loop = specdraft.hf.loop(sources=[PromptLookup()], max_tree_nodes=8)
    inputs = batch_of([[5, 6, 7, 5, 6, 7, 5, 6]])
    first = model.generate(**inputs, max_new_tokens=12, do_sample=False, custom_generate=loop)
    decoder = loop.decoder(model)
    second = model.generate(**inputs, max_new_tokens=12, do_sample=False, custom_generate=loop)
    assert loop.decoder(model) is decoder
    assert first.tolist() == second.tolist() == plain(model, **inputs, max_new_tokens=12, do_sample=False).tolist()
    assert loop.last_stats[0].new_tokens == 12


def test_min_new_tokens_where_eos_would_come_first():
    """The first generated token is made the EOS id: generate must skip it for min_new_tokens
    positions, and so must the loop (its first tokens come from generate itself)."""
    model = float32_model("qwen2")
    inputs = batch_of([[5, 9, 11, 5, 9], [7, 3]])
    first = plain(model, **inputs, max_new_tokens=1, do_sample=False)[:, -1].tolist()
    options = dict(max_new_tokens=16, do_sample=False, eos_token_id=[2, *first], min_new_tokens=4)
    got = model.generate(**inputs, **options, custom_generate=specdraft.hf.loop(max_tree_nodes=8))
    assert got.tolist() == plain(model, **inputs, **options).tolist()
    assert got.shape[1] - inputs["input_ids"].shape[1] >= 4


def test_model_config_the_decoder_would_refuse():
    """A model whose generation_config sets options the decoder refuses on its own
    (min_new_tokens, here) still decodes: the loop applies what generate built from it."""
    model = float32_model("llama")
    inputs = batch_of([[5, 6, 7, 8]])
    with generation_config_override(model, min_new_tokens=3, repetition_penalty=1.2):
        expected = plain(model, **inputs, max_new_tokens=10, do_sample=False)
        got = model.generate(**inputs, max_new_tokens=10, do_sample=False,
                             custom_generate=specdraft.hf.loop(max_tree_nodes=8))
        assert model.generation_config.min_new_tokens == 3  # left as it was
    assert got.tolist() == expected.tolist()


def test_a_compiled_loop_on_a_cpu_model_says_compiling_is_for_cuda():
    model = float32_model("llama")
    inputs = batch_of([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match="compile=True .* CUDA GPU .* cpu"):
        model.generate(**inputs, max_new_tokens=4, do_sample=False, custom_generate=specdraft.hf.loop(compile=True))


def test_return_dict_in_generate():
    model = float32_model("llama")
    inputs = batch_of([[5, 6, 7], [9, 10, 11, 12]])
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
                         custom_generate=specdraft.hf.loop(max_tree_nodes=4))
    assert isinstance(out, GenerateDecoderOnlyOutput)
    assert out.scores is None and out.logits is None
    assert out.sequences.tolist() == plain(model, **inputs, max_new_tokens=6, do_sample=False).tolist()


# -- sampling -------------------------------------------------------------------------------------


SAMPLING = [dict(temperature=0.8, top_k=10, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
            dict(temperature=1.3, top_p=0.7), dict(top_k=0, min_p=0.1), dict()]


@pytest.mark.parametrize("options", SAMPLING, ids=lambda o: ",".join(o) or "defaults")
def test_sampling_follows_generates_random_stream(options):
    """One prompt, the same torch seed: the loop makes one multinomial draw per committed token
    from the same processed probabilities as generate, so it samples the very same tokens."""
    model = float32_model("llama")
    inputs = batch_of([[5, 6, 7, 5, 6, 7, 5]])
    loop = specdraft.hf.loop(sources=[PromptLookup()], max_tree_nodes=8)
    for seed in range(3):
        torch.manual_seed(seed)
        expected = plain(model, **inputs, max_new_tokens=20, do_sample=True, **options)
        torch.manual_seed(seed)
        got = model.generate(**inputs, max_new_tokens=20, do_sample=True, custom_generate=loop, **options)
        assert got.tolist() == expected.tolist()


def test_num_return_sequences_when_sampling():
    model = float32_model("llama")
    inputs = batch_of([[5, 6, 7], [9, 10, 11, 12]])
    out = model.generate(**inputs, max_new_tokens=5, do_sample=True, num_return_sequences=3,
                         custom_generate=specdraft.hf.loop(max_tree_nodes=4))
    assert out.shape == (6, 4 + 5)
    assert out[:3, :4].tolist() == [inputs["input_ids"][0].tolist()] * 3


LAW_PROMPTS = [[1, 2, 3, 1, 2, 3], [4, 5]]
LAW_SETTING = dict(temperature=0.9, top_k=7, top_p=0.95, repetition_penalty=1.3)


@functools.lru_cache(maxsize=None)
def law_model():
    """The sampling-law suite's tiny peaked float64 Llama (no EOS), built once here."""
    return law_test.law_model()


def test_batched_sampling_keeps_each_rows_law():
    """Two left-padded prompts per call: each row's first two tokens follow the law generate
    samples them from, alone (chi-square, fixed seed)."""
    if not PENALTY_SKIPS_PADDING:
        pytest.skip("transformers before 5.x penalises padding: refused, tested below")
    model = law_model()
    new, n = 2, 300
    inputs = batch_of(LAW_PROMPTS, pad=0)
    loop = specdraft.hf.loop(sources=[PromptLookup()], max_tree_nodes=6)
    counts = [Counter(), Counter()]
    torch.manual_seed(1234)
    for _ in range(n):
        out = model.generate(**inputs, max_new_tokens=new, do_sample=True, pad_token_id=0, custom_generate=loop,
                             **LAW_SETTING)
        for row in range(2):
            counts[row][tuple(out[row, -new:].tolist())] += 1
    for row, prompt in enumerate(LAW_PROMPTS):
        pvalue, _, impossible = law_test.chi_square(counts[row], law_test.ExactLaw(model, LAW_SETTING, prompt, new))
        assert impossible == 0, "a sequence the law forbids"
        assert pvalue > law_test.P_THRESHOLD


def test_batched_sampling_on_old_transformers_refuses_padding_penalty():
    if PENALTY_SKIPS_PADDING:
        pytest.skip("this transformers skips the padding in its repetition penalty")
    with pytest.raises(UnsupportedOptionError, match="penalises the padding"):
        law_model().generate(**batch_of(LAW_PROMPTS), max_new_tokens=2, do_sample=True, pad_token_id=0,
                             custom_generate=specdraft.hf.loop(), **LAW_SETTING)


# -- stopping, streaming ------------------------------------------------------------------------------


def _clean_stop_string(tokens: Sequence[int], start: int) -> tuple[str, int]:
    """A stop string that first appears at or after ``start``: the text of one generated token
    made of plain ASCII letters or punctuation (random models emit many byte fragments)."""
    tok = byte_tokenizer()
    for i in range(start, len(tokens)):
        text = tok.decode(tokens[i:i + 1])
        earlier = tok.decode(list(tokens[:i]))
        if text.strip() and text.isascii() and text.isprintable() and text not in earlier:
            return text, i
    raise AssertionError("no usable stop string in the reference output")


@pytest.mark.parametrize("route", ["generate", "folder", "callable"])
def test_stop_strings(route):
    model, tok = text_model(), byte_tokenizer()
    inputs = tok(["the cat sat on the", "def add(a, b):"], return_tensors="pt", padding=True)
    width = inputs["input_ids"].shape[1]
    free = plain(model, **inputs, max_new_tokens=24, do_sample=False)[0, width:].tolist()
    stop, at = _clean_stop_string(free, 3)
    options = dict(max_new_tokens=24, do_sample=False, stop_strings=[stop], tokenizer=tok)
    expected = plain(model, **inputs, **options)
    assert expected.shape[1] < width + 24 or expected[0, width + at + 1:].eq(0).all()  # the stop string fired
    loop = specdraft.hf.loop(max_tree_nodes=8)
    if route == "generate":
        got = specdraft.hf.generate(model, **inputs, **options, specdraft_loop=loop)
    elif route == "folder":
        got = model.generate(**inputs, **options, custom_generate=str(ROOT), trust_remote_code=True)
    elif CALLABLE_GETS_STREAMER:
        got = model.generate(**inputs, **options, custom_generate=loop)
    else:
        with pytest.raises(ValueError, match="tokenizer"):  # transformers 5.x keeps the tokenizer from callables
            model.generate(**inputs, **options, custom_generate=loop)
        return
    assert got.tolist() == expected.tolist()


class CallLog(StoppingCriteria):
    """Stops a row when its last token is ``token`` and the row is at least ``length`` long; logs
    every call (stateful on purpose: it must be called exactly as generate calls it)."""

    def __init__(self, token: int, length: int) -> None:
        self.token, self.length, self.calls = token, length, []

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        self.calls.append(input_ids.tolist())
        return (input_ids[:, -1] == self.token) & torch.tensor(input_ids.shape[1] >= self.length)


@pytest.mark.parametrize("eos", [True, False], ids=["with-eos", "no-eos"])
def test_custom_stopping_criterion_is_called_like_generate(eos):
    """Batch of three, the criterion ends one row early: generate pads that row (with an EOS
    criterion) or lets it run on (without one); either way the criterion sees the same input_ids
    in the same calls, and the outputs agree."""
    model = float32_model("llama")
    prompts = [[5, 6, 7, 5, 6, 7], [9, 10, 11], [20, 21, 22, 23]]
    inputs = batch_of(prompts)
    free = plain(model, **inputs, max_new_tokens=14, do_sample=False, eos_token_id=None, pad_token_id=0)
    width = inputs["input_ids"].shape[1]
    token = int(free[1, width + 6])  # row 1 ends at its 7th new token, inside an accepted run of drafts
    options = dict(max_new_tokens=14, do_sample=False, pad_token_id=0, eos_token_id=2 if eos else None)
    theirs, ours = CallLog(token, width + 7), CallLog(token, width + 7)
    expected = plain(model, **inputs, **options, stopping_criteria=[theirs])
    assert expected.shape[1] == width + 14 and (expected[1, width + 7:] == 0).all() == eos
    sequences = [p + f for p, f in zip(prompts, free[:, width:].tolist())]
    got = model.generate(**inputs, **options, stopping_criteria=[ours],
                         custom_generate=specdraft.hf.loop(sources=[Oracles(sequences)], max_tree_nodes=8))
    assert got.tolist() == expected.tolist()
    assert ours.calls == theirs.calls


def test_a_criterion_that_reads_scores_is_refused():
    class NeedsScores(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return scores.max(dim=-1).values > 100

    model = float32_model("llama")
    with pytest.raises(UnsupportedOptionError, match=r"NeedsScores.*scores=None"):
        model.generate(**batch_of([[5, 6, 7]]), max_new_tokens=4, do_sample=False, stopping_criteria=[NeedsScores()],
                       custom_generate=specdraft.hf.loop())


class Recorder:
    """A streamer that keeps every ``put`` (as a list) and ``end``."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def put(self, value: torch.Tensor) -> None:
        self.items.append(value.tolist())

    def end(self) -> None:
        self.items.append("end")


@pytest.mark.parametrize("prompts", [[[5, 6, 7, 5, 6]], [[5, 6, 7, 5, 6], [9, 10]]], ids=["one", "two"])
def test_streamer_gets_what_generate_gives(prompts):
    model = float32_model("llama")
    inputs = batch_of(prompts)
    first = plain(model, **inputs, max_new_tokens=1, do_sample=False)[0, -1].item()
    options = dict(max_new_tokens=10, do_sample=False, eos_token_id=[2, first] if len(prompts) > 1 else 2)
    theirs, ours = Recorder(), Recorder()
    plain(model, **inputs, **options, streamer=theirs)
    specdraft.hf.generate(model, **inputs, **options, streamer=ours, specdraft_loop=specdraft.hf.loop(max_tree_nodes=8))
    assert ours.items == theirs.items
    if CALLABLE_GETS_STREAMER:  # transformers hands the callable its streamer
        direct = Recorder()
        model.generate(**inputs, **options, streamer=direct, custom_generate=specdraft.hf.loop(max_tree_nodes=8))
        assert direct.items == theirs.items


# -- pipelines and the folder ----------------------------------------------------------------------


def test_pipeline():
    model, tok = text_model(), byte_tokenizer()
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    texts = ["the cat sat on the", "def add(a, b):"]
    options = dict(do_sample=False, max_new_tokens=12)
    loop = specdraft.hf.loop(max_tree_nodes=8)
    assert pipe(texts[0], **options, custom_generate=loop) == pipe(texts[0], **options)
    assert pipe(texts, batch_size=2, **options, custom_generate=loop) == pipe(texts, batch_size=2, **options)
    assert (pipe(texts[0], **options, custom_generate=str(ROOT), trust_remote_code=True)
            == pipe(texts[0], **options))


def test_folder_has_the_layout_transformers_loads():
    folder = ROOT / "custom_generate"
    assert (folder / "generate.py").is_file()
    requirements = (folder / "requirements.txt").read_text().split()
    assert any(r.startswith("specdraft") for r in requirements)
    assert any(r.startswith("transformers") for r in requirements)
    model = float32_model("llama")
    inputs = batch_of([[5, 6, 7], [9, 10, 11, 12]])
    got = model.generate(**inputs, max_new_tokens=8, do_sample=False, custom_generate=str(ROOT),
                         trust_remote_code=True, specdraft_loop=specdraft.hf.loop(max_tree_nodes=4))
    assert got.tolist() == plain(model, **inputs, max_new_tokens=8, do_sample=False).tolist()


# -- what is refused ---------------------------------------------------------------------------------


class Shift(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores + 1.0


REFUSED: list[tuple[dict[str, Any], str]] = [
    (dict(num_beams=2), "num_beams"),
    (dict(return_dict_in_generate=True, output_scores=True), "output_scores"),
    (dict(return_dict_in_generate=True, output_logits=True), "output_logits"),
    (dict(return_dict_in_generate=True, output_hidden_states=True), "output_hidden_states"),
    (dict(no_repeat_ngram_size=2), "NoRepeatNGramLogitsProcessor"),
    (dict(do_sample=True, typical_p=0.5), "TypicalLogitsWarper"),
    (dict(do_sample=True, epsilon_cutoff=0.1), "EpsilonLogitsWarper"),
    (dict(do_sample=True, eta_cutoff=0.1), "EtaLogitsWarper"),
    (dict(sequence_bias={(5,): 1.0}), "SequenceBiasLogitsProcessor"),
    (dict(bad_words_ids=[[5]]), "NoBadWordsLogitsProcessor"),
    (dict(suppress_tokens=[5]), "SuppressTokensLogitsProcessor"),
    (dict(begin_suppress_tokens=[5]), "SuppressTokensAtBeginLogitsProcessor"),
    (dict(forced_eos_token_id=2), "ForcedEOSTokenLogitsProcessor"),
    (dict(forced_bos_token_id=1), "ForcedBOSTokenLogitsProcessor"),
    (dict(exponential_decay_length_penalty=(2, 1.5)), "ExponentialDecayLengthPenalty"),
    (dict(renormalize_logits=True), "LogitNormalization"),
    (dict(remove_invalid_values=True), "InfNanRemoveLogitsProcessor"),
    (dict(guidance_scale=1.5), "ClassifierFreeGuidance"),
    (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
    (dict(penalty_alpha=0.5, top_k=4), "penalty_alpha"),
    (dict(prefix_allowed_tokens_fn=lambda batch, ids: [5, 6]), "PrefixConstrainedLogitsProcessor"),
    (dict(logits_processor=[Shift()]), "Shift"),
    (dict(logits_processor=[TopKLogitsWarper(5)]), "do_sample=False"),
    (dict(do_sample=True, top_k=None, logits_processor=[TopPLogitsWarper(0.9), TemperatureLogitsWarper(0.5)]),
     "TemperatureLogitsWarper comes after TopPLogitsWarper"),
    (dict(do_sample=True, logits_processor=[TopPLogitsWarper(0.9, min_tokens_to_keep=3)]), "min_tokens_to_keep=3"),
    (dict(do_sample=True, min_new_tokens=2, logits_processor=[RepetitionPenaltyLogitsProcessor(1.5)]),
     "min_new_tokens"),
    (dict(attention_mask=torch.tensor([[1, 1, 0]])), "only left padding"),
    (dict(attention_mask=torch.tensor([[0, 0, 0]])), "all padding"),
]


@pytest.mark.parametrize("options,named", REFUSED, ids=[named for _, named in REFUSED])
def test_refused_options_name_themselves(options, named):
    model = float32_model("llama")
    options = dict(options)
    inputs = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": options.pop("attention_mask", None)}
    if inputs["attention_mask"] is None:
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(UnsupportedOptionError, match=named):
            model.generate(**inputs, max_new_tokens=4, custom_generate=specdraft.hf.loop(), **options)


#: Options that select another decoding method, set on a config directly (generate itself may refuse
#: some of them before the loop runs): (option, value, refused by the loop).
METHOD_OPTIONS = [("num_beam_groups", 2, True), ("dola_layers", "high", True), ("assistant_early_exit", 2, True),
                  ("num_return_sequences", 2, True), ("cache_implementation", "offloaded", True),
                  ("cache_implementation", "static", False), ("penalty_alpha", 0.5, False)]


@pytest.mark.parametrize("option,value,refused", METHOD_OPTIONS)
def test_decoding_method_options_are_read_from_the_config(option, value, refused):
    from types import SimpleNamespace

    from transformers import GenerationConfig

    config = GenerationConfig()
    config.top_k = 1  # penalty_alpha selects contrastive search only with top_k > 1
    setattr(config, option, value)
    check = functools.partial(specdraft.hf._check_config, config, SimpleNamespace(config=SimpleNamespace()))
    if not refused:
        check()
        return
    with pytest.raises(UnsupportedOptionError, match=f"^{option}={value!r} is not supported by specdraft.hf: "):
        check()


def test_refused_by_the_generate_replacement():
    model = float32_model("llama")
    inputs = batch_of([[5, 6, 7]])
    with pytest.raises(UnsupportedOptionError, match="assistant_model"):
        specdraft.hf.generate(model, **inputs, max_new_tokens=4, assistant_model=model)
    with pytest.raises(ValueError, match="tokenizer"):
        specdraft.hf.generate(model, **inputs, max_new_tokens=4, stop_strings=["a"])
    with pytest.raises(TypeError, match="specdraft_loop"):
        specdraft.hf.generate(model, **inputs, max_new_tokens=4, specdraft_loop="fast")


def test_bad_loop_options_fail_at_once():
    with pytest.raises(ValueError, match="max_tree_nodes"):
        specdraft.hf.loop(max_tree_nodes=-1)
    with pytest.raises(ValueError, match="compile must be True or False, got 'yes'"):
        specdraft.hf.loop(compile="yes")


def test_a_transformers_without_custom_generate_gets_a_clear_error(monkeypatch):
    """Every release pyproject.toml declares has generate(custom_generate=...); one without it
    (older, or a future one that drops it) must fail at loop() with what to do, not deep in generate."""

    class OldMixin:
        def generate(self, inputs=None, generation_config=None, **kwargs):
            raise AssertionError("never called")

    monkeypatch.setattr(specdraft.hf, "GenerationMixin", OldMixin)
    with pytest.raises(ImportError, match=r"custom_generate=.*Upgrade transformers, or use specdraft.Decoder"):
        specdraft.hf.loop()
