"""Plain ``model.generate`` timing: the yardstick every speed claim is measured against.

The CLI's ``--compare`` and the benchmark harness both need the same thing: run transformers'
own decoding on the same model and prompt, in the same process, and report the new tokens and
the wall time. Keeping it in one place keeps the two measurements comparable.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from .stopping import eos_ids

__all__ = ["as_input_ids", "time_plain_generate", "warmup_forward"]


def as_input_ids(input_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """A ``[1, n]`` long tensor from a list of ids or a 1-D/2-D tensor (batch size 1 only)."""
    ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.tensor(list(input_ids), dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"expected one sequence of token ids, got shape {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty (no token ids)")
    return ids.long()


@torch.inference_mode()
def warmup_forward(model: Any, input_ids: torch.Tensor | Sequence[int]) -> None:
    """One throw-away forward over the prompt, so the first timed run does not pay for lazy
    initialisation (thread pool start-up, allocator growth, first-touch of the weights)."""
    ids = as_input_ids(input_ids).to(model.device)
    model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)


@torch.inference_mode()
def time_plain_generate(model: Any, input_ids: torch.Tensor | Sequence[int], max_new_tokens: int,
                        **gen_kwargs: Any) -> tuple[list[int], float]:
    """Run ``model.generate`` once and return ``(new token ids, seconds)``.

    ``gen_kwargs`` go to ``generate`` unchanged (``do_sample``, ``temperature``, ...); options not
    given come from the model's generation config, exactly as for a user calling ``generate``.
    Seed the RNG yourself (``torch.manual_seed``) before a sampled run you want to reproduce. The
    prompt is excluded from the returned ids. Only ``generate`` itself is timed.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    ids = as_input_ids(input_ids).to(model.device)
    gen_kwargs.setdefault("attention_mask", torch.ones_like(ids))  # (the caller's dict is a copy: ** made it)
    eos = eos_ids(model)  # (none without a generation config)
    if eos and model.generation_config.pad_token_id is None and "pad_token_id" not in gen_kwargs:
        gen_kwargs["pad_token_id"] = eos[0]  # silences "Setting pad_token_id to eos_token_id" on every call
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=max_new_tokens, **gen_kwargs)
    seconds = time.perf_counter() - start
    sequences = out.sequences if hasattr(out, "sequences") else out
    return sequences[0, ids.shape[1]:].tolist(), seconds
