"""FP8 with per-tensor current scaling (FP8-CS): E4M3 or E5M2 values under one FP32 scale,
fmax / amax of the whole tensor (docs/numerics.md). One scheme, two format objects."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from lp_jax.numerics import formats as F
from lp_jax.numerics.blocks import abs_max
from lp_jax.numerics.division import div
from lp_jax.numerics.format import Format
from lp_jax.numerics.quantized_tensor import QuantizedTensor

# The name FP8-CS's tensor amax carries (``jax.ad_checkpoint.checkpoint_name``): a remat
# policy that saves it (models.config.REBUILD_SAVED) keeps one scalar per quantized tensor,
# and a block rebuilt in the backward casts its tensors to FP8 again without reducing them
# again (the same amax, so the same bits). MXFP8 has no tensor amax; NVFP4's, saved so,
# cost its rebuilt MLP block more kernels than it saved (compiled for B200), so it is not
# named.
TENSOR_AMAX = "tensor_amax"


def tensor_scale_fp8(amax, fmax):
    """FP8-CS: scale = fmax / amax in float32; 1 if amax is 0/inf/NaN; FLT_MAX on overflow."""
    amax = amax.astype(jnp.float32)
    scale = div(jnp.float32(fmax), amax)
    scale = jnp.where(jnp.isinf(scale), jnp.float32(F.FLT_MAX), scale)
    bad = (amax == 0) | ~jnp.isfinite(amax)
    return jnp.where(bad, jnp.float32(1), scale)


def quantize_per_tensor(x, dtype, amax=None):
    """Returns (data, scale_inv). ``amax`` may be given (e.g. reduced across shards)."""
    amax = checkpoint_name(abs_max(x), TENSOR_AMAX) if amax is None else amax
    scale = tensor_scale_fp8(amax, F.max_of(dtype))
    return scale_cast_fp8(x, scale, dtype), F.recip(scale)


def scale_cast_fp8(x, scale, dtype):
    """FP8-CS data: x * scale in float32, rounded to ``dtype`` with saturation (the Pallas
    cast kernel calls it on each tile with the scale read from SMEM)."""
    return F.cast_satfinite(x.astype(jnp.float32) * scale, dtype)


def per_tensor_values(t, dtype, axis=-1):
    data, scale_inv = quantize_per_tensor(t, dtype)
    # The barrier keeps XLA on GPU from folding f32 -> fp8 -> f32 away as excess precision.
    return jnp.moveaxis(lax.optimization_barrier(data).astype(jnp.float32), axis, -1), scale_inv


@dataclasses.dataclass(frozen=True)
class PerTensorFP8(Format):
    """FP8-CS in one element type; ``axis`` is kept on the QuantizedTensor, never blocked."""

    scheme = "per_tensor"

    def quantize(self, xf, axis, *, tensor_amax=None, **_):
        data, scale_inv = quantize_per_tensor(xf, self.element, tensor_amax)
        return QuantizedTensor(data, scale_inv, None, self.name, axis)

    def block_values(self, q):
        return q.data.astype(jnp.float32)

    def dequantize(self, q):
        return F.mul(q.data.astype(jnp.float32), q.scale)

    def values(self, t, axis, **_):
        return per_tensor_values(t, self.element, axis)


def _fp8_cs(name, element):
    return PerTensorFP8(name=name, label="FP8-CS", color="tab:blue", element=element, block=None, scale=None,
                        tensor_scale=True, pallas=True, gemm="xla_fp8")


FP8_E4M3 = _fp8_cs("fp8_e4m3", F.E4M3)
FP8_E5M2 = _fp8_cs("fp8_e5m2", F.E5M2)
