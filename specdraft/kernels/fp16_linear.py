"""A linear layer on FBGEMM's float16-weight GEMM, used only where float16 holds the weights exactly.

Why
    On an x86 CPU without AVX512-BF16, a bfloat16 ``nn.Linear`` has no fast kernel: measured on a
    2-core AMD EPYC (AVX2) with Qwen2.5-0.5B, one token costs 155 ms and 16 tokens 1.6 s -- every
    row of a tree forward costs a whole extra step, so speculation cannot pay. FBGEMM (in every
    x86 PyTorch wheel, behind ``torch.ops.quantized.linear_dynamic_fp16``) keeps the weight as
    float16 packed once for its small-batch kernel, converts it to float32 in registers and
    accumulates in float32: reading half the bytes of float32 and streaming the weight once per
    block of up to six rows, so one to six rows cost about the same.

Why it is exact
    A bfloat16 (or float16) weight has 8 (11) significant bits, float16 has 11: every such weight
    whose exponent fits float16's range is a float16 number, and converting it loses nothing.
    Where a row of the weight does not fit (values above 65504, or so small that float16 would
    round them), the row is multiplied by a power of two that brings its largest value to
    ``[2**14, 2**15)`` -- exact in binary floating point -- and the row's outputs are multiplied
    back by the inverse power of two (also exact: scaling by a power of two commutes with
    rounding). A float32 weight with up to ~22 significant bits (what dequantizing an 8-bit GGUF
    file gives) is the exact sum of two float16 numbers ``hi + lo``; the layer then packs
    ``[hi | lo]`` and feeds ``[x | x]``, one GEMM over twice the inner length whose exact value is
    ``x @ W.T`` (4 bytes per weight, as float32). The inputs go to float32 (exact from bfloat16
    and float16), every product is formed in float32 by fused multiply-adds, and the sums are
    float32 as in the stock kernels. What remains is the order of the additions, which differs
    between any two GEMM kernels (and between a one-row and a many-row call of the same one): the
    same kind of difference as ``cpu_kernels="packed"``. Every weight is checked once, when it
    is packed, by unpacking what FBGEMM stored and comparing it with the (scaled, split) original
    bit for bit; a layer that cannot be stored exactly is reported and not converted
    (:func:`exact_fp16_weight`).

This module knows nothing of models or decoders: :mod:`specdraft.cpu_kernels` builds one
:class:`Fp16Linear` per eligible ``nn.Linear`` and swaps them in around a forward.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

#: Activation dtypes whose values float32 holds exactly (float64 inputs would be rounded).
FP16_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: A scaled row's largest magnitude lands in ``[2**(TOP_EXPONENT - 1), 2**TOP_EXPONENT)``: as far
#: from float16's smallest steps (2**-24) as its largest finite value (65504) allows.
TOP_EXPONENT = 15


@functools.lru_cache(maxsize=None)
def fbgemm_problem() -> str | None:
    """Why FBGEMM's float16-weight linear cannot run here (``None``: it can). Needs a torch build
    with FBGEMM (the x86 wheels) and a CPU it supports (AVX2 or later); only the op itself knows,
    so a tiny weight is packed and run once and the answer kept."""
    quantized = getattr(torch.ops, "quantized", None)
    if quantized is None or not hasattr(quantized, "linear_prepack_fp16") \
            or not hasattr(quantized, "linear_dynamic_fp16"):
        return f"torch {torch.__version__} has no quantized::linear_dynamic_fp16 op"
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return (f"torch {torch.__version__} on this machine has no FBGEMM engine "
                f"(engines: {torch.backends.quantized.supported_engines}; FBGEMM needs an x86 CPU with AVX2)")
    try:
        packed = torch.ops.quantized.linear_prepack_fp16(torch.eye(8), None)
        out = torch.ops.quantized.linear_dynamic_fp16(torch.ones(1, 8), packed)
    except RuntimeError as exc:
        return str(exc).strip().splitlines()[0]
    if not torch.equal(out, torch.ones(1, 8)):
        return f"FBGEMM's float16 linear computed {out.tolist()} for an identity layer"
    return None


def _is_fp16_exact(weight: torch.Tensor) -> torch.Tensor:
    """Per row: does float16 hold every value of this float32 weight exactly?"""
    return (weight.to(torch.float16).to(torch.float32) == weight).all(dim=1)


def exact_fp16_weight(weight: torch.Tensor, max_terms: int = 2) -> tuple[torch.Tensor, torch.Tensor | None, int] | None:
    """``(w, row_scale, terms)``: a float32 matrix every value of which float16 holds exactly, with

    * ``terms == 1``: ``w == weight * row_scale[:, None]``;
    * ``terms == 2``: ``w == [hi | lo]`` (``[out, 2 * in]``) with ``hi + lo == weight * row_scale[:, None]``
      -- a weight with up to ~22 significant bits (float32 dequantized from an 8-bit GGUF, say)
      as the sum of two float16 numbers, so that ``[x | x] @ w.T`` is ``x @ weight.T`` summed in
      another order;

    exactly, bit for bit. ``row_scale`` holds powers of two (``None`` when no row needs one).
    ``None`` when neither fits in ``max_terms`` (a row spanning more than float16's ~40 binades,
    non-finite values, more bits than two float16 numbers hold, or a dtype float32 does not hold
    exactly).
    """
    if weight.dtype not in FP16_INPUT_DTYPES:
        return None
    w = weight.detach().to(torch.float32)
    if not bool(torch.isfinite(w).all()):
        return None
    if bool(_is_fp16_exact(w).all()):
        return w, None, 1
    # per-row power of two bringing each row's largest magnitude to [2**14, 2**15)
    top = w.abs().amax(dim=1)
    _, exponent = torch.frexp(top)  # top = m * 2**exponent, m in [0.5, 1)
    shift = torch.where(top > 0, TOP_EXPONENT - exponent, torch.zeros_like(exponent))
    row_scale = torch.ldexp(torch.ones_like(top), shift.clamp(-120, 120))
    scaled = w * row_scale[:, None]
    if not torch.equal(scaled / row_scale[:, None], w):  # an overflow or underflow: not exact
        return None
    if bool(_is_fp16_exact(scaled).all()):
        return scaled, row_scale, 1
    if max_terms < 2:
        return None
    hi = scaled.to(torch.float16).to(torch.float32)
    lo = scaled - hi  # exact: the bits of scaled below hi's last one
    if not bool(_is_fp16_exact(lo).all()) or not torch.equal(hi + lo, scaled):
        return None
    return torch.cat([hi, lo], dim=1), row_scale, 2


class LinearStandIn(nn.Module):
    """A stand-in for one ``nn.Linear`` during a forward, on a copy of its weight packed for a
    faster kernel (:class:`Fp16Linear`, :class:`~specdraft.kernels.cpu_kernels.PackedLinear`, and
    :class:`~specdraft.kernels.cpu_kernels.MixedLinear` over one of them).

    The original module is kept outside torch's module tree (so it is not a child of this one and
    the swap never shows it twice); inputs the packed kernel must not take go to it."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.__dict__["original"] = linear  # not a registered submodule on purpose
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self._packed_version: tuple[int, int] | None = None  # the original weight's when packed

    def refresh(self) -> bool:
        """Pack the original weight if it was changed in place or replaced since packing (or never
        packed); ``False`` when the new weight cannot be packed (the caller must then stop using this)."""
        weight = self.original.weight
        version = (weight.data_ptr(), weight._version)
        if version != self._packed_version:
            if not self._pack(weight):
                return False
            self._packed_version = version
        return True

    def _pack(self, weight: torch.Tensor) -> bool:
        """Pack ``weight`` for the kernel; ``False`` where it cannot be."""
        raise NotImplementedError

    def goes_to_original(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes to the original layer: another dtype than the weight's, another device
        than the CPU, or a forward that needs gradients."""
        weight = self.original.weight
        return x.dtype != weight.dtype or x.device.type != "cpu" or (
            torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))


class Fp16Linear(LinearStandIn):
    """A stand-in for one ``nn.Linear`` during a forward: the same weight as exact float16, packed
    for FBGEMM. Build it with :meth:`build`, which returns ``None`` for a weight float16 cannot
    hold exactly. Inputs the kernel must not take (float64, another dtype than the weight's, a
    tensor that needs gradients) go to the original."""

    @classmethod
    def build(cls, linear: nn.Linear) -> "Fp16Linear | None":
        """The packed stand-in of ``linear``, or ``None`` where float16 cannot hold its weight
        exactly (the caller keeps the stock layer there)."""
        layer = cls(linear)
        return layer if layer.refresh() else None

    def _pack(self, weight: torch.Tensor) -> bool:
        exact = exact_fp16_weight(weight)
        if exact is None:
            return False
        weight32, row_scale, terms = exact
        bias = self.original.bias
        bias32 = None if bias is None else bias.detach().to(torch.float32)
        if bias32 is not None and row_scale is not None:
            bias32 = bias32 * row_scale  # exact: a power of two per output
        with torch.no_grad():
            self.packed = torch.ops.quantized.linear_prepack_fp16(weight32, bias32)
            stored, _ = torch.ops.quantized.linear_unpack_fp16(self.packed)
        if not torch.equal(stored.to(torch.float32), weight32):  # what FBGEMM kept, bit for bit
            raise RuntimeError(f"FBGEMM stored a {tuple(weight32.shape)} weight inexactly although float16 holds it; "
                               "use cpu_kernels='stock'")
        #: per-output power of two that undoes the row scaling (None: no row was scaled)
        self.inverse_scale = None if row_scale is None else (1.0 / row_scale)
        #: float16 numbers summed per weight (2: the input goes in twice, ``[x | x]``)
        self.terms = terms
        #: bytes of the packed float16 copy (what this layer adds to the model's memory)
        self.nbytes = weight32.numel() * 2
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in FP16_INPUT_DTYPES or self.goes_to_original(x):
            return self.original(x)
        flat = x.reshape(-1, self.in_features).to(torch.float32)
        if self.terms == 2:
            flat = torch.cat([flat, flat], dim=1)
        out = torch.ops.quantized.linear_dynamic_fp16(flat, self.packed)
        if self.inverse_scale is not None:
            out.mul_(self.inverse_scale)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
