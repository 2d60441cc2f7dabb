"""``lp_jax.quantize``: the public quantizer, run by XLA or by the Pallas kernels.

"xla" is ``lp_jax.numerics.quantize`` (the definition); "pallas" is ``lp_jax.kernels``
(Pallas Mosaic GPU, the same bits in fewer passes; interpreted on CPU); "auto" is "pallas"
for the formats of ``PALLAS_ON_GPU`` (those whose format object says ``auto_pallas``) in a
program traced for a Blackwell GPU and "xla" anywhere else (docs/backends.md).
"""
from __future__ import annotations

import jax.numpy as jnp

from lp_jax.kernels.api import quantize_pallas
from lp_jax.kernels.launch import compiled_for_major
from lp_jax.numerics.quantize import QuantizedTensor, as_quantizer_input, check_quantize_args, quantize_xla
from lp_jax.numerics.registry import REGISTRY, format_named, names_where
from lp_jax.recipes import QUANTIZE_IMPLS, check_choice

# Formats whose kernels "auto" runs in a program traced for a Blackwell GPU (``auto_pallas``
# on the format object): in Llama 3 8B's layer compiled for a GB200, their layer moved fewer
# HBM bytes in fewer kernels with the Pallas kernels than with XLA's fusions (MXFP8 23.9 GB
# in 217 kernels against 30.8 GB in 258, NVFP4 24.6 in 434 against 45.2 in 502; docs/plan_results.md,
# "One layer's cost"): the plan's count of a deviceless compile, not a timing on a GPU.
# FP8-CS moved fewer bytes in more kernels (247 against 195: its amax is a pass of its own),
# so XLA keeps it. Hopper, where these formats' GEMMs are XLA's FP32 expansion, was not
# measured: XLA's quantizers there.
PALLAS_ON_GPU: tuple[str, ...] = names_where(lambda f: f.auto_pallas)
PALLAS_MIN_MAJOR = 10


def resolve_impl(impl: str, fmt: str | None = None, *, tensor_amax=None, block_scale_search=None) -> str:
    """"xla" or "pallas" for ``impl``. "auto" is "pallas" for a format of ``PALLAS_ON_GPU``
    traced for a Blackwell-or-later GPU, unless the call needs what only XLA does (a given
    ``tensor_amax``, 4/6 block scales); "xla" otherwise."""
    check_choice("impl", impl, QUANTIZE_IMPLS)
    if impl != "auto":
        return impl
    spec = REGISTRY.get(fmt) if isinstance(fmt, str) else None
    if (spec is None or not spec.auto_pallas or tensor_amax is not None
            or not spec.pallas_for(block_scale_search)):
        return "xla"
    major = compiled_for_major()
    return "pallas" if major is not None and major >= PALLAS_MIN_MAJOR else "xla"


def quantize(x, fmt, axis=-1, *, block_2d=False, rounding="nearest", key=None,
             scale_rule="rceil", impl="xla", tensor_amax=None, block_scale_search=None,
             metric="mae") -> QuantizedTensor:
    """Quantizes ``x`` (bf16 or f32, any rank) to ``fmt``, blocked along ``axis``.

    fmt: "fp8_e4m3" | "fp8_e5m2" (per-tensor current scaling; axis is ignored), "mxfp8"
    (32-element blocks, E8M0 scales; scale_rule "rceil" as TE, or OCP "floor"), "nvfp4"
    (16-element blocks or, with block_2d, 16x16 tiles over the last two axes; E4M3 block
    scales and a float32 tensor scale; rounding "nearest" or "stochastic" with key=).
    "fp8_block" (Transformer Engine's FP8 block scaling: 1x128 blocks along axis or, with
    block_2d, 128x128 tiles; E4M3 codes, float32 power-of-two scales, XLA only), or
    "fp8_block_e5m2" (the same with E5M2 codes: the gradients of its fp8_format "HYBRID").
    block_scale_search: None, or "4over6" for NVFP4 (each block scaled to 6 or to 4, whichever
    reconstructs it with the smaller error by ``metric``, "mae" or "mse"; XLA only).
    impl: "xla", "pallas" (the same bits; interpreted on CPU) or "auto".
    tensor_amax: max |x| of the whole tensor when x is one shard of it (reduced across the
    shards by the caller), for the per-tensor scales of fp8_e4m3/fp8_e5m2 and nvfp4.
    """
    if resolve_impl(impl, fmt, tensor_amax=tensor_amax, block_scale_search=block_scale_search) == "xla":
        return quantize_xla(x, fmt, axis, block_2d=block_2d, rounding=rounding, key=key,
                            scale_rule=scale_rule, tensor_amax=tensor_amax,
                            block_scale_search=block_scale_search, metric=metric)
    check_quantize_args(x, fmt, axis, block_2d, rounding, key, scale_rule, block_scale_search, metric)
    spec = format_named(fmt)
    if not spec.pallas:
        raise ValueError(f"fmt={fmt!r} has no Pallas quantization kernel; use impl='xla'")
    if not spec.pallas_for(block_scale_search):
        raise ValueError(f"block_scale_search={block_scale_search!r} has no Pallas quantization kernel; "
                         "use impl='xla'")
    if tensor_amax is not None:  # the kernels take their amax over what they are given
        raise ValueError("quantize(impl='pallas') takes no tensor_amax: quantize shards with impl='xla'")
    x = jnp.asarray(x)
    axis = axis % x.ndim if x.ndim else 0
    return quantize_pallas(as_quantizer_input(x), fmt, axis, block_2d=block_2d, rounding=rounding,
                           key=key, scale_rule=scale_rule)
