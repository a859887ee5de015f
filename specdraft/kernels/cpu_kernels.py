"""CPU kernels for the verification forward: linear layers with weights packed once.

Two packed paths, chosen with ``Decoder(cpu_kernels=...)`` (the default, ``"auto"``, measures
them and uses the cheaper one at the forward widths where it beats stock, through
:class:`MixedLinear`; see :mod:`specdraft.kernel_costs`):

``"packed"``
    oneDNN, float32 or bfloat16 weights in oneDNN's blocked layout (described below).
``"fbgemm"``
    FBGEMM's float16-weight GEMM, for models whose weights float16 holds exactly -- every
    bfloat16 and float16 checkpoint, and float32 models loaded from one; float32 weights with up
    to ~22 significant bits (dequantized 8-bit GGUF files) as the sum of two float16 numbers --
    with float32 accumulation. On CPUs without AVX512-BF16 it is the only fast bfloat16 path: see
    :mod:`specdraft.fp16_linear` for why it is exact and what it costs.

Both are swapped in the same way (:class:`PackedModel`); the rest of this docstring says it for
oneDNN.

Why
    Speculation pays when a forward of ``k`` new tokens costs about what a one-token forward does.
    On a CPU a forward reads every weight once (2 GB for a 0.5B model in float32) and does about
    ``k`` GFLOP, so up to ``k`` of 16 or so it should cost about the same as ``k = 1``. Stock
    ``nn.Linear`` does not get there: float32 goes to the BLAS ``sgemm``, which on some CPUs (MKL on
    AMD) takes slow paths for small row counts, and bfloat16 goes to oneDNN but reorders the weight
    into oneDNN's blocked layout on every call. Here each weight is reordered **once** into that
    layout (``torch.ops.mkldnn._reorder_linear_weight``, the op torch's own compiler uses when it
    freezes a CPU model) and every call runs ``torch.ops.mkldnn._linear_pointwise`` on it.

What it changes, and what it does not
    Nothing of the user's model is patched. :class:`PackedModel` builds a :class:`PackedLinear`
    per ``nn.Linear`` (the tied ``lm_head`` included) and :meth:`PackedModel.swapped` puts them in
    place (an attribute assignment on the parent module, what ``set_submodule`` does) for the duration of one forward, then puts the very same
    ``nn.Linear`` objects back (reference-counted, so forwards of several decoders sharing one
    model in threads nest correctly). Between forwards the model is exactly as it was: same
    modules, same parameters. A ``model.generate`` running in *another thread at the same moment*
    as one of our forwards would see the packed layers too (same math, oneDNN's rounding).

Memory
    The packed weights are a second copy of every linear weight in the model's dtype (about the
    size of the checkpoint: 2 GB for a 0.5B model in float32, 1 GB in bfloat16; ``"fbgemm"``
    keeps float16, 1 GB whatever the model's dtype). It is made when
    the decoder is built and freed by ``Decoder.close()`` or when the decoder is collected.
    Decoders over one model share one packed copy.

Exactness
    oneDNN adds the products in another order than the stock kernel, so logits differ in the last
    bits (about 1e-6 relative in float32). Greedy output can then differ from the stock
    ``model.generate`` where two tokens tie to within that noise -- exactly as stock kernels
    already differ between a one-token and a many-token forward. Sampling keeps its law given the
    logits it computes. See ``docs/cpu-fast-path.md`` for measured rates.

Weights changed after packing (fine-tuning, ``load_state_dict``) are noticed through the
parameter's version counter and repacked before the next forward.
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from .fp16_linear import FP16_INPUT_DTYPES, Fp16Linear, LinearStandIn, fbgemm_problem

#: What ``Decoder(cpu_kernels=...)`` accepts: ``"auto"`` picks among the others per forward width
#: from what they cost on this machine (:mod:`specdraft.kernel_costs`).
CPU_KERNELS = ("auto", "stock", "packed", "fbgemm")

#: The packed paths (each holds a second copy of the linear weights).
PACKED_KINDS = ("packed", "fbgemm")

#: Memory left free when packing: packing is refused when the copy would leave less than this
#: (or a tenth of what is available, whichever is more) for the rest of the process.
MEMORY_RESERVE = 512 * 2**20

#: Dtypes oneDNN's packed linear runs on every x86 CPU (float16 needs AVX512-FP16 or AVX-NE-CONVERT;
#: float64 is not supported by oneDNN at all).
PACKED_DTYPES = (torch.float32, torch.bfloat16)

#: Row count the weights are packed for. oneDNN runs any row count on them; 16 measured best for
#: the widths a tree forward has (1 to 32 rows) and no worse for a long prefill.
BATCH_HINT = 16


class CpuKernelError(ValueError):
    """``cpu_kernels="packed"`` cannot run for this model here; the message says why."""


def packed_kernels_available() -> bool:
    """Whether this torch build has oneDNN's packed linear ops."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


@functools.lru_cache(maxsize=None)
def packed_dtype_problem(dtype: torch.dtype) -> str | None:
    """Why oneDNN cannot pack ``dtype`` weights on this CPU (``None``: it can). Packing needs
    instructions the CPU may lack (bfloat16: AVX512 BW/VL/DQ or AVX-NE-CONVERT), which only the op
    itself knows, so a tiny weight is packed once per dtype and the answer kept."""
    if not packed_kernels_available():
        return f"torch {torch.__version__} is built without oneDNN's packed linear"
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), BATCH_HINT)
    except RuntimeError as exc:
        return str(exc).strip().splitlines()[0]
    return None


def check_cpu_kernels(model: Any, kernels: str) -> None:
    """Raise a clear error when ``kernels`` is not a choice or cannot run for ``model`` here.
    (Whether ``"fbgemm"`` can hold the weights exactly is known only once they are packed:
    :class:`PackedModel` checks that.)"""
    if kernels not in CPU_KERNELS:
        raise ValueError(f"cpu_kernels must be one of {list(CPU_KERNELS)}, got {kernels!r}")
    if kernels in ("stock", "auto"):
        return
    device = getattr(model, "device", torch.device("cpu"))
    if torch.device(device).type != "cpu":
        raise CpuKernelError(f"cpu_kernels={kernels!r} is for models on the CPU, this one is on {device}; "
                             "use cpu_kernels='stock'")
    dtypes = {m.weight.dtype for m in model.modules() if isinstance(m, nn.Linear)}
    if kernels == "fbgemm":
        problem = fbgemm_problem()
        if problem is not None:
            raise CpuKernelError(f"cpu_kernels='fbgemm' cannot run here ({problem}); use cpu_kernels='stock'")
        bad = sorted(str(d).removeprefix("torch.") for d in dtypes if d not in FP16_INPUT_DTYPES)
        if bad:
            raise CpuKernelError(f"cpu_kernels='fbgemm' runs bfloat16, float16 and float32 models (it accumulates in "
                                 f"float32, which would round a float64 model), this one has {bad}; "
                                 "use cpu_kernels='stock'")
        return
    if not packed_kernels_available():
        raise CpuKernelError(f"cpu_kernels='packed' needs torch built with oneDNN (torch.ops.mkldnn._linear_pointwise); "
                             f"torch {torch.__version__} here has none; use cpu_kernels='stock'")
    bad = sorted(str(d).removeprefix("torch.") for d in dtypes if d not in PACKED_DTYPES)
    if bad:
        raise CpuKernelError(f"cpu_kernels='packed' supports float32 and bfloat16 weights (oneDNN has no float64, and "
                             f"float16 needs AVX512-FP16), this model has {bad}; use cpu_kernels='stock'")
    for dtype in sorted(dtypes, key=str):
        problem = packed_dtype_problem(dtype)
        if problem is not None:
            name = str(dtype).removeprefix("torch.")
            hint = ", or cpu_kernels='fbgemm'" if name == "bfloat16" and fbgemm_problem() is None else ""
            raise CpuKernelError(f"cpu_kernels='packed' cannot pack {name} weights on this CPU (oneDNN: {problem}); "
                                 f"use cpu_kernels='stock'{hint}{', or float32 weights' if name != 'float32' else ''}")


class PackedLinear(LinearStandIn):
    """A stand-in for one ``nn.Linear`` during a forward: the same weight, packed for oneDNN.
    Inputs the packed kernel cannot take (another dtype, a tensor that needs gradients) go to the
    original."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        self.refresh()

    def _pack(self, weight: torch.Tensor) -> bool:
        """Pack ``weight`` (always possible for oneDNN: ``True``)."""
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
        #: bytes of the packed copy (what this layer adds to the model's memory)
        self.nbytes = weight.numel() * weight.element_size()
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.goes_to_original(x):
            return self.original(x)
        bias = self.original.bias
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, None if bias is None else bias.detach(),
                                                 "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)


def linear_modules(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The ``(name, module)`` of every ``nn.Linear`` inside ``model`` (the layers a packed path replaces)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and name]


def packing_bytes(model: nn.Module, kind: str) -> int:
    """Bytes a packed copy of ``model``'s linear weights takes for ``kind`` (an upper bound for
    ``"fbgemm"``: a float32 weight may need two float16 terms, 4 bytes, where one suffices)."""
    weights = [module.weight for _, module in linear_modules(model)]
    if kind == "packed":
        return sum(weight.numel() * weight.element_size() for weight in weights)
    return sum(weight.numel() * (2 if weight.element_size() <= 2 else 4) for weight in weights)


def proc_field(path: str, name: str) -> str | None:
    """What follows the colon on the first line of ``path`` (a Linux ``/proc`` file) that starts
    with ``name`` (in lower case); ``None`` where there is none or the file cannot be read."""
    try:
        with open(path) as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.lower().startswith(name)), None)
    except OSError:
        return None


def available_memory() -> int | None:
    """Bytes the system can still hand out without swapping (Linux ``MemAvailable``); ``None``
    where it cannot be read (packing is then not refused for memory)."""
    kilobytes = (proc_field("/proc/meminfo", "memavailable:") or "").split(" ")[0]  # e.g. "1234 kB"
    return int(kilobytes) * 1024 if kilobytes.isdigit() else None


def memory_problem(model: nn.Module, kind: str) -> str | None:
    """Why a packed copy of ``model``'s weights for ``kind`` would not fit (``None``: it fits)."""
    need, free = packing_bytes(model, kind), available_memory()
    if free is None:
        return None
    reserve = max(MEMORY_RESERVE, free // 10)
    if need + reserve <= free:
        return None
    return (f"its packed weights need {need / 2**30:.2f} GiB more memory and {free / 2**30:.2f} GiB is available "
            f"(keeping {reserve / 2**30:.2f} GiB free)")


class MixedLinear(LinearStandIn):
    """A packed layer that runs only on the row counts its plan gives it, the stock kernel on the
    others: ``plan[r - 1]`` says whether a forward of ``r`` rows runs packed (past the plan's end,
    its last entry). Every linear layer of one forward sees the same row count, so the whole
    forward runs on one path; ``cpu_kernels="auto"`` uses it to take the cheaper path per width."""

    def __init__(self, fast: "PackedLinear | Fp16Linear", plan: tuple[bool, ...]) -> None:
        if not plan:
            raise ValueError("a plan needs an entry for at least one row count")
        super().__init__(fast.original)
        self.__dict__["fast"] = fast  # not registered, as the original is not
        self.plan = plan

    def refresh(self) -> bool:
        """Repack the fast layer where its weight changed (:meth:`LinearStandIn.refresh`)."""
        return self.fast.refresh()

    @property
    def nbytes(self) -> int:
        return self.fast.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, self.in_features)
        if rows and self.plan[min(rows, len(self.plan)) - 1]:
            return self.fast(x)
        return self.original(x)


class PackedModel:
    """The packed stand-ins of every ``nn.Linear`` of one model, and the swap around a forward.

    ``kind`` is ``"packed"`` (oneDNN, :class:`PackedLinear`) or ``"fbgemm"`` (float16 weights,
    :class:`~specdraft.fp16_linear.Fp16Linear`). With ``"fbgemm"`` a layer whose weight float16
    cannot hold exactly keeps its stock kernel: it is listed in :attr:`stock_layers` and named in
    a warning; a model with no such layer at all is refused. Build it with :func:`packed_model`
    (which shares one per model and kind between decoders).
    """

    def __init__(self, model: nn.Module, kind: str = "packed", plan: tuple[bool, ...] | None = None) -> None:
        if kind not in PACKED_KINDS:
            raise ValueError(f"kind must be one of {list(PACKED_KINDS)}, got {kind!r}")
        self.kind = kind
        #: per row count, whether a forward runs packed (``None``: always; see :class:`MixedLinear`)
        self.plan = plan
        self._model = weakref.ref(model)
        if any(isinstance(module, LinearStandIn) for module in model.modules()):
            raise RuntimeError(f"cannot pack this model's weights while another decoder runs a forward of it on packed "
                               f"kernels; decoders sharing one model across threads must use the same cpu_kernels "
                               f"(this one: {kind!r})")
        linears = linear_modules(model)
        #: names of the linear layers left on the stock kernel (float16 cannot hold their weights)
        self.stock_layers: list[str] = []
        self.layers: dict[str, PackedLinear | Fp16Linear | MixedLinear] = {}
        for name, module in linears:
            layer = PackedLinear(module) if kind == "packed" else Fp16Linear.build(module)
            if layer is None:
                self.stock_layers.append(name)
            else:
                self.layers[name] = layer if plan is None else MixedLinear(layer, plan)
        if linears and not self.layers:
            raise CpuKernelError(
                f"cpu_kernels={kind!r} needs weights that float16 holds exactly, alone or as a sum of two (bfloat16 "
                f"or float16 checkpoints, float32 loaded from one or dequantized from 8-bit weights); none of the "
                f"{len(linears)} linear layers of this model has such weights (float32 with more significant bits); "
                "load it in bfloat16, or use cpu_kernels='packed' or 'stock'")
        if self.stock_layers:
            warnings.warn(f"cpu_kernels={kind!r}: {len(self.stock_layers)} of {len(linears)} linear layers keep the "
                          f"stock kernel, float16 cannot hold their weights exactly (e.g. {self.stock_layers[:3]})",
                          RuntimeWarning, stacklevel=3)
        # (parent module, attribute name, packed layer), resolved once: the swap runs twice a forward
        self._slots = [(model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2], layer)
                       for name, layer in self.layers.items()]
        self._depth = 0  # forwards in flight (threads): the first swaps in, the last swaps back
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Extra memory held by the packed weights."""
        return sum(layer.nbytes for layer in self.layers.values())

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """Run the body with the packed layers in the model; the original ``nn.Linear`` objects
        are back in place when it ends, even on an error."""
        model = self._model()
        if model is None:
            raise RuntimeError("the model these packed weights belong to no longer exists")
        with self._lock:
            if self._depth == 0:
                current = [getattr(parent, child) for parent, child, _ in self._slots]
                if any(isinstance(now, LinearStandIn) for now in current):
                    raise RuntimeError(f"another decoder is running a forward of this model on other packed kernels "
                                       f"right now; decoders sharing one model across threads must use the same "
                                       f"cpu_kernels (this one: {self.kind!r})")
                moved = [child for (_, child, layer), now in zip(self._slots, current) if now is not layer.original]
                if moved:
                    raise RuntimeError(f"the model's linear layers changed since their weights were packed ({moved[:3]} "
                                       "replaced); build a new Decoder (or packed_model) for the changed model")
                stale = [name for name, layer in self.layers.items() if not layer.refresh()]
                if stale:
                    raise CpuKernelError(f"the weights of {stale[:3]} changed since they were packed and float16 no "
                                         f"longer holds them exactly; build a new Decoder with cpu_kernels='stock'")
                for parent, child, layer in self._slots:
                    setattr(parent, child, layer)
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    for parent, child, layer in self._slots:
                        setattr(parent, child, layer.original)


_SHARED: "weakref.WeakValueDictionary[tuple[int, str, tuple[bool, ...] | None], PackedModel]" = \
    weakref.WeakValueDictionary()
_SHARED_LOCK = threading.Lock()


def packed_model(model: nn.Module, kind: str = "packed", plan: tuple[bool, ...] | None = None) -> PackedModel:
    """The :class:`PackedModel` of ``model`` for ``kind`` (``"packed"`` or ``"fbgemm"``) and
    ``plan``: built on first use, shared by every decoder that holds it (one packed copy per model,
    kind and plan), freed when the last holder lets it go. A new copy that would not fit in the
    memory available is refused (:class:`CpuKernelError`, saying how much it needs)."""
    key = (id(model), kind, plan)
    with _SHARED_LOCK:
        packed = _SHARED.get(key)
        if packed is None or packed._model() is not model:  # none yet, or an id of a model since collected
            problem = memory_problem(model, kind) if kind in PACKED_KINDS else None
            if problem is not None:
                raise CpuKernelError(f"cpu_kernels={kind!r} cannot pack this model's weights here: {problem}; "
                                     "use cpu_kernels='stock'")
            packed = PackedModel(model, kind, plan=plan)
            _SHARED[key] = packed
        return packed

