"""``Format``: what one quantized format is, asked by every layer instead of its name.

The public names ("fp8_e4m3", "mxfp8", ...) stay strings (``lp.quantize(x, "mxfp8")``,
``QuantizedTensor.fmt``, a recipe's ``OperandSpec.fmt``); ``lp_jax.numerics.registry``
turns one into its object. The object holds the facts a name used to decide (elements,
blocks, scales, bytes per element, the Pallas kernel and the GEMM it feeds, how tables and
figures name and colour it) and does what differs per format: quantize, decode the block
scales, dequantize, and quantize-and-decode a GEMM operand used at once. Each scheme is a
subclass in a module of its own (``fp8_per_tensor``, ``fp8_block``, ``mxfp8``, ``nvfp4``),
so a new format is one new object there, added to the registry.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from lp_jax.numerics import formats as F
from lp_jax.numerics.quantized_tensor import QuantizedTensor


@dataclasses.dataclass(frozen=True)
class FormatVariant:
    """A variant of a format that a ``lp.quantize`` option selects: the same name, elements
    and scale types, other scale values (NVFP4's 4/6 block scales, ``block_scale_search``)."""

    option: str  # the option's value: lp.quantize(..., block_scale_search=option)
    name: str  # how runs and figures name the variant
    label: str
    pallas: bool = False  # whether a Pallas kernel quantizes the variant


@dataclasses.dataclass(frozen=True)
class Format:
    """One quantized format. Subclasses implement the scheme's quantizer and decoders."""

    # The implementation the scheme's formats share (FP8-CS's two element types share one):
    # layers above numerics that keep per-format implementations of their own (the Pallas
    # kernels, the quantization statistics) register them under it.
    scheme: ClassVar[str]
    # Whether ``values_in_place`` decodes 1-D blocks along a 2-D operand's first axis in the
    # operand's own layout (no transposed pass).
    decodes_in_place: ClassVar[bool] = False

    name: str  # the public name
    label: str  # how tables, figures and messages name runs in it (FP8-CS: both element types)
    color: str  # its runs' colour in figures (matplotlib)
    element: type  # the element dtype of the data
    block: int | None  # elements per scale along the blocked axis; None: one scale per tensor
    scale: type | None  # dtype of the block scales (None: an FP32 tensor scale only)
    tensor_scale: bool  # an FP32 per-tensor scale (FP8-CS's only scale; NVFP4's second level)
    tiles: bool = False  # block x block tiles over the last two axes (block_2d) are defined
    stochastic: bool = False  # stochastic rounding is defined
    variants: tuple[FormatVariant, ...] = ()
    pallas: bool = False  # a Pallas kernel quantizes it (lp.quantize(..., impl="pallas"))
    # Whether impl="auto" runs that kernel in a program traced for a Blackwell GPU: where its
    # layer moved fewer HBM bytes in fewer kernels with it than with XLA's fusions (the
    # plan's count of a deviceless compile, not a GPU timing; docs/plan_results.md, "One layer's cost").
    auto_pallas: bool = False
    gemm: str | None = None  # the GEMM backend built for it (recipes.NATIVE_BACKEND)
    hopper_gemm: str | None = None  # its own Hopper (sm_90) GEMM, where it has one

    @property
    def max(self) -> float:
        return F.max_of(self.element)

    @property
    def per_tensor(self) -> bool:
        return self.block is None

    @property
    def value_bytes(self) -> float:
        """Bytes per element of the data (E2M1: half a byte, packed two per byte)."""
        return jnp.finfo(self.element).bits / 8

    def scale_bytes(self, tiles: bool = False) -> float:
        """Bytes of block scales per element, for 1-D blocks or block x block tiles (0 per tensor)."""
        if self.block is None:
            return 0.0
        return np.dtype(self.scale).itemsize / (self.block * self.block if tiles else self.block)

    def copy_bytes(self, tiles: bool = False) -> float:
        """Bytes per element of one quantized copy: its values and its block scales."""
        return self.value_bytes + self.scale_bytes(tiles)

    @property
    def block_scale_searches(self) -> tuple[str, ...]:
        return tuple(v.option for v in self.variants)

    def variant(self, option: str) -> FormatVariant:
        for v in self.variants:
            if v.option == option:
                return v
        raise ValueError(f"format {self.name!r} has no variant {option!r}; its variants: "
                         f"{self.block_scale_searches}")

    def native_gemm(self, cuda_major: int | None) -> str | None:
        """The GEMM backend "auto" runs it on in a program lowered for a GPU of that compute
        capability major (``lp_jax.gemm.backends.cuda_native``)."""
        return self.hopper_gemm if cuda_major == 9 and self.hopper_gemm else self.gemm

    def pallas_for(self, block_scale_search: str | None = None) -> bool:
        """Whether a Pallas kernel quantizes it, or its variant ``block_scale_search`` (False
        for an option it does not have)."""
        if not block_scale_search:
            return self.pallas
        return any(v.pallas for v in self.variants if v.option == block_scale_search)

    # ------------------------------------------------------------------ what a scheme does

    def quantize(self, xf, axis: int, **options) -> QuantizedTensor:
        """``xf`` (float32, the input widened exactly) quantized along ``axis`` (non-negative);
        ``options``: ``lp.quantize``'s keyword arguments, already checked. Each scheme reads
        the ones defined for it."""
        raise NotImplementedError

    def block_values(self, q: QuantizedTensor):
        """float32 values of q without its tensor scale (the data times its block scales)."""
        raise NotImplementedError

    def dequantize(self, q: QuantizedTensor):
        """float32 values of q, the shape of the original tensor."""
        values = self.block_values(q)
        # NVFP4: q * s_b is exact; S_dec last, as the GEMM applies it after accumulation.
        return values if q.global_scale is None else F.mul(values, q.global_scale)

    def values(self, t, axis: int, **options):
        """(values, factor): the exact dequantized values of t quantized along ``axis``,
        computed without packed bytes, the blocked axis moved last, over the tensor factor
        (None where there is none) the GEMM applies to its FP32 result
        (``lp_jax.numerics.decoded``)."""
        raise NotImplementedError

    def values_in_place(self, t, rounding="nearest", key=None):
        """``values(t, 0, ...)`` of a 2-D t laid out as t is (``decodes_in_place``)."""
        raise NotImplementedError(f"format {self.name!r} does not decode in place")
