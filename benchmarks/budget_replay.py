"""Replay recorded greedy outputs through the real ``Decoder`` on a simulated clock.

Why: the adaptive budget (``specdraft/budget/``) decides from measured step costs, so its
effect on speed could so far only be seen in hours-long benchmark runs, where machine noise is as
large as the differences between two controller policies. Under greedy decoding, though, the
output of every prompt is fixed (it equals ``model.generate``), and a step's cost depends only on
its forward width. So a recorded run can be replayed exactly:

* the real :class:`~specdraft.decoder.Decoder`, its real sources and its real adaptive budget run
  unchanged; only the model runner and the clock are replaced;
* :class:`ReplayRunner` answers a forward with logits whose argmax at every tree node is the
  recorded next token after that node's depth (the verifier only ever reads a node whose path
  matches the recording, so this is exactly the model's greedy choice there), and advances the
  clock by the measured cost of a forward of that width;
* plain decoding's time is the prefill plus one one-token step per new token, from the same table.

The replayed output is checked against the recording (a mismatch is a bug in the replay), the
simulated speed ratio is reported per prompt, and a whole dataset of 40 prompts replays in
seconds to a minute, so controller policies can be compared on identical inputs.

Measure a cost table (median cost of one ``ModelRunner.forward`` of ``q`` chained tokens over a
200-token cache, ``q`` = 1..64), then replay the prompts and reference outputs a
``specdraft bench --resume`` checkpoint holds::

    python benchmarks/budget_replay.py measure --model PATH --dtype float32 --out costs-fp32.json
    python benchmarks/budget_replay.py replay --costs costs-fp32.json \\
        --checkpoint OUT/humaneval/checkpoint.pkl --checkpoint OUT/mtbench/checkpoint.pkl

What it leaves out: the Python cost of drafting and verifying (about 1% of a step here), and the
spread of real step times (``--noise`` adds a log-normal jitter to every simulated step).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import pickle
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from specdraft.sources import registry
from specdraft.decoder import Decoder
from specdraft.model.kv_store import KVStore
from specdraft.model.runner import ForwardOutput, Segment


# --------------------------------------------------------------------------------------------
# costs
# --------------------------------------------------------------------------------------------


@dataclass
class CostTable:
    """Seconds of one forward of ``q`` tokens, measured for ``q`` = 1..len(table); beyond the
    table the cost grows linearly with the slope of its last quarter (used for prefill only)."""

    seconds: list[float]

    def __call__(self, q: int) -> float:
        if q <= 0:
            return 0.0
        n = len(self.seconds)
        if q <= n:
            return self.seconds[q - 1]
        tail = max(2, n // 4)
        slope = (self.seconds[-1] - self.seconds[-tail]) / (tail - 1)
        return self.seconds[-1] + slope * (q - n)

    @classmethod
    def load(cls, path: Path) -> "CostTable":
        data = json.loads(path.read_text())
        table = data["seconds"] if isinstance(data, dict) else data
        return cls([float(s) for s in table])


def measure_costs(model_path: str, dtype: str, max_width: int, repeats: int, cache_len: int) -> list[float]:
    """Median seconds of a forward of ``q`` chained tokens over a ``cache_len`` cache, through the
    real :class:`~specdraft.model.runner.ModelRunner` (mask building included); widths interleaved across
    repeats so drift hits them alike."""
    from specdraft.models import load_model
    from specdraft.model.runner import ModelRunner, Segment

    model, _ = load_model(model_path, dtype=dtype, progress=False)
    runner = ModelRunner(model)
    region = runner.store.allocate(cache_len + max_width + 1)
    runner.forward([Segment(region, list(range(100, 100 + cache_len)), np.arange(cache_len), None, [cache_len - 1])])
    runner.store.keep_all(region)
    times: dict[int, list[float]] = {q: [] for q in range(1, max_width + 1)}
    for _ in range(repeats):
        for q in times:
            segment = Segment(region, list(range(500, 500 + q)), cache_len + np.arange(q),
                              np.tril(np.ones((q, q), dtype=bool)), range(q))
            started = time.perf_counter()
            runner.forward([segment])
            times[q].append(time.perf_counter() - started)
            runner.store.keep(region, [])  # drop the rows: the cache stays cache_len long
    return [statistics.median(times[q]) for q in sorted(times)]


# --------------------------------------------------------------------------------------------
# the replay
# --------------------------------------------------------------------------------------------


class SimulatedClock:
    """A clock that moves only when told to (with an optional log-normal jitter per advance)."""

    def __init__(self, noise: float = 0.0, seed: int = 0) -> None:
        self.now = 0.0
        self.noise = noise
        self._rng = random.Random(seed)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        jitter = math.exp(self._rng.gauss(0.0, self.noise)) if self.noise else 1.0
        self.now += seconds * jitter


class ReplayRunner:
    """Stands in for :class:`~specdraft.model.runner.ModelRunner`: the model's greedy choice at a row
    of position ``p`` is the recorded token at ``p + 1``, and a forward of ``q`` rows costs
    ``costs(q)`` on ``clock``. Set :attr:`sequence` (prompt + recorded output) first; one request at
    a time."""

    def __init__(self, vocab_size: int, max_positions: int | None, costs: CostTable, clock: SimulatedClock) -> None:
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self.costs = costs
        self.clock = clock
        self.sequence: list[int] = []
        self.widths: list[int] = []
        self.store = KVStore()
        self.device = torch.device("cpu")

    def check_batches(self) -> None:
        """A replay runs any layout."""

    def forward(self, segments: Sequence[Segment], riders: Sequence[np.ndarray] = (), padding=None) -> ForwardOutput:
        q = sum(len(s.tokens) for s in segments)
        q = padding(q) if padding is not None else q  # a padded forward costs its padded width
        self.store.take_moves()
        self.clock.advance(self.costs(q))
        self.widths.append(q)
        last = len(self.sequence) - 1
        targets, logit_spans, id_spans, kept, at = [], [], [], 0, 0
        for seg in segments:
            targets += [self.sequence[min(int(seg.positions[r]) + 1, last)] for r in seg.logit_rows]
            logit_spans.append(slice(kept, kept + len(seg.logit_rows)))
            id_spans.append(slice(at, at + len(seg.tokens)))
            kept += len(seg.logit_rows)
            at += len(seg.tokens)
            seg.region.pending = len(seg.tokens)
        logits = torch.zeros(len(targets), self.vocab_size)
        logits[torch.arange(len(targets)), torch.as_tensor(targets, dtype=torch.long)] = 1.0
        ids = torch.as_tensor([t for seg in segments for t in seg.tokens], dtype=torch.long)
        return ForwardOutput(logits, logit_spans, ids, id_spans, [torch.from_numpy(np.asarray(r)) for r in riders])


@dataclass
class Recording:
    """One prompt of a benchmark checkpoint: its token ids and the baseline's greedy output."""

    prompt_id: Any
    prompt_ids: list[int]
    reference: list[int]


def load_recordings(path: Path) -> tuple[str, list[Recording], dict[str, Any]]:
    """The dataset name, prompts and baseline outputs a ``specdraft bench`` checkpoint holds, or a
    recordings file ``export`` wrote (``.json`` / ``.json.gz``: token ids only, small enough to
    keep beside a run's results, and free of pickled objects that a later version may not load)."""
    if path.name.endswith((".json", ".json.gz")):
        with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
            data = json.load(f)
        records = [Recording(r["id"], list(r["prompt_ids"]), list(r["reference"])) for r in data["records"]]
        return data["dataset"], records, {"model": data["model"], "max_new_tokens": data["max_new_tokens"]}
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        checkpoint = pickle.load(f)
    fingerprint = checkpoint.fingerprint
    baseline = checkpoint.runs["baseline"]
    records = [Recording(pid, list(ids), list(run.result.token_ids))
               for (pid, ids), run in zip(fingerprint["prompts"], baseline)]
    return str(fingerprint.get("dataset", path.parent.name)), records, fingerprint


def export_recordings(checkpoint: Path, out_dir: Path) -> Path:
    """Write the prompts and baseline outputs of a ``specdraft bench`` checkpoint as
    ``OUT_DIR/<dataset>.json.gz`` (token ids only), which ``replay`` reads like the checkpoint."""
    dataset, records, fingerprint = load_recordings(checkpoint)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{dataset}.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"dataset": dataset, "model": fingerprint["model"], "max_new_tokens": fingerprint["max_new_tokens"],
                   "records": [{"id": r.prompt_id, "prompt_ids": r.prompt_ids, "reference": r.reference}
                               for r in records]}, f)
    return path


def replay_dataset(model: Any, records: Sequence[Recording], costs: CostTable, sources: Sequence[str],
                   max_tree_nodes: int, max_new_tokens: int, noise: float, seed: int,
                   adaptive: bool = True, priced: bool = True,
                   acceptance_smoothing: float | None = None) -> list[dict[str, Any]]:
    """Decode every recording in order with one Decoder (sources and budget carry across prompts,
    as in ``specdraft bench``); return per-prompt simulated times and ratios. With ``priced`` the
    budget prices widths from the cost table from the first step, as it does from the curve
    ``cpu_kernels="auto"`` measures; without, it learns each width's price from the steps."""
    clock = SimulatedClock(noise, seed)
    decoder = Decoder(model, None, sources=registry.make_sources(list(sources)), max_tree_nodes=max_tree_nodes,
                      adaptive_budget=adaptive, cpu_kernels="stock")
    if priced and decoder.budget.adaptive:
        decoder.budget.set_cost_curve(costs.seconds)
    if acceptance_smoothing is not None:
        decoder.budget.acceptance.fast = acceptance_smoothing
    runner = ReplayRunner(decoder.runner.vocab_size, decoder.runner.max_positions, costs, clock)
    decoder.runner = runner  # type: ignore[assignment]
    decoder.clock = clock
    rows = []
    for record in records:
        runner.sequence = record.prompt_ids + record.reference
        runner.widths = []
        started = clock()
        out = decoder.generate(record.prompt_ids, max_new_tokens=max_new_tokens)
        ours = clock() - started
        if out.token_ids != record.reference:
            raise AssertionError(f"prompt {record.prompt_id}: the replay committed other tokens than the recording "
                                 f"(a bug in the replay runner)")
        n = len(record.reference)
        plain = costs(len(record.prompt_ids)) + (n - 1) * costs(1)
        rows.append({"prompt_id": record.prompt_id, "new_tokens": n, "steps": out.stats.steps,
                     "mean_accepted": n / max(1, out.stats.steps), "plain_s": plain, "ours_s": ours,
                     "ratio": plain / ours, "widths": runner.widths})
    return rows


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    ratios = [r["ratio"] for r in rows]
    return {"prompts": len(rows), "median": statistics.median(ratios),
            "geomean": math.exp(statistics.fmean(math.log(x) for x in ratios)), "min": min(ratios),
            "below_0.95": sum(x < 0.95 for x in ratios),
            "mean_accepted": sum(r["new_tokens"] for r in rows) / sum(r["steps"] for r in rows)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="measure a forward-cost table on a real model")
    m.add_argument("--model", required=True)
    m.add_argument("--dtype", default="float32")
    m.add_argument("--max-width", type=int, default=64)
    m.add_argument("--repeats", type=int, default=5)
    m.add_argument("--cache-len", type=int, default=200)
    m.add_argument("--threads", type=int, default=1)
    m.add_argument("--out", type=Path, required=True)
    e = sub.add_parser("export", help="write a checkpoint's prompts and baseline outputs as <dataset>.json.gz")
    e.add_argument("--checkpoint", type=Path, action="append", required=True)
    e.add_argument("--out", type=Path, required=True, help="folder for the recordings files")
    r = sub.add_parser("replay", help="replay bench checkpoints on a simulated clock")
    r.add_argument("--costs", type=Path, required=True, help="a table written by `measure`")
    r.add_argument("--checkpoint", type=Path, action="append", required=True,
                   help="a `specdraft bench` checkpoint.pkl (or .pkl.gz); repeat for several datasets")
    r.add_argument("--sources", default=",".join(registry.DEFAULT_SOURCES))
    r.add_argument("--max-tree-nodes", type=int, default=32)
    r.add_argument("--fixed", action="store_true", help="fixed budget instead of the adaptive one")
    r.add_argument("--learned-prices", action="store_true",
                   help="the budget learns each width's price from the steps instead of taking the table "
                        "(what it does on cpu_kernels='stock', where nothing is measured)")
    r.add_argument("--acceptance-smoothing", type=float, default=None,
                   help="the budget's acceptance_smoothing (default: the library's)")
    r.add_argument("--noise", type=float, default=0.03, help="log-normal sigma of each step's simulated cost")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", type=Path, help="write per-prompt rows and summaries here (JSON)")
    r.add_argument("--model", help="the model to load (default: the one the checkpoint names, whose path may be "
                                   "gone on another machine; the replay runs none of its weights, it reads "
                                   "only the vocabulary size and position limit)")
    args = parser.parse_args(argv)

    if args.command == "export":
        for path in args.checkpoint:
            print(f"wrote {export_recordings(path, args.out)}")
        return 0

    if args.command == "measure":
        torch.set_num_threads(args.threads)
        seconds = measure_costs(args.model, args.dtype, args.max_width, args.repeats, args.cache_len)
        args.out.write_text(json.dumps({"model": args.model, "dtype": args.dtype, "cache_len": args.cache_len,
                                        "threads": args.threads, "seconds": seconds}, indent=1))
        print(" ".join(f"{q}:{1000 * s:.0f}" for q, s in enumerate(seconds, 1)))
        return 0

    from specdraft.models import load_model

    costs = CostTable.load(args.costs)
    sources = registry.parse_source_names(args.sources)
    model = None
    report: dict[str, Any] = {"costs": str(args.costs), "sources": sources, "fixed": args.fixed,
                              "acceptance_smoothing": args.acceptance_smoothing, "datasets": {}}
    for path in args.checkpoint:
        dataset, records, fingerprint = load_recordings(path)
        if model is None:
            model, _ = load_model(args.model or fingerprint["model"], dtype="float32", progress=False)
        rows = replay_dataset(model, records, costs, sources, args.max_tree_nodes, fingerprint["max_new_tokens"],
                              args.noise, args.seed, adaptive=not args.fixed, priced=not args.learned_prices,
                              acceptance_smoothing=args.acceptance_smoothing)
        summary = summarize(rows)
        report["datasets"][dataset] = {"summary": summary, "per_prompt": rows}
        print(f"{dataset:10s} median {summary['median']:.3f}x  geomean {summary['geomean']:.3f}x  "
              f"min {summary['min']:.3f}x  below 0.95x: {summary['below_0.95']}/{summary['prompts']}  "
              f"mean accepted {summary['mean_accepted']:.2f}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
