"""A simulated accelerator on the CPU: catch device bugs and count host syncs without a GPU.

Code that decodes on a GPU has two classes of bug that a CPU run never shows:

* **mixing devices**: a CPU tensor (of rank >= 1) or a CPU ``torch.Generator`` handed to an op
  on GPU tensors raises on CUDA (``torch.multinomial(cuda_probs, generator=cpu_generator)``,
  ``torch.gather(cuda_scores, 1, cpu_ids)``);
* **host syncs and uploads**: every ``.tolist()``, ``.item()``, ``int(t)`` or ``.cpu()`` of a GPU
  tensor waits for the whole queue of GPU work, and every ``torch.as_tensor(host_data,
  device="cuda")`` is a separate host-to-device copy. Either, a few times per step, eats a
  large part of what a 2-5 ms compiled forward leaves for speculation.

:class:`SimulatedDevice` makes both visible on a CPU. Inside it, a model moved there with
:meth:`SimulatedDevice.adopt` has parameters that report ``device(type='cuda')``; so does
everything computed from them and every tensor a factory call creates "on CUDA" (a
:class:`~torch.overrides.TorchFunctionMode` sees factory calls: ``torch.arange(..., device=d)``,
``torch.as_tensor(data, device=d)``, ``Generator(device=d)`` ...). Values are computed on the
CPU as usual, so results are exactly those of a CPU run. Mixing a simulated-device tensor with a
CPU tensor of rank >= 1, or with a CPU generator, raises as CUDA would. Reading a simulated tensor
on the host counts a **sync**; creating one from host data counts an **upload**; both are
attributed to the model's forward or to the code around it.

It is a test and benchmark tool: nothing in the decoding path imports it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["DeviceMixError", "SimulatedDevice", "SimulatedTensor", "TransferCounts"]

#: The device every simulated tensor reports.
SIMULATED = torch.device("cuda", 0)


class DeviceMixError(RuntimeError):
    """An op mixed simulated-device tensors with CPU tensors (or a CPU generator), which CUDA refuses."""


class SimulatedTensor(torch.Tensor):
    """A CPU tensor that says it lives on the simulated device (see the module docstring)."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return SIMULATED

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # printing reads the values: a sync
        return f"SimulatedTensor(shape={tuple(self.shape)}, dtype={self.dtype})"


class SimulatedGenerator(torch.Generator):
    """A CPU generator that reports the simulated device (``Generator(device="cuda")`` inside the mode)."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return SIMULATED


@dataclass
class TransferCounts:
    """Host syncs (a read of device values that waits for the device) and uploads (host data to the
    device), split by where they happened: inside the model's forward or in the code around it."""

    syncs: int = 0
    uploads: int = 0
    forward_syncs: int = 0
    forward_uploads: int = 0
    #: one short description per sync or upload outside the forward, for failure messages
    log: list[str] = field(default_factory=list)


def _is_sim(x: Any) -> bool:
    return isinstance(x, SimulatedTensor)


def _is_plain_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and not isinstance(x, SimulatedTensor)


def _wants_device(value: Any) -> bool:
    """Whether a ``device=`` argument names the simulated device."""
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.startswith("cuda")
    return isinstance(value, int) and not isinstance(value, bool)  # ``tensor.to(0)``: a CUDA ordinal


def _simulate(x: Any) -> Any:
    return x.as_subclass(SimulatedTensor) if _is_plain_tensor(x) else x


def _unsimulate(x: Any) -> Any:
    return x.as_subclass(torch.Tensor) if _is_sim(x) else x


# Reads that copy device values to the host and so wait for the device.
_SYNC_METHODS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.__int__,
    torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.__index__, torch.Tensor.__format__,
    torch.Tensor.__array__, torch.Tensor.nonzero, torch.nonzero, torch.masked_select, torch.Tensor.masked_select,
    torch.unique, torch.Tensor.unique, torch.equal, torch.Tensor.__complex__,
}
# Calls that return host data from a device tensor: their result is a plain CPU tensor or value.
_TO_HOST = {torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.tolist, torch.Tensor.item,
            torch.Tensor.__array__}
# Ops that only read metadata; they never mix devices or move data.
_METADATA = {torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel, torch.Tensor.__len__,
             torch.Tensor.stride, torch.Tensor.storage_offset, torch.Tensor.is_contiguous,
             torch.Tensor.element_size, torch.Tensor.data_ptr, torch.Tensor.untyped_storage}
# Ops where CUDA accepts a CPU index tensor (copying it implicitly, i.e. an upload).
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}


class SimulatedDevice(TorchFunctionMode):
    """The simulated device (see the module docstring).

    >>> sim = SimulatedDevice()
    >>> model = sim.adopt(model)          # parameters and buffers now report cuda:0
    >>> with sim, sim.patched_generator():
    ...     out = Decoder(model, tok).generate(prompt)
    >>> sim.counts.syncs, sim.counts.uploads
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts = TransferCounts()
        self._in_forward = 0

    # -- set-up -------------------------------------------------------------------------------

    def adopt(self, model: torch.nn.Module) -> torch.nn.Module:
        """Make ``model``'s parameters and buffers simulated-device tensors (in place), and count
        what its forwards do apart from the code around them."""
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is not None and not _is_sim(param):
                    module._parameters[name] = torch.nn.Parameter(
                        param.detach().as_subclass(SimulatedTensor), requires_grad=False)
            for name, buf in list(module._buffers.items()):
                if buf is not None and not _is_sim(buf):
                    module._buffers[name] = buf.as_subclass(SimulatedTensor)
        model.register_forward_pre_hook(lambda *_: self._nest_forward(1))
        model.register_forward_hook(lambda *_: self._nest_forward(-1))
        return model

    def _nest_forward(self, step: int) -> None:
        """Enter (``step=1``) or leave (``-1``) a forward of an adopted model."""
        self._in_forward += step

    @contextlib.contextmanager
    def patched_generator(self) -> Iterator[None]:
        """``torch.Generator(device="cuda")`` gives a generator that reports the simulated device
        (a CPU torch cannot make a real one); a generator made without a device stays a CPU one."""
        real = torch.Generator

        def make(device: Any = "cpu") -> torch.Generator:
            return SimulatedGenerator() if _wants_device(device) else real(device)

        torch.Generator = make  # type: ignore[assignment, misc]
        try:
            yield
        finally:
            torch.Generator = real  # type: ignore[misc]

    def reset_counts(self) -> None:
        self.counts = TransferCounts()

    # -- the mode -----------------------------------------------------------------------------

    def _count(self, kind: str, func: Callable) -> None:
        """Count a ``"sync"`` or an ``"upload"``, in the forward or around it (logged there)."""
        inside = self._in_forward > 0
        if kind == "sync":
            if inside:
                self.counts.forward_syncs += 1
            else:
                self.counts.syncs += 1
        elif inside:
            self.counts.forward_uploads += 1
        else:
            self.counts.uploads += 1
        if not inside:
            self.counts.log.append(f"{kind}: {getattr(func, '__qualname__', None) or getattr(func, '__name__', func)}")

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        leaves, _ = tree_flatten((args, kwargs))
        any_sim = any(_is_sim(x) for x in leaves)
        if func in _METADATA:
            return func(*args, **kwargs)

        if func is torch.Tensor.copy_ and len(args) > 1 and _is_sim(args[0]) != _is_sim(args[1]):
            # CUDA copies between host and device in place: an upload into a device buffer, or a read
            self._count("upload" if _is_sim(args[0]) else "sync", func)
            func(_unsimulate(args[0]), _unsimulate(args[1]), *args[2:], **kwargs)
            return args[0]

        generator = kwargs.get("generator")
        if generator is not None and any_sim and not isinstance(generator, SimulatedGenerator):
            raise DeviceMixError(f"{getattr(func, '__name__', func)}: a CPU generator was handed to an op on "
                                 "cuda tensors (CUDA refuses it: 'Expected a 'cuda' device type for generator')")

        # Where the result goes: a device named cuda (factory calls, .to, .cuda), or host reads.
        to_device = False
        if "device" in kwargs and _wants_device(kwargs["device"]):
            kwargs["device"] = torch.device("cpu")
            to_device = True
        if func in (torch.Tensor.to, torch.Tensor.cuda):
            if func is torch.Tensor.cuda:
                func, args, to_device = torch.Tensor.to, (args[0], "cpu"), True
            elif len(args) > 1 and _wants_device(args[1]):
                args = (args[0], torch.device("cpu"), *args[2:])
                to_device = True
            elif len(args) > 1 and isinstance(args[1], torch.Tensor):
                to_device = to_device or _is_sim(args[1])
            if not to_device and len(args) > 1 and isinstance(args[1], (str, torch.device)) and any_sim:
                # ``.to("cpu")``: a download
                self._count("sync", func)
                return _unsimulate(func(*[_unsimulate(a) for a in args], **kwargs))

        if any_sim and func not in _INDEXING and func is not torch.Tensor.to:
            shapes = [tuple(x.shape) for x in leaves if _is_plain_tensor(x) and x.dim() >= 1]
            if shapes:
                raise DeviceMixError(f"{getattr(func, '__name__', func)}: cuda tensors mixed with CPU tensors of "
                                     f"shape {shapes} (CUDA raises 'Expected all tensors to be on the same device')")
        if any_sim and func in _INDEXING and any(_is_plain_tensor(x) and x.dim() >= 1 for x in leaves[1:]):
            self._count("upload", func)  # CUDA copies a CPU index tensor to the device first

        if any_sim and func in _SYNC_METHODS:
            self._count("sync", func)
        if to_device:
            source = args[0] if func is torch.Tensor.to else None
            from_host = (isinstance(source, torch.Tensor) and not _is_sim(source)) or (
                func in (torch.tensor, torch.as_tensor, torch.asarray, torch.from_numpy) and not any_sim)
            if from_host:
                self._count("upload", func)

        plain_args = tree_map(_unsimulate, args)
        plain_kwargs = tree_map(_unsimulate, kwargs)  # (a simulated generator is a CPU one underneath)
        out = func(*plain_args, **plain_kwargs)
        if (any_sim or to_device) and func not in _TO_HOST:
            return tree_map(_simulate, out)  # (``__setitem__``'s ``None`` stays ``None``)
        return out
