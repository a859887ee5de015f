"""One method against another, prompt by prompt, from a ``specdraft bench`` output.

The bench reports each method against ``model.generate`` and against ``plain`` on the same
kernels. Questions like "what does exact mode cost?" compare two of our methods timed in the same
process (``plain`` against ``plain@exact``); this script reads the run's ``summary.json`` and gives,
per dataset and pair, the ratio of the two speeds on each prompt (time of the second / time of the
first: above 1 the first is faster) with its median, geometric mean and worst, and writes them to
``--out`` (default: ``ratios.json`` beside the summary; ``{"summary": {...}}``, the form the docs'
number check reads in a results folder).

    python benchmarks/method_ratios.py RUN/summary.json plain@exact/plain default@exact/default --out RUN/ratios.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def pair_ratios(summary: dict, first: str, second: str) -> dict[str, dict[str, float]]:
    """Per dataset: the median, geometric mean and worst of ``time(second) / time(first)`` over
    the prompts on which both ran."""
    out = {}
    for name, data in summary["datasets"].items():
        ratios = [row["methods"][second]["wall_time"] / row["methods"][first]["wall_time"]
                  for row in data["per_prompt"]
                  if first in row["methods"] and second in row["methods"] and row["methods"][first]["wall_time"]]
        if not ratios:
            raise SystemExit(f"{name}: no prompt ran both {first!r} and {second!r}")
        out[name] = {"speedup_median": statistics.median(ratios), "speedup_geomean": statistics.geometric_mean(ratios),
                     "speedup_min": min(ratios), "prompts": len(ratios)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("summary", type=Path, help="the summary.json of a specdraft bench --out folder")
    parser.add_argument("pairs", nargs="+", metavar="FIRST/SECOND", help="methods to compare, e.g. plain@exact/plain")
    parser.add_argument("--out", type=Path, help="where to write the ratios (default: ratios.json beside the summary)")
    args = parser.parse_args()
    summary = json.loads(args.summary.read_text())
    result = {}
    for pair in args.pairs:
        first, sep, second = pair.partition("/")
        if not sep or not first or not second:
            raise SystemExit(f"a pair is FIRST/SECOND (two method names), got {pair!r}")
        for dataset, ratios in pair_ratios(summary, first, second).items():
            result[f"{first} / {second}, {dataset}"] = ratios
            print(f"{dataset:>10}  {first} / {second}: median {ratios['speedup_median']:.2f}x, geomean "
                  f"{ratios['speedup_geomean']:.2f}x, worst {ratios['speedup_min']:.2f}x ({ratios['prompts']} prompts)")
    (args.out or args.summary.with_name("ratios.json")).write_text(json.dumps({"summary": result}, indent=1) + "\n")


if __name__ == "__main__":
    main()
