"""The decoder on a simulated CUDA device: no tensor on the wrong device, one read and one upload per step.

No machine of the default suite has a GPU, so :class:`~specdraft.simulated_device.SimulatedDevice`
makes a tiny model's parameters (and everything computed from them, and every factory call "on
cuda") report a CUDA device while computing on the CPU. Mixing them with CPU tensors of rank >= 1
or a CPU generator raises as CUDA does; reads of device values (syncs) and host-to-device copies
(uploads) outside the model's forward are counted. The decoder runs end to end on it: greedy and
sampling (seed, temperature, top-k, top-p, min-p, repetition penalty), every source alone and the
default mix, sdpa and eager, and sliding-window and GPT-2 models. Every step must read the device
exactly once and upload at most once, and the outputs must be those of the CPU.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from conftest import reference_greedy, tiny_model
from specdraft import Decoder
from specdraft.kernels.exact_rows import load_or_probe
from specdraft.simulated_device import DeviceMixError, SimulatedDevice
from specdraft.sources.registry import DEFAULT_SOURCES, GPU_DEFAULT_SOURCES, SOURCES, make_sources

PROMPT = [1, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 5, 6, 7]
NEW = 14
SAMPLING = dict(do_sample=True, seed=3, temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.2)
#: every source alone, and the default mixes (the CPU's and the GPU's)
MIXES = {name: [name] for name in SOURCES} | {"default": list(DEFAULT_SOURCES),
                                              "gpu-default": list(GPU_DEFAULT_SOURCES)}


@functools.lru_cache(maxsize=None)
def simulated(arch: str, attn: str) -> tuple[torch.nn.Module, SimulatedDevice]:
    """A private copy of the shared tiny model, moved onto a simulated device of its own."""
    model = copy.deepcopy(tiny_model(arch, attn))
    sim = SimulatedDevice()
    sim.adopt(model)
    return model, sim


def run(arch: str, attn: str, sources: list[str], **options):
    """Decode on the simulated device; returns (output, syncs, uploads) outside the forward."""
    model, sim = simulated(arch, attn)
    sim.reset_counts()
    with sim, sim.patched_generator():
        dec = Decoder(model, None, sources=make_sources(sources), max_tree_nodes=12, adaptive_budget=False)
        out = dec.generate(PROMPT, max_new_tokens=NEW, **options)
    return out, sim.counts


# -- the harness itself ----------------------------------------------------------------------------


def test_the_harness_raises_where_cuda_would_and_counts_reads_and_uploads() -> None:
    sim = SimulatedDevice()
    with sim, sim.patched_generator():
        on_device = torch.ones(4, device="cuda")
        assert on_device.device.type == "cuda" and (on_device * 2).device.type == "cuda"
        assert sim.counts.uploads == 0  # a factory call fills memory on the device: no copy
        with pytest.raises(DeviceMixError, match="CPU tensors"):
            on_device + torch.ones(4)  # a CPU tensor of rank 1
        on_device + torch.tensor(1.0)  # a CPU scalar is fine on CUDA too
        with pytest.raises(DeviceMixError, match="generator"):
            torch.multinomial(on_device, 1, generator=torch.Generator())
        torch.multinomial(on_device, 1, generator=torch.Generator(device=on_device.device))
        uploaded = torch.as_tensor([1, 2, 3], device="cuda")
        assert sim.counts.uploads == 1 and uploaded.device.type == "cuda"
        assert uploaded.tolist() == [1, 2, 3] and int(uploaded[0]) == 1
        assert sim.counts.syncs == 2
        assert torch.arange(3).tolist() == [0, 1, 2] and sim.counts.syncs == 2  # a CPU read is no sync


def test_the_adopted_model_reports_the_device() -> None:
    model, sim = simulated("llama", "sdpa")
    assert model.device.type == "cuda"
    with sim:
        logits = model(input_ids=torch.as_tensor([PROMPT], device=model.device)).logits
    assert logits.device.type == "cuda"
    torch.testing.assert_close(logits.as_subclass(torch.Tensor),
                               tiny_model("llama", "sdpa")(input_ids=torch.tensor([PROMPT])).logits)


# -- the decoder on it -----------------------------------------------------------------------------


def test_a_decoder_on_the_gpu_takes_the_gpu_default_sources() -> None:
    """Without sources a decoder takes its device's default combination: on CUDA the default and
    Token Recycling on the paper's 80-node template, with trees of up to 63 nodes (the widest
    captured width); on the CPU the default alone, up to 32 nodes."""
    model, sim = simulated("llama", "sdpa")
    with sim:
        on_gpu = Decoder(model, None)
    assert [s.name for s in on_gpu.sources] == [*DEFAULT_SOURCES, "recycle"]
    assert on_gpu.sources[-1].template.name == "tr80" and len(on_gpu.sources[-1].template.parents) == 80
    assert on_gpu.max_tree_nodes == 63
    on_cpu = Decoder(tiny_model("llama", "sdpa"), None)
    assert [s.name for s in on_cpu.sources] == list(DEFAULT_SOURCES) and on_cpu.max_tree_nodes == 32




@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("mix", list(MIXES))
def test_greedy_on_the_device_reads_once_per_step_and_matches_generate(mix: str, attn: str) -> None:
    out, counts = run("llama", attn, MIXES[mix])
    assert out.token_ids == reference_greedy(tiny_model("llama", attn), PROMPT, NEW)
    steps = out.stats.steps  # the prefill's step included: one upload (the prompt) and one read
    assert counts.syncs == steps, counts.log
    assert counts.uploads <= steps, counts.log


@pytest.mark.parametrize("mix", list(MIXES))
def test_sampling_on_the_device_reads_once_per_step_and_matches_the_cpu(mix: str) -> None:
    out, counts = run("llama", "sdpa", MIXES[mix], **SAMPLING)
    steps = out.stats.steps
    assert counts.syncs == steps, counts.log
    assert counts.uploads <= steps, counts.log
    # the same rows, the same seed, the same ops on the CPU: the same draws
    cpu = Decoder(tiny_model("llama", "sdpa"), None, sources=make_sources(MIXES[mix]), max_tree_nodes=12,
                  adaptive_budget=False)
    cpu.row_choices = "batched"
    assert cpu.generate(PROMPT, max_new_tokens=NEW, **SAMPLING).token_ids == out.token_ids


def test_seeded_sampling_on_the_device_is_reproducible() -> None:
    first, _ = run("llama", "sdpa", list(DEFAULT_SOURCES), **SAMPLING)
    again, _ = run("llama", "sdpa", list(DEFAULT_SOURCES), **SAMPLING)
    assert first.token_ids == again.token_ids


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_repetition_penalty_on_the_device_matches_generate(attn: str) -> None:
    out, counts = run("llama", attn, list(DEFAULT_SOURCES), repetition_penalty=1.3)
    assert out.token_ids == reference_greedy(tiny_model("llama", attn), PROMPT, NEW, repetition_penalty=1.3)
    assert counts.syncs == out.stats.steps


@pytest.mark.parametrize("arch", ["mistral", "gemma3", "qwen2_swa", "gpt2"])
def test_sliding_windows_and_gpt2_on_the_device(arch: str) -> None:
    out, counts = run(arch, "sdpa", list(DEFAULT_SOURCES))
    assert out.token_ids == reference_greedy(tiny_model(arch, "sdpa"), PROMPT, NEW)
    assert counts.syncs == out.stats.steps and counts.uploads <= out.stats.steps


def test_a_cpu_generator_fails_on_the_device(monkeypatch) -> None:
    """Teeth: the decoder as it was (a CPU ``torch.Generator()`` for ``seed=``) must fail here."""
    model, sim = simulated("llama", "sdpa")
    real = torch.Generator
    monkeypatch.setattr(torch, "Generator", lambda device="cpu": real())  # whatever device is asked for
    with sim:
        dec = Decoder(model, None, max_tree_nodes=12, adaptive_budget=False)
        with pytest.raises(DeviceMixError, match="generator"):
            dec.generate(PROMPT, max_new_tokens=NEW, **SAMPLING)


def test_exact_mode_on_the_device_pads_to_buckets_reads_once_per_step_and_matches_the_cpu(monkeypatch) -> None:
    """Exact mode on a GPU runs every decode forward at a bucket width where the probed rule holds
    (the static buffers of the GPU step): the same tokens as exact mode on the CPU, single and
    batched, one read and at most one upload per step. (The simulated device's tensors live on the
    CPU, where Triton cannot run: its exact attention is the torch layout, on purpose.)"""
    import specdraft.model.exact_attention as exact

    monkeypatch.setattr(exact, "TRITON", False)
    cpu_model = copy.deepcopy(tiny_model("llama", "sdpa")).to(torch.bfloat16)
    expected = Decoder(copy.deepcopy(cpu_model), None, sources=make_sources(list(DEFAULT_SOURCES)), max_tree_nodes=12,
                       adaptive_budget=False, exact=True)
    prompts = [PROMPT, PROMPT[:9], PROMPT[4:]]
    wanted = [expected.generate(p, max_new_tokens=NEW).token_ids for p in prompts]
    sim = SimulatedDevice()
    sim.adopt(cpu_model)
    with sim, sim.patched_generator():
        dec = Decoder(cpu_model, None, sources=make_sources(list(DEFAULT_SOURCES)), max_tree_nodes=12,
                      adaptive_budget=False, exact=True)
        assert dec.runner.static is not None and dec.engine.padding.widths == dec.runner.static.widths
        assert set(dec.engine.padding.widths) <= set(load_or_probe(cpu_model).widths)
        sim.reset_counts()
        out = dec.generate(PROMPT, max_new_tokens=NEW)
        assert out.token_ids == wanted[0]
        assert sim.counts.syncs == out.stats.steps and sim.counts.uploads <= out.stats.steps, sim.counts.log
        batched = dec.generate_batch(prompts, max_new_tokens=NEW, concurrency=3)
    assert [o.token_ids for o in batched] == wanted
