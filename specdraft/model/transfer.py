"""One host-to-device copy per step: several small host arrays packed into one upload.

A decoding step sends the device a handful of small arrays (the tree's token ids, their positions,
the tree's attention block, and for a repetition penalty the tokens on each node's path). Sent one
by one, each is a separate host-to-device copy with its own launch and, from pageable memory, its
own wait. :func:`upload` lays them out in one byte buffer (each part aligned to 8 bytes), copies
it once (from pinned memory where the device is CUDA, without blocking) and returns a typed view
of each part on the device, so a step costs one copy whatever it carries.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

__all__ = ["upload"]

_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.bool_): torch.bool, np.dtype(np.int32): torch.int32,
                 np.dtype(np.uint8): torch.uint8}


def upload(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """``arrays`` (int64, int32, uint8 or bool numpy arrays) as tensors on ``device``, in one copy.

    On the CPU the parts are views of one host buffer (no copy at all); elsewhere the buffer is
    copied once and each part is a view of the device copy, reshaped as its array was.
    """
    arrays = [np.ascontiguousarray(a) for a in arrays]
    offsets, total = [], 0
    for a in arrays:
        if a.dtype not in _TORCH_DTYPES:
            raise TypeError(f"upload takes int64, int32, uint8 or bool arrays, got {a.dtype}")
        offsets.append(total)
        total += -(-a.nbytes // 8) * 8  # every part starts 8-byte aligned, so int64 views are legal
    host = np.zeros(max(total, 8), dtype=np.uint8)
    for a, at in zip(arrays, offsets):
        host[at : at + a.nbytes] = a.reshape(-1).view(np.uint8)
    buffer = torch.from_numpy(host)
    if device.type != "cpu":
        if device.type == "cuda" and torch.cuda.is_available():
            buffer = buffer.pin_memory()
        buffer = buffer.to(device, non_blocking=True)
    return [buffer[at : at + a.nbytes].view(_TORCH_DTYPES[a.dtype]).reshape(a.shape)
            for a, at in zip(arrays, offsets)]
