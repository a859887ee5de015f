"""The model side: one forward of many requests' rows over a KV store, with one mask builder."""

from .kv_store import KVStore, Region
from .runner import ForwardOutput, ModelRunner, Segment, UnsupportedModelError, context_limit

__all__ = ["ForwardOutput", "KVStore", "ModelRunner", "Region", "Segment", "UnsupportedModelError", "context_limit"]
