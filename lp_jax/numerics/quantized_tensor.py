"""``QuantizedTensor``: low-precision values with the scales that decode them, for every format.

A pytree of real low-precision arrays (``float8_e4m3fn``, ``float8_e5m2``,
``float4_e2m1fn``, ``float8_e8m0fnu``) plus static metadata, so it passes through ``jit``,
``vmap`` and ``custom_vjp`` residuals. ``fmt`` is the format's public name; the format
object behind it is ``lp_jax.numerics.registry.format_named(q.fmt)``.
"""
from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
    """Low-precision values with the scales that decode them.

    ``data`` has the shape of the original tensor. ``scale.astype(float32)`` is the
    dequantization factor: ``()`` per tensor; for block formats the original shape with the
    blocked axis divided by the block size (rounded up), or both last axes for 16x16 tiles.
    ``global_scale`` is NVFP4's float32 ``S_dec`` (None otherwise); with 4/6 block scales
    it is fl(amax / 1536 as amax * fl(1/1536)) and ``tensor_amax`` holds the tensor amax
    the decode uses (None for every other quantization).
    """

    data: jax.Array
    scale: jax.Array
    global_scale: jax.Array | None
    fmt: str = dataclasses.field(metadata=dict(static=True))
    axis: int = dataclasses.field(metadata=dict(static=True))  # blocked axis (non-negative)
    block_2d: bool = dataclasses.field(default=False, metadata=dict(static=True))
    tensor_amax: jax.Array | None = None

    @property
    def shape(self):
        return self.data.shape
