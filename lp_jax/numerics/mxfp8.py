"""MXFP8 (OCP MX): E4M3 values in 32-element blocks, each with an E8M0 (power-of-two) scale,
no tensor scale (docs/numerics.md)."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from lp_jax.numerics import formats as F
from lp_jax.numerics.blocks import (
    abs_max,
    along_blocks,
    block_amax,
    expand,
    from_blocks,
    to_blocks,
    unblocked,
)
from lp_jax.numerics.format import Format
from lp_jax.numerics.quantized_tensor import QuantizedTensor

MX_BLOCK = 32


def mxfp8_blocks(xb, scale_rule="rceil", amax=None, per_block_barrier=True):
    """xb: float32 or bf16 [..., n, 32]; amax: its per-block max |x| [..., n] if already
    taken (``block_amax``). Returns (E4M3 data [..., n, 32], uint8 codes [..., n]).

    The code and its two power-of-two factors are materialized per block (the barrier):
    fused into the elementwise pass, XLA would redo their integer work for all 32 elements.
    A Pallas kernel passes per_block_barrier=False (Mosaic GPU has no lowering for the
    barrier, and a kernel computes each block's factors once anyway); the bits are the same.
    """
    code, f1, f2 = mxfp8_block_factors(abs_max(xb, axis=-1) if amax is None else amax, scale_rule)
    if per_block_barrier:
        code, f1, f2 = lax.optimization_barrier((code, f1, f2))
    # = F.mul_exp2(xb, k), with the factors broadcast along the block in one step
    data = F.cast_satfinite(xb * along_blocks(f1, xb.shape) * along_blocks(f2, xb.shape), F.E4M3)
    return data, code


def mxfp8_block_factors(amax, scale_rule="rceil"):
    """Per block: (uint8 E8M0 code, f1, f2), the data being cast_satfinite(x * f1 * f2, E4M3)."""
    code = F.e8m0_code_rceil(amax) if scale_rule == "rceil" else F.e8m0_code_floor(amax)
    # q = x * 2^(127 - e); a NaN block (255) gets any finite multiplier, it decodes to NaN.
    k = 127 - jnp.where(code == 255, 127, code.astype(jnp.int32))
    return (code, *F.exp2_factors(k))


def mxfp8_decode_factors(code):
    """Per block: (NaN mask, f1, f2) with q * f1 * f2 = q * 2^(code - 127) (``F.mul_exp2``),
    materialized for the same reason as in ``mxfp8_blocks``."""
    return lax.optimization_barrier((code == 255, *F.exp2_factors(code.astype(jnp.int32) - 127)))


def mxfp8_values(t, axis, scale_rule="rceil"):
    # t stays in its own dtype (bf16): the amax is exact in it, and the upcast happens inside
    # the fused quantization pass instead of in a materialized float32 copy.
    data, code = mxfp8_blocks(to_blocks(t, axis, MX_BLOCK), scale_rule, block_amax(t, axis, MX_BLOCK))
    data = lax.optimization_barrier(data).astype(jnp.float32)
    nan, f1, f2 = (a[..., None] for a in mxfp8_decode_factors(code))
    values = jnp.where(nan, jnp.float32(jnp.nan), data * f1 * f2)  # = F.mul_exp2(data, code - 127)
    return unblocked(values, t.shape[axis]), None


@dataclasses.dataclass(frozen=True)
class MXFP8(Format):
    scheme = "mxfp8"

    def quantize(self, xf, axis, *, scale_rule="rceil", **_):
        data_b, code = mxfp8_blocks(to_blocks(xf, axis, MX_BLOCK), scale_rule, block_amax(xf, axis, MX_BLOCK))
        data = from_blocks(data_b, axis, xf.shape[axis])
        return QuantizedTensor(data, jnp.moveaxis(F.e8m0_from_code(code), -1, axis), None, self.name, axis)

    def block_values(self, q):
        """q * 2^(e-127), exact: applied as two normal powers of two, since 2^-127 alone is
        subnormal."""
        data = q.data.astype(jnp.float32)
        nan, f1, f2 = mxfp8_decode_factors(lax.bitcast_convert_type(q.scale, jnp.uint8))
        nan, f1, f2 = (expand(a, q.axis, MX_BLOCK, data.shape[q.axis]) for a in (nan, f1, f2))
        return jnp.where(nan, jnp.float32(jnp.nan), data * f1 * f2)

    def values(self, t, axis, *, scale_rule="rceil", **_):
        return mxfp8_values(t, axis, scale_rule)


MXFP8_FORMAT = MXFP8(name="mxfp8", label="MXFP8", color="tab:green", element=F.E4M3, block=MX_BLOCK,
                     scale=F.E8M0, tensor_scale=False, pallas=True, auto_pallas=True, gemm="cudnn")
