"""The engine: one step for one request or many (draft, plan, lay out, forward, read back, settle)."""

from .drafting import Drafter
from .engine import Engine
from .outputs import BatchOutput, BatchResult, BatchStats
from .request import RequestSpec

__all__ = ["BatchOutput", "BatchResult", "BatchStats", "Drafter", "Engine", "RequestSpec"]
