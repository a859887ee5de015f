"""The benchmark loop: every method on every prompt, interleaved, then the identity check.

For each prompt, in order:

1. one untimed warm-up forward over the prompt (:func:`specdraft.baseline.warmup_forward`); on an
   accelerator, before a method's first timed prompt, its own untimed call for its one-time costs
   (``generate-static``'s compile, our decoder's graph captures and store sizing: the methods'
   ``warm_up``);
2. every method once (``repeats`` times), in an order *rotated* by one per prompt: prompt 0 runs
   ``m0 m1 m2``, prompt 1 ``m1 m2 m0``, ... so slow drift of the machine (thermal state, other
   tenants, allocator growth) lands on every method alike instead of always on the one that runs
   first or last. With ``repeats > 1`` each method's wall time is the median of its repeats;
3. the output of every method is compared with the baseline's, token for token. At the first
   differing position one more forward of ``prompt + baseline[:position]`` gives the baseline
   model's own logits there, and the *margin* ``top1 - top2`` says whether it was a near-tie
   (tiny margin: a rounding difference, expected in bf16) or a real bug (large margin).

Prompts whose ``len(prompt) + max_new_tokens`` exceeds the model's context are skipped (and
listed), as neither decoder could finish them.

With a ``checkpoint`` path the finished prompts and every method's state are saved after each
prompt; ``resume=True`` continues from that file (see :mod:`specdraft.bench.checkpoint`).
"""

from __future__ import annotations

import gc
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from ..model.runner import context_limit
from .checkpoint import Checkpoint, first_difference, load_checkpoint, save_checkpoint
from .datasets import PromptRecord
from .methods import BASELINE, Method, MethodResult

__all__ = ["DatasetRun", "Mismatch", "PromptRun", "baseline_rows", "first_difference", "logit_margin", "run_benchmark"]


@dataclass
class PromptRun:
    """One method on one prompt: the result of its last run and every timed wall time."""

    result: MethodResult
    wall_times: list[float]
    consistent: bool = True  # every repeat produced the same tokens

    @property
    def wall_time(self) -> float:
        return statistics.median(self.wall_times)


@dataclass
class Mismatch:
    """Where a method's greedy output first leaves the baseline's, and how close the call was."""

    method: str
    prompt_id: Any
    position: int
    baseline_token: int | None
    method_token: int | None
    top1_token: int | None = None
    margin: float | None = None  # top1 - top2 of the baseline model's logits at ``position``
    method_token_gap: float | None = None  # top1 - logit of the method's token there


@dataclass
class DatasetRun:
    """Everything measured on one dataset."""

    dataset: str
    prompts: list[PromptRecord]
    methods: list[Method]
    runs: dict[str, list[PromptRun]] = field(default_factory=dict)  # method -> one per prompt
    mismatches: list[Mismatch] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    max_new_tokens: int = 0
    repeats: int = 1
    resumed: int = 0  # prompts taken from a checkpoint instead of being run now


def logit_margin(model: Any, prompt_ids: Sequence[int], baseline_ids: Sequence[int], position: int,
                 method_token: int | None = None) -> dict[str, Any]:
    """The baseline model's logits for output ``position`` given ``prompt + baseline[:position]``
    (one forward, no cache): the top token, ``margin = top1 - top2`` and, if given, how far the
    method's token was below the top (``method_token_gap``). Raw logits, before any processor."""
    return _margin_info(baseline_rows(model, prompt_ids, baseline_ids, [position])[position], method_token)


@torch.inference_mode()
def baseline_rows(model: Any, prompt_ids: Sequence[int], baseline_ids: Sequence[int],
                  positions: Sequence[int]) -> dict[int, torch.Tensor]:
    """The baseline model's float logits for each output position in ``positions``, from **one**
    no-cache forward of ``prompt + baseline[:last position]`` (a causal model's row for position
    ``p`` sees only ``prompt + baseline[:p]``). The bench asks for every method's first difference
    on a prompt, often at the same or nearby positions, and such a forward of a few hundred tokens
    is the slow part of the report: tens of seconds with stock bfloat16 kernels on a CPU without
    AVX512, once per prompt instead of once per method and prompt."""
    end = max(positions)
    ids = torch.tensor([list(prompt_ids) + list(baseline_ids[:end])], dtype=torch.long, device=model.device)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0]
    return {p: logits[len(prompt_ids) + p - 1].float() for p in positions}


def _margin_info(row: torch.Tensor, method_token: int | None) -> dict[str, Any]:
    """Top token, ``top1 - top2`` and the method token's gap below the top, of one logits row."""
    top = torch.topk(row, 2)
    out: dict[str, Any] = {"top1_token": int(top.indices[0]), "margin": float(top.values[0] - top.values[1])}
    if method_token is not None and 0 <= method_token < row.shape[-1]:
        out["method_token_gap"] = float(top.values[0] - row[method_token])
    return out


def run_benchmark(model: Any, prompts: Sequence[PromptRecord], methods: Sequence[Method], max_new_tokens: int,
                  *, repeats: int = 1, dataset: str = "", progress: bool = True, checkpoint: Path | None = None,
                  resume: bool = False, setup: dict[str, Any] | None = None) -> DatasetRun:
    """Run every method on every prompt (interleaved, see the module docstring) and compare.

    ``methods`` must contain one named ``baseline``: it is the reference for identity and speed.
    ``checkpoint``: a file to save progress to after every prompt. ``resume``: continue from it if
    it exists (else start afresh); it must come from the same experiment: the prompts, methods,
    token limit, repeats and ``setup`` (what the caller adds: model, dtype, threads, ...) are
    compared, and :class:`~specdraft.bench.checkpoint.CheckpointMismatch` names any difference.
    """
    names = [m.name for m in methods]
    if BASELINE not in names:
        raise ValueError(f"the methods must include {BASELINE!r}, the reference; got {names}")
    if len(set(names)) != len(names):
        raise ValueError(f"method names must be unique, got {names}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    from specdraft.baseline import warmup_forward

    run = DatasetRun(dataset=dataset, prompts=[], methods=list(methods), runs={n: [] for n in names},
                     max_new_tokens=max_new_tokens, repeats=repeats)
    limit = context_limit(model)
    usable = []
    for prompt in prompts:
        if limit is not None and len(prompt.token_ids) + max_new_tokens > limit:
            run.skipped.append({"prompt_id": prompt.id, "prompt_tokens": len(prompt.token_ids),
                                "reason": f"prompt + max_new_tokens exceeds the model's context of {limit}"})
        else:
            usable.append(prompt)
    run.prompts = usable

    fingerprint = {**(setup or {}), "dataset": dataset, "methods": names, "max_new_tokens": max_new_tokens,
                   "repeats": repeats, "prompts": [(p.id, list(p.token_ids)) for p in usable]}
    if resume and checkpoint is not None and checkpoint.exists():
        saved = load_checkpoint(checkpoint, fingerprint)
        run.resumed = min(saved.done, len(usable))  # a smaller --limit reports the finished prefix
        for method in methods:
            run.runs[method.name] = list(saved.runs[method.name][: run.resumed])
            method.set_state(saved.states[method.name])  # only used if prompts are left to run

    from tqdm.auto import tqdm

    bar = tqdm(total=(len(usable) - run.resumed) * len(methods) * repeats, desc=dataset or "bench",
               unit="run", file=sys.stderr, disable=not progress, dynamic_ncols=True, leave=True)
    try:
        for index in range(run.resumed, len(usable)):
            prompt = usable[index]
            warmup_forward(model, prompt.token_ids)
            shift = index % len(methods)  # by the prompt's index, so a resumed run rotates on as before
            for method in list(methods[shift:]) + list(methods[:shift]):
                bar.set_postfix_str(f"prompt {index + 1}/{len(usable)} {method.name}", refresh=False)
                run.runs[method.name].append(_time_method(method, prompt.token_ids, max_new_tokens, repeats, bar))
            if checkpoint is not None:
                save_checkpoint(checkpoint, Checkpoint(fingerprint=fingerprint, runs=run.runs,
                                                       states={m.name: m.get_state() for m in methods}))
    finally:
        bar.close()

    run.mismatches = _mismatches(model, usable, names, run.runs)
    return run


def _time_method(method: Method, prompt_ids: Sequence[int], max_new_tokens: int, repeats: int, bar: Any) -> PromptRun:
    """Run a method ``repeats`` times; only the last run may change cross-request state."""
    results: list[MethodResult] = []
    for r in range(repeats):
        results.append(_run_without_gc(method, prompt_ids, max_new_tokens, learn=(r == repeats - 1)))
        bar.update(1)
    last = results[-1]
    return PromptRun(result=last, wall_times=[result.wall_time for result in results],
                     consistent=all(result.token_ids == last.token_ids for result in results))


def _run_without_gc(method: Method, prompt_ids: Sequence[int], max_new_tokens: int, learn: bool) -> MethodResult:
    """One run with the cyclic garbage collector paused, as :mod:`timeit` does: with transformers
    loaded a full collection takes ~0.5 s here, and one landing inside a timed run would be
    charged to whichever method happened to trigger it. Garbage is collected before each run."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return method.run(prompt_ids, max_new_tokens, learn=learn)
    finally:
        if was_enabled:
            gc.enable()


def _mismatches(model: Any, prompts: Sequence[PromptRecord], names: Sequence[str],
                runs: dict[str, list[PromptRun]]) -> list[Mismatch]:
    """Every method's first difference from the baseline, method by method and prompt by prompt,
    with the baseline model's margin there (one forward per prompt, for all its methods)."""
    baseline = runs[BASELINE]
    found: list[Mismatch] = []
    scored: dict[int, list[Mismatch]] = {}  # prompt index -> its mismatches where the baseline has a token
    for name in (n for n in names if n != BASELINE):
        for index, (ours, ref) in enumerate(zip(runs[name], baseline)):
            ref_ids, our_ids = ref.result.token_ids, ours.result.token_ids
            position = first_difference(our_ids, ref_ids)
            if position is not None:
                item = Mismatch(method=name, prompt_id=prompts[index].id, position=position,
                                baseline_token=ref_ids[position] if position < len(ref_ids) else None,
                                method_token=our_ids[position] if position < len(our_ids) else None)
                found.append(item)
                if item.baseline_token is not None:  # the model chose that token: how firmly?
                    scored.setdefault(index, []).append(item)
    for index, here in scored.items():
        rows = baseline_rows(model, prompts[index].token_ids, baseline[index].result.token_ids,
                             sorted({m.position for m in here}))
        for item in here:
            info = _margin_info(rows[item.position], item.method_token)
            item.top1_token = info["top1_token"]
            item.margin = info["margin"] if math.isfinite(info["margin"]) else None
            item.method_token_gap = info.get("method_token_gap")
    return found
