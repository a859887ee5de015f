"""What differs between the transformers releases the package supports, found by inspection.

transformers 5.24 renamed the KV-cache argument of every model's ``forward`` from
``past_key_values`` to ``cache`` (the old name still works there but warns that it goes away in
5.40). The oldest release we support only knows ``past_key_values``. Rather than pinning a
version or silencing the warning, we read the keyword off the model's own ``forward`` signature,
so the same call is right on every release, including ones that drop the old name.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

#: The cache keyword of transformers releases before 5.24.
LEGACY_CACHE_KEYWORD = "past_key_values"
#: The cache keyword from transformers 5.24 on.
CACHE_KEYWORD = "cache"


def forward_parameters(model: Any) -> Mapping[str, inspect.Parameter]:
    """The parameters ``model.forward``'s signature names (none where it has no readable one)."""
    try:
        return inspect.signature(getattr(model, "forward", None)).parameters
    except (TypeError, ValueError):  # no forward (``None`` is no callable), or no readable signature
        return {}


def cache_keyword(model: Any) -> str:
    """The keyword under which ``model.forward`` takes its KV cache: the one its signature names
    (``"cache"`` from 5.24, ``"past_key_values"`` before), or, for a forward that names neither
    (a wrapper taking ``**kwargs``), the one the installed transformers release expects."""
    parameters = forward_parameters(model)
    for keyword in (CACHE_KEYWORD, LEGACY_CACHE_KEYWORD):
        if keyword in parameters:
            return keyword
    import transformers
    from packaging.version import Version

    return CACHE_KEYWORD if Version(transformers.__version__) >= Version("5.24.0") else LEGACY_CACHE_KEYWORD
