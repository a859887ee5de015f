"""The batched soak at test scale: a few hundred requests through ``generate_batch`` and
``stream_batch`` with everything mixed in, correctness only (no timing, no memory).

The harness is ``benchmarks/batch_soak.py`` itself (imported, not copied), so the test and the
10 000-request run cannot drift apart. It sends random calls on two decoders sharing the default
sources and a source that raises on the requests whose prompt marks them: concurrency 1-8,
batches of 1-16, prompts as text, lists, tuples, arrays and tensors (a few long enough to be
prefilled in chunks), ``max_new_tokens`` from 0, stop strings, greedy and sampled settings,
cancellations and early closes of streams, and every kind of invalid request. What must hold:

* every finished greedy request equals ``model.generate(do_sample=False)`` (cut where its stop
  strings cut), a cancelled or failed one a prefix of it, and a seeded sampled one the
  one-request decoder's output with that seed;
* every invalid request makes its call raise, naming the request and the bad value;
* a request whose source raised carries that error, and no other does; a cancelled one is
  flagged; a stream's pieces are its output;
* no source keeps state for a request after it ended, and both decoders still decode exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import batch_soak as bs  # noqa: E402



@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny forwards on one thread (as the suite's ``single_thread``; kept here so the module also
    runs on its own, next to another checkout's package)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


#: Test scale: 400 requests, about 160 of them in the sweep of invalid kinds at the start.
CONFIG = bs.SoakConfig.test_scale(requests=400, seed=7)


@pytest.fixture(scope="module")
def soaked() -> tuple[bs.Soak, bs.SoakReport]:
    soak = bs.Soak(CONFIG)
    return soak, soak.run()


def test_the_soak_finds_no_problem(soaked) -> None:
    _, report = soaked
    assert report.problems == [], "\n".join(report.problems[:20])
    assert report.mismatches == 0


def test_outputs_were_really_checked(soaked) -> None:
    """Not vacuous: greedy and seeded sampled outputs were compared, finished and cut short ones,
    and streams' pieces were put together."""
    _, report = soaked
    checks = report.checks
    assert checks["greedy_finished"] >= 60 and checks["greedy_prefix"] >= 5
    assert checks["sampled_finished"] + checks["sampled_prefix"] >= 5
    assert checks["stream_pieces"] >= 30


def test_every_outcome_came_up(soaked) -> None:
    _, report = soaked
    counts = report.counts
    assert counts["completed"] >= 100
    assert counts["cancelled"] >= 5 and counts["calls_closed"] >= 1
    assert counts["failed"] >= 3
    assert counts["calls_generate"] >= 5 and counts["calls_stream"] >= 5
    assert counts["completed_on_stop_string"] >= 1
    assert counts["invalid"] >= len(bs.INVALID_KINDS)
    assert set(report.raised_by_where) == {"propose", "observe", "end"}  # the source raised in each place


def test_every_invalid_kind_named_its_request_and_value(soaked) -> None:
    """Each kind was refused with a ValueError / TypeError (the harness checks that the message
    names ``request <index>:`` and the value; a missing part would be a problem above)."""
    _, report = soaked
    assert set(report.invalid_messages) == set(bs.INVALID_KINDS)
    for kind, message in report.invalid_messages.items():
        assert message.startswith(("ValueError", "TypeError", "UnsupportedOptionError")), (kind, message)


def test_no_request_state_is_left_in_any_source(soaked) -> None:
    soak, report = soaked
    assert report.live_after and all(n == 0 for n in report.live_after.values()), report.live_after
    for source in soak.sources:
        assert bs.live_states(source) == 0, source.name


def test_both_decoders_still_decode_exactly(soaked) -> None:
    soak, _ = soaked
    prompts = [[7, 8, 9, 7, 8], [20, 21], [30, 31, 32, 33, 30, 31]]
    for decoder in (soak.with_text, soak.ids_only):
        result = decoder.generate_batch(prompts, max_new_tokens=10, concurrency=2)
        for prompt, out in zip(prompts, result):
            assert out.error is None and not out.cancelled
            assert out.token_ids == bs.reference_tokens(soak.model, prompt, 10)
        single = decoder.generate(prompts[0], max_new_tokens=10)
        assert single.token_ids == bs.reference_tokens(soak.model, prompts[0], 10)


def test_the_soak_in_an_accelerators_order_finds_no_problem() -> None:
    """The same checks with the host work an accelerator runs behind the forward moved there on
    the CPU (``hide_host_work``): the late sources' learning, the acceptance walk and statistics,
    the prompts' indexing, and the ends of finished requests all wait for a later forward."""
    soak = bs.Soak(bs.SoakConfig.test_scale(requests=400, seed=11, hide_host_work=True))
    assert soak.with_text.engine.hides_host_work and soak.ids_only.engine.hides_host_work
    report = soak.run()
    assert report.problems == [], "\n".join(report.problems[:20])
    assert report.mismatches == 0
    assert report.checks["greedy_finished"] >= 60 and report.checks["stream_pieces"] >= 30
    assert report.counts["cancelled"] >= 5 and report.counts["failed"] >= 3
    assert set(report.raised_by_where) == {"propose", "observe", "end"}
    for source in soak.sources:
        assert bs.live_states(source) == 0, source.name


def test_the_harness_catches_a_wrong_output() -> None:
    """The checks are live: a decoder whose batches come back with one token changed is caught."""
    config = bs.SoakConfig.test_scale(requests=40, seed=3, invalid_sweep=False, invalid_share=0.0,
                                      stream_share=0.0, sample_share=0.0, fail_share=0.0, stop_share=0.0)
    soak = bs.Soak(config)
    for decoder in (soak.with_text, soak.ids_only):
        original = decoder.generate_batch

        def corrupted(*args: Any, _original=original, **kwargs: Any):
            result = _original(*args, **kwargs)
            for out in result:
                if out.token_ids:
                    out.token_ids[-1] = (out.token_ids[-1] + 1) % config.vocab_size
                    break
            return result

        decoder.generate_batch = corrupted  # type: ignore[method-assign]
    report = soak.run()
    assert report.mismatches > 0
    assert any("greedy output" in p for p in report.problems)


@pytest.fixture(scope="module")
def fresh() -> bs.Soak:
    """The soak's model, tokenizer, sources and decoders, with no request sent yet."""
    return bs.Soak(bs.SoakConfig.test_scale(requests=0, invalid_sweep=False))


def test_a_batch_stream_left_by_break_frees_the_decoder(fresh: bs.Soak) -> None:
    """``for index, piece in dec.stream_batch(...): break`` is how a caller stops reading. The
    single-request ``stream`` is closed as soon as it is dropped, so the next call runs; a batch
    stream must be too, not only once the cyclic garbage collector happens to run."""
    import gc

    decoder = fresh.ids_only
    prompt = [7, 8, 9, 7, 8]
    collecting = gc.isenabled()
    gc.disable()  # what the cyclic collector would do at some later, unknown moment is not the point
    try:
        for piece in decoder.stream(prompt, max_new_tokens=12):
            break
        assert decoder.generate(prompt, max_new_tokens=4).token_ids == bs.reference_tokens(fresh.model, prompt, 4)
        for index, piece in decoder.stream_batch([prompt, [20, 21]], max_new_tokens=12, concurrency=2):
            break
        result = decoder.generate_batch([prompt], max_new_tokens=4)  # raises: "this Decoder is busy ..."
        assert result[0].token_ids == bs.reference_tokens(fresh.model, prompt, 4)
    finally:
        if collecting:
            gc.enable()
        gc.collect()


@pytest.mark.parametrize("index", ["1", 1.0, True], ids=["str", "float", "bool"])
def test_cancel_refuses_an_index_that_is_not_an_int_naming_it(fresh: bs.Soak, index: Any) -> None:
    stream = fresh.ids_only.stream_batch([[7, 8, 9], [20, 21]], max_new_tokens=4)
    try:
        with pytest.raises((TypeError, ValueError), match=f"index.*{index!r}"):
            stream.cancel(index)
    finally:
        stream.close()


def test_after_close_every_request_has_an_output(fresh: bs.Soak) -> None:
    """``close()`` is the caller hanging up: every request of the batch is over, so each has an
    output (the queued ones cancelled with no tokens), and ``result()`` has one per prompt, as
    ``generate_batch`` does."""
    prompts = [[7, 8, 9], [20, 21], [30, 31], [40, 41]]
    stream = fresh.ids_only.stream_batch(prompts, max_new_tokens=12, concurrency=1)
    next(iter(stream))
    stream.close()
    assert all(out is not None and out.cancelled for out in stream.outputs)
    assert len(stream.result()) == len(prompts)


def test_results_without_a_plot_say_which_files_there_are(soaked, tmp_path: Path) -> None:
    _, report = soaked
    bs.write_results(report, tmp_path, "python benchmarks/batch_soak.py --no-plot", "0000000", False, draw=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "soak.csv", "summary.json"]
    assert "soak.png" not in (tmp_path / "README.md").read_text()


def test_a_missing_plotting_library_stops_the_run_before_it_starts(monkeypatch, capsys, tmp_path: Path) -> None:
    from specdraft.bench import report

    def missing() -> None:
        raise report.PlotUnavailableError("the plot needs matplotlib: pip install 'specdraft[bench]', or pass --no-plot")

    monkeypatch.setattr(report, "require_matplotlib", missing)
    monkeypatch.setattr(bs, "Soak", None)  # a run would fail on this: the check must come first
    with pytest.raises(SystemExit) as exit_info:
        bs.main(["--requests", "1", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "--no-plot" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
