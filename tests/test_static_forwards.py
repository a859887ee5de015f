"""Decode forwards at fixed widths over static buffers (what a GPU captures as CUDA graphs), on a CPU.

No CUDA here, so no graph is captured: the static path runs its forwards eagerly, from the very
buffers a graph would read. What can be checked without a GPU is checked: the outputs (greedy
equals ``model.generate``, alone and batched, sliding windows included), that every decode forward
runs at a bucket width from the same buffers (addresses unchanged across steps and requests),
the bucket choice, and on the simulated device one read and one upload per step.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from specdraft import Decoder
from specdraft.model.static import WIDTHS, Buckets
from specdraft.simulated_device import SimulatedDevice
from specdraft.sources.registry import DEFAULT_SOURCES, make_sources

from conftest import AlternatingBudget, OracleSource, RerunGraph, reference_greedy, tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from gpu_steps import count_decode_forwards  # noqa: E402

PROMPT = [1, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 5, 6, 7]
NEW = 16


def static_decoder(model, graphs: bool = False, **options) -> Decoder:
    """A decoder whose decode forwards are static; ``graphs``: each width "captured" as a
    :class:`RerunGraph` (a CUDA graph's warm-up runs and replays, on the CPU)."""
    dec = Decoder(model, None, max_tree_nodes=options.pop("max_tree_nodes", 12), **options)
    dec.runner.use_static(capture=graphs, graph_kind=RerunGraph if graphs else None)
    dec.engine.padding = Buckets()
    return dec


class Spy:
    """Records the width and the buffer addresses of every static forward."""

    def __init__(self, static) -> None:
        self.widths: list[int] = []
        self.addresses: set[tuple[int, ...]] = set()
        run = static.run

        def spy(width, forward, store):
            self.widths.append(width)
            self.addresses.add((static.buffer.data_ptr(), *(b.data_ptr() for b in static.fields.values()),
                                static.block.data_ptr()))
            return run(width, forward, store)

        static.run = spy


def test_buckets_hold_every_width() -> None:
    buckets = Buckets()
    assert [buckets.rows_for(k) for k in (1, 2, 8, 9, 33, 64, 65)] == [1, 8, 8, 16, 64, 64, 65]
    assert buckets.widths == WIDTHS
    assert buckets.up_to(1) == (1,) and buckets.up_to(33) == (1, 8, 16, 32, 64) and buckets.up_to(17) == (1, 8, 16, 32)


@pytest.mark.parametrize("together", [(1, 8, 16), (1,)])
def test_widths_are_captured_together_on_pad_rows(together) -> None:
    """The widths a decoder's trees fill are captured at its first static forward, on pad rows
    alone (a plain request captures them too); a width outside them is captured at its first use.
    Neither changes an output."""
    model = tiny_model("llama")
    dec = static_decoder(model, graphs=True, sources=[], max_tree_nodes=0)
    dec.runner.static.together = together
    assert dec.generate(PROMPT, max_new_tokens=NEW).token_ids == reference_greedy(model, PROMPT, NEW)
    assert dec.runner.static.captured == list(together)
    trees = static_decoder(model, graphs=True, max_tree_nodes=12)
    trees.runner.static.together = together
    prompts = [PROMPT, PROMPT[2:], PROMPT[:9]]
    result = trees.generate_batch(prompts, max_new_tokens=NEW, concurrency=3)
    assert [o.token_ids for o in result] == [reference_greedy(model, p, NEW) for p in prompts]
    assert set(together) <= set(trees.runner.static.captured)


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3", "gpt2"])
def test_static_forwards_decode_exactly(arch: str, graphs: bool) -> None:
    model = tiny_model(arch)
    dec = static_decoder(model, graphs)
    spy = Spy(dec.runner.static)
    assert dec.generate(PROMPT, max_new_tokens=NEW).token_ids == reference_greedy(model, PROMPT, NEW)
    prompts = [PROMPT, PROMPT[:8], PROMPT[3:]]
    result = dec.generate_batch(prompts, max_new_tokens=NEW, concurrency=3)
    assert [o.token_ids for o in result] == [reference_greedy(model, p, NEW) for p in prompts]
    assert spy.widths and set(spy.widths) <= set(WIDTHS)  # every decode forward at a bucket width
    assert len(spy.addresses) == 1  # from the same buffers, step after step and request after request


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2"])
def test_a_narrow_forward_applies_every_move_of_a_wide_step(arch: str, graphs: bool) -> None:
    """A plain step (width 1) after a tree step whose accepted path sits behind a decoy branch:
    the tree's accepted rows move into place in the 1-row forward, every one of them, and a
    capture's warm-up runs do not move them again."""
    model = tiny_model(arch)
    ref = reference_greedy(model, PROMPT, 24)
    dec = static_decoder(model, graphs, sources=[OracleSource(PROMPT + ref, decoy=True)])
    dec.budget = AlternatingBudget(12, warmup=0)
    moves: list[tuple[int, int]] = []
    pack = dec.runner.static.pack

    def spy(plan, pending, scratch_row, riders):
        moves.append((plan.total, len(pending[0])))
        return pack(plan, pending, scratch_row, riders)

    dec.runner.static.pack = spy
    assert dec.generate(PROMPT, max_new_tokens=24).token_ids == ref
    assert any(moved > width for width, moved in moves)  # the case this is about happened
    if graphs:
        assert dec.runner.static.captured == list(WIDTHS)  # captured together, on pad rows


def test_static_forwards_read_once_and_upload_once_per_step_on_a_device() -> None:
    model = copy.deepcopy(tiny_model("llama"))
    sim = SimulatedDevice()
    sim.adopt(model)
    with sim, sim.patched_generator():
        dec = static_decoder(model, sources=make_sources(list(DEFAULT_SOURCES)), adaptive_budget=False)
        spy = Spy(dec.runner.static)
        sim.reset_counts()
        out = dec.generate(PROMPT, max_new_tokens=NEW)
        sampled = dec.generate(PROMPT, max_new_tokens=NEW, do_sample=True, seed=3, top_k=20)
    assert out.token_ids == reference_greedy(tiny_model("llama"), PROMPT, NEW)
    steps = out.stats.steps + sampled.stats.steps
    assert sim.counts.syncs == steps, sim.counts.log
    assert sim.counts.uploads <= steps, sim.counts.log
    assert spy.widths


@pytest.mark.parametrize("graphs", [False, True])
def test_a_store_that_grows_is_caught_before_a_static_forward(graphs: bool) -> None:
    """A new region past the buffers' end reallocates them: that forward runs as it comes (a
    captured graph would still write to the old buffers), and later ones are static again. The
    scratch region of pad rows is made anew after the store forgets its regions (between
    requests), and that too may grow the store."""
    model = tiny_model("llama")
    dec = static_decoder(model, graphs)
    spy = Spy(dec.runner.static)
    first = dec.generate(PROMPT, max_new_tokens=NEW).token_ids
    long_prompt = PROMPT * 6
    assert dec.generate(long_prompt, max_new_tokens=NEW).token_ids == reference_greedy(model, long_prompt, NEW)
    assert first == reference_greedy(model, PROMPT, NEW) and spy.widths
    with torch.inference_mode():
        assert not dec.runner.store.needs_growth()


@pytest.mark.parametrize("graphs", [False, True])
def test_plain_static_decoding_after_a_longer_request(graphs: bool) -> None:
    """Plain decoding pads nothing, so its first static forward is where the scratch row (the
    target of unused move slots) is made: after a longer request than before, that grows the store,
    and the forward must run as it comes."""
    model = tiny_model("qwen2")
    dec = static_decoder(model, graphs, sources=[], max_tree_nodes=0)
    for prompt, new in ((PROMPT * 2, NEW), (PROMPT * 8, 48)):
        assert dec.generate(prompt, max_new_tokens=new).token_ids == reference_greedy(model, prompt, new)


@pytest.mark.parametrize("adaptive", [True, False])
def test_batched_trees_share_the_widest_bucket_and_never_run_eagerly(adaptive: bool) -> None:
    """Eight requests whose sources draft long trees: every decode forward runs at a bucket width
    (the budget shares the widest bucket's rows among the requests instead of running a wider
    forward eagerly), and each request's output is still model.generate's."""
    model = tiny_model("llama")
    dec = static_decoder(model, graphs=True, max_tree_nodes=32, adaptive_budget=adaptive)
    spy = Spy(dec.runner.static)
    decode_forwards = count_decode_forwards(dec)
    prompts = [(PROMPT[i:] + PROMPT[:i]) * 3 for i in range(8)]
    result = dec.generate_batch(prompts, max_new_tokens=24, concurrency=8)
    assert [o.token_ids for o in result] == [reference_greedy(model, p, 24) for p in prompts]
    assert max(decode_forwards) <= max(WIDTHS)
    assert len(decode_forwards) - len(spy.widths) <= 1  # eager only where the store grew (its scratch row)
    assert max(spy.widths) == max(WIDTHS)  # the trees did fill the widest bucket


def test_warm_up_captures_and_sizes_the_store_so_requests_capture_nothing() -> None:
    """``Decoder.warm_up``: the graphs are captured and the store sized before any request, its
    sources learn nothing from it, and later requests up to that length capture no graph and
    leave the store's buffers where they are; outputs stay generate's."""
    model = tiny_model("llama")
    dec = static_decoder(model, graphs=True, max_tree_nodes=12)
    dec.runner.static.together = (1, 8, 16)
    begun = []
    for source in dec.sources:
        source.begin = lambda context, _s=source, _begin=source.begin: (begun.append(_s.name), _begin(context))[1]
    dec.warm_up(160)
    assert not begun and dec.runner.static.captured == [1, 8, 16]
    layout = dec.runner.store.layout_key()
    captures = []
    kind = dec.runner.static._graph_kind
    dec.runner.static._graph_kind = lambda fn: (captures.append(1), kind(fn))[1]
    long_prompt = PROMPT * 6
    assert dec.generate(long_prompt, max_new_tokens=NEW).token_ids == reference_greedy(model, long_prompt, NEW)
    assert begun and not captures and dec.runner.store.layout_key() == layout
    with pytest.raises(ValueError, match="context_tokens"):
        dec.warm_up(1)


class CountingBackend:
    """A ``torch.compile`` backend that counts the graphs it is handed and runs each as traced:
    dynamo's tracing of the static forward (its side effects on the store, its dynamic shapes),
    without generating kernels. ``fail`` makes compiling raise instead."""

    def __init__(self, fail: bool = False) -> None:
        self.graphs = 0
        self.fail = fail

    def __call__(self, graph_module, example_inputs):
        if self.fail:
            raise RuntimeError("no kernels here")
        self.graphs += 1
        return graph_module.forward


def test_compiled_static_forwards_decode_exactly_with_two_compiles() -> None:
    """``compile=True``'s path: the static forward's body through ``torch.compile`` (a backend
    that runs what dynamo traced), captured per width. Outputs stay ``model.generate``'s, alone,
    batched and after the store grew, and every width, store size and decoder shares two
    compiled graphs per attention implementation (width 1, and a dynamic one for the rest; on a
    CPU a batch runs another implementation than one request)."""
    model = tiny_model("qwen2")
    backend = CountingBackend()
    implementations = set()
    for max_new, prompts in ((NEW, [PROMPT]), (NEW, [PROMPT, PROMPT[:8], PROMPT[3:]]), (24, [PROMPT * 5]),
                             (NEW, [PROMPT[2:], PROMPT])):
        dec = Decoder(model, None, max_tree_nodes=12)
        static = dec.runner.use_static(capture=True, graph_kind=RerunGraph, compile_backend=backend)
        dec.engine.padding = Buckets()
        static.together = (1, 8, 16)
        compiled = static.model_pass
        static.model_pass = lambda *args: (implementations.add(model.config._attn_implementation), compiled(*args))[1]
        result = dec.generate_batch(prompts, max_new_tokens=max_new, concurrency=len(prompts))
        assert [o.token_ids for o in result] == [reference_greedy(model, p, max_new) for p in prompts]
        assert static.note == "" and static.captured == [1, 8, 16]
    assert len(implementations) == 2 and backend.graphs == 2 * len(implementations)


def test_a_forward_that_does_not_compile_runs_uncompiled_and_says_why() -> None:
    model = tiny_model("qwen2")
    dec = Decoder(model, None, max_tree_nodes=12)
    dec.runner.use_static(capture=True, graph_kind=RerunGraph, compile_backend=CountingBackend(fail=True))
    dec.engine.padding = Buckets()
    assert dec.generate(PROMPT, max_new_tokens=NEW).token_ids == reference_greedy(model, PROMPT, NEW)
    assert "torch.compile failed" in dec.runner.static.note and "no kernels here" in dec.runner.static.note


@pytest.mark.slow
def test_inductor_compiled_static_forwards_decode_exactly() -> None:
    """The real compiler: inductor generates the static forward's kernels (C++ on a CPU, about half
    a minute); outputs stay ``model.generate``'s in float64, alone and batched."""
    from specdraft.model.static import COMPILE_BACKEND

    model = tiny_model("qwen2")
    dec = Decoder(model, None, max_tree_nodes=12)
    static = dec.runner.use_static(capture=True, graph_kind=RerunGraph, compile_backend=COMPILE_BACKEND)
    dec.engine.padding = Buckets()
    static.together = (1, 8, 16)
    assert dec.generate(PROMPT, max_new_tokens=NEW).token_ids == reference_greedy(model, PROMPT, NEW)
    prompts = [PROMPT, PROMPT[:8]]
    result = dec.generate_batch(prompts, max_new_tokens=NEW, concurrency=2)
    assert [o.token_ids for o in result] == [reference_greedy(model, p, NEW) for p in prompts]
    assert static.note == "", static.note


def test_the_forward_kernel_profile_charges_each_width_its_operations(tmp_path: Path) -> None:
    """``benchmarks/forward_kernels.py`` on the CPU (its GPU run charges CUDA kernel time): every
    decode forward is marked with its width, plain decoding runs one row, trees run at buckets, and
    each width's time is split into kinds that add up to its total."""
    import json

    import forward_kernels

    assert forward_kernels.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--context", "300",
                                 "--new-tokens", "6", "--nodes", "0,8", "--out", str(tmp_path)]) == 0
    runs = json.loads((tmp_path / "kernels.json").read_text())["runs"]
    assert set(runs["nodes 0"]) == {"1"}
    assert set(runs["nodes 8"]) - {"1"} and set(runs["nodes 8"]) <= {str(w) for w in WIDTHS}
    for run in runs.values():
        for row in run.values():
            assert row["forwards"] >= 1 and {"matmul", "attention"} <= set(row["kinds"])
            assert abs(sum(row["kinds"].values()) - row["us_per_forward"]) < 0.1 * len(row["kinds"])
    assert "| **all** |" in (tmp_path / "kernels.md").read_text()
    assert forward_kernels.kind_of("aten::addmm") == "matmul"
    assert forward_kernels.kind_of("aten::_efficient_attention_forward") == "attention"
    assert forward_kernels.kind_of("aten::index_copy_").startswith("copies")


def test_the_whole_forward_row_check_names_where_a_row_parts(tmp_path: Path) -> None:
    """``benchmarks/forward_rows.py`` (the whole decode forward's rows at each width, the check that
    exact mode's per-layer probe leaves open on a GPU): its command writes a result for the eager
    ways (captured forwards need CUDA); a layer planted to round a row otherwise at one width
    makes that width's row part, and the first module named is the planted one."""
    import json

    import forward_rows
    from gpu_steps import build_model

    assert forward_rows.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--widths", "1,8",
                              "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "rows.json").read_text())
    assert set(result["ways"]) == {"static", "dynamic"}
    assert all(way["repeatable"] for way in result["ways"].values())
    assert "| static |" in (tmp_path / "rows.md").read_text()

    # the forwards run under the decoder's attention, as decoding's do (exact mode's when on), and
    # exact mode's rows agree at every width a decoder runs
    from specdraft.model.exact_attention import EXACT_NAME

    for exact, attention in ((True, EXACT_NAME), (False, "sdpa")):
        ways = forward_rows.check(build_model("tiny", "cpu", torch.bfloat16), (1, 8), exact=exact)["ways"]
        assert {way["attention"] for way in ways.values()} == {attention}
        if exact:
            assert all(r["agree"] == r["rows"] for way in ways.values() for w, r in way["rows"].items()
                       if r["runs_at"] == w)

    model = build_model("tiny", "cpu", torch.float64)
    norm = model.model.layers[0].input_layernorm
    unplanted = norm.forward
    for planted_width in (1, 8):
        norm.forward = lambda x, w=planted_width: unplanted(x) + (1e-3 if x.shape[1] == w else 0.0)
        rows = forward_rows.check(model, (1, 8, 16), ways=("static",))["ways"]["static"]["rows"]
        parted = rows[planted_width]
        assert parted["agree"] == 0 and parted["first_parting_row"] == 0
        assert parted["first_parting_module"] == "model.layers.0.input_layernorm"
        assert rows[16]["agree"] == 16  # the widest is the reference
