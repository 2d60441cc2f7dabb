"""Peer implementations of quantized training GEMMs, timed in the same harness as ours.

- jax.nn.scaled_dot_general (JAX 0.11+): MXFP8, and NVFP4 with an in-graph per-tensor
  global scale (amax / (6 x 448), stop_gradient). Its NVFP4 backward is unquantized.
- qwix quantized training (QtProvider): per-tensor FP8 (E4M3 forward, E5M2 gradients), and
  MXFP8 with its backward quantized.
Each is a frozen dataclass set as the Linear's dot_general (qwix through its own
quantize_model), so the model and the harness are the same for every row.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class JaxNNScaledDot:
    mode: str  # "mxfp8" | "nvfp4"

    def _config(self, t):
        if self.mode != "nvfp4":
            return jax.nn.get_scaled_dot_general_config(self.mode)
        amax = jax.lax.stop_gradient(jnp.max(jnp.abs(t)).astype(jnp.float32))
        scale = jnp.where(amax > 0, amax / (6.0 * 448.0), 1.0).reshape(1)
        return jax.nn.get_scaled_dot_general_config("nvfp4", global_scale=scale)

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                 out_sharding=None):
        out_dtype = preferred_element_type or lhs.dtype
        # Its VJP returns float32 cotangents for bf16 operands, which breaks a bf16 model:
        # give it float32 operands (the cast's transpose brings gradients back to bf16).
        lhs, rhs = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
        configs = [self._config(lhs), self._config(rhs), self._config(lhs)]
        y = jax.nn.scaled_dot_general(lhs, rhs, dimension_numbers, preferred_element_type=jnp.float32,
                                      configs=configs)
        return y.astype(out_dtype)


def apply_jax_nn(model, mode):
    from flax import nnx
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Linear) and "layers" in map(str, path):
            node.dot_general = JaxNNScaledDot(mode)


def qwix_model(model, sample_input, qtype):
    """qwix QT on the layer Linears: qtype "fp8" (E4M3/E5M2 per tensor) or "mxfp8"."""
    import qwix  # optional peer: pip install qwix
    if qtype == "fp8":
        rule = qwix.QtRule(module_path=r".*layers.*", weight_qtype=jnp.float8_e4m3fn,
                           act_qtype=jnp.float8_e4m3fn, bwd_qtype=jnp.float8_e5m2)
    else:
        rule = qwix.QtRule(module_path=r".*layers.*", weight_qtype=qtype, act_qtype=qtype, bwd_qtype=qtype,
                           tile_size=32, additional_qt_config=dict(dlhs_tile_size=32, drhs_tile_size=32))
    return qwix.quantize_model(model, qwix.QtProvider([rule]), sample_input)
