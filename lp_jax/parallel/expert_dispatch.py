"""The expert-parallel dispatch in FP8 (``mesh.ep_dispatch_dtype=fp8``), as DeepSeek-V3 sends it.

Under ``mesh.expert > 1`` each MoE layer sends its routed rows to the experts' ranks by
all-to-all (``models.moe_dispatch``). With ``fp8`` the forward dispatch moves the rows as
E4M3 values with block scales, quantized by lp_jax's own quantizers, packed into one byte
array per buffer so that one all-to-all carries values and scales:

- MXFP8 recipes: the rows in MXFP8 (1x32 blocks, E8M0 scales, the recipe's scale rule),
  exactly as the expert GEMM's forward quantizes its input; FP8 block scaling: 1x128 blocks
  with FP32 power-of-two scales, again the expert GEMM's own input format. The scales are
  powers of two, so the dequantized rows are exact in BF16 and the GEMM quantizes them to
  the same values (the forward output is the BF16 dispatch's, bit for bit).
- Every other recipe (BF16, FP8-CS, NVFP4): DeepSeek-V3's format, E4M3 with one FP32 scale
  per 1x128 block along the hidden dimension (here FP8 block scaling's power-of-two
  scales). The rows arrive with E4M3's rounding: each element within 2^-4 of its value
  relative, or 2^-9 amax / 448 absolute for elements under the block's E4M3 normal range.

Bytes per row of D: D + D/32 (MXFP8) or D + 4 D/128 (1x128 blocks), against 2 D in BF16.
The backward moves the dispatched rows' cotangent in the activation dtype (straight-through
quantize-dequantize) and the combine stays in the activation dtype both ways.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx
from jax import lax

from lp_jax.config.schema import EP_DISPATCH_DTYPES
from lp_jax.numerics.quantize import dequantize
from lp_jax.numerics.quantized_tensor import QuantizedTensor
from lp_jax.numerics.registry import Format, format_named, names_where
from lp_jax.quantizer import quantize
from lp_jax.recipes import Recipe

# The MoE layer's attribute that holds the dispatch's encoding (models.moe.MoE).
CODEC_ATTRIBUTE = "dispatch_codec"


def _dispatchable(f: Format) -> bool:
    """E4M3 values with block scales alone (no tensor scale): the rows decode exactly from
    the packed bytes, and a recipe quantizing its GEMM's input to the same format gets the
    same values back (MXFP8, FP8 block scaling)."""
    return f.element == jnp.float8_e4m3fn and f.block is not None and not f.tensor_scale


# Formats whose dequantized rows a recipe's expert GEMM quantizes back to the same values.
SAME_AS_GEMM = names_where(_dispatchable)


def _as_bytes(a):
    """``a`` [..., n] as uint8 [..., n * itemsize]."""
    b = lax.bitcast_convert_type(a, jnp.uint8)
    return b if b.ndim == a.ndim else b.reshape(*a.shape[:-1], -1)


def _from_bytes(b, dtype):
    """uint8 [..., n * itemsize] as ``dtype`` [..., n]."""
    size = jnp.dtype(dtype).itemsize
    return lax.bitcast_convert_type(b if size == 1 else b.reshape(*b.shape[:-1], -1, size), dtype)


@dataclasses.dataclass(frozen=True)
class FP8Dispatch:
    """Rows [..., D] quantized along D to ``fmt`` ("mxfp8" or "fp8_block", E4M3 values)
    and packed with their scales into uint8 [..., D + scale bytes]; decoded back exactly.
    Frozen and hashable: a static attribute of the MoE layer (its graphdef)."""

    fmt: str
    scale_rule: str = "rceil"  # MXFP8's E8M0 rule, the recipe's
    impl: str = "xla"  # the quantizer implementation (lp_jax.quantize's impl)

    def __post_init__(self):
        if self.fmt not in SAME_AS_GEMM:
            raise ValueError(f"the FP8 dispatch quantizes to one of {SAME_AS_GEMM}, not {self.fmt!r}")

    def encode(self, rows):
        q = quantize(rows, self.fmt, axis=-1, scale_rule=self.scale_rule, impl=self.impl)
        return jnp.concatenate([_as_bytes(q.data), _as_bytes(q.scale)], axis=-1)

    def decode(self, packed, d: int, dtype):
        data = _from_bytes(packed[..., :d], jnp.float8_e4m3fn)
        scale = _from_bytes(packed[..., d:], format_named(self.fmt).scale)
        # Power-of-two scales and 4-bit significands: exact in any activation dtype.
        return dequantize(QuantizedTensor(data, scale, None, self.fmt, packed.ndim - 1)).astype(dtype)

    def row_bytes(self, d: int) -> int:
        """Bytes one dispatched row of ``d`` values takes."""
        f = format_named(self.fmt)
        return d + -(-d // f.block) * jnp.dtype(f.scale).itemsize


def fp8_dispatch(recipe: Recipe) -> FP8Dispatch:
    """The FP8 dispatch for ``recipe``: its expert GEMM's own input format where that is
    MXFP8 or FP8 block scaling, else DeepSeek-V3's E4M3 in 1x128 blocks."""
    spec = recipe.fprop_x
    if spec.fmt is not None and _dispatchable(format_named(spec.fmt)):
        return FP8Dispatch(spec.fmt, spec.scale_rule, spec.quantize_impl)
    return FP8Dispatch("fp8_block")


def set_expert_dispatch(model, recipe: Recipe, dtype: str) -> list[str]:
    """Sets how every MoE layer of ``model`` (a module with a ``dispatch_codec`` attribute)
    sends its expert-parallel dispatch: ``dtype`` "bf16" in the activation dtype, "fp8" in
    ``fp8_dispatch(recipe)``. Returns the layers' '/'-joined paths. A static attribute: the
    state tree and the checkpoints are the same either way."""
    if dtype not in EP_DISPATCH_DTYPES:
        raise ValueError(f"ep_dispatch_dtype={dtype!r} is invalid: choose one of "
                         f"{', '.join(EP_DISPATCH_DTYPES)}")
    codec = fp8_dispatch(recipe) if dtype == "fp8" else None
    paths = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and CODEC_ATTRIBUTE in vars(node):
            setattr(node, CODEC_ATTRIBUTE, codec)
            paths.append("/".join(map(str, path)))
    return paths
