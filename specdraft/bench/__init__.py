"""``specdraft bench``: compare plain decoding, transformers' prompt lookup and our draft sources
on real prompt sets, in one process, interleaved, with a token-for-token identity check.

Modules: :mod:`~specdraft.bench.datasets` (prompt sets), :mod:`~specdraft.bench.methods` (what
is compared), :mod:`~specdraft.bench.runner` (the interleaved loop, mismatch margins),
:mod:`~specdraft.bench.report` (Spec-Bench JSONL, summary, markdown, plot). See
``benchmarks/README.md`` for how to run it and what the columns mean.
"""

from .datasets import DatasetError, PromptRecord, load_prompts, resolve_dataset
from .methods import MethodError, MethodResult, build_method, build_methods, default_method_names, parse_methods
from .report import markdown_report, markdown_table, plot, summarize, write_specbench_jsonl
from .runner import DatasetRun, Mismatch, first_difference, logit_margin, run_benchmark

__all__ = [
    "DatasetError", "DatasetRun", "MethodError", "MethodResult", "Mismatch", "PromptRecord", "build_method",
    "build_methods", "default_method_names", "first_difference", "load_prompts", "logit_margin", "markdown_report",
    "markdown_table", "parse_methods", "plot", "resolve_dataset", "run_benchmark", "summarize",
    "write_specbench_jsonl",
]
