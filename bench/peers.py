"""Peer implementations of quantized training GEMMs, timed in the same harness as ours.

- jax.nn.scaled_dot_general (JAX 0.11+): MXFP8, and NVFP4 with an in-graph per-tensor
  global scale (amax / (6 x 448), stop_gradient). Its NVFP4 backward is unquantized.
- qwix quantized training (QtProvider; ``pip install qwix``, the ``bench`` extra), each at
  its fastest setting that trains correctly: per-tensor FP8 (E4M3 forward, E5M2
  gradients); MXFP8 and NVFP4 with dy and both residual operands quantized along the
  backward GEMMs' contraction axes. qwix's NVFP4 has no tensor scale, so a gradient
  block's E4M3 scale underflows to zero at this model's gradient sizes: its row scales
  the loss by 2^16 (LOSS_SCALES), as its users must.
Each is a frozen dataclass set as the Linear's dot_general (qwix through its own
quantize_model), so the model and the harness are the same for every row.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

JAX_NN_MXFP8, JAX_NN_NVFP4 = "jax.nn mxfp8", "jax.nn nvfp4 (bwd not quantized)"
QWIX_FP8, QWIX_MXFP8, QWIX_NVFP4 = ("qwix fp8 per-tensor", "qwix mxfp8 (dy, residuals quantized)",
                                    "qwix nvfp4 (loss x 2^16)")

# What each peer leaves out of the work lp_jax's recipe of the same format does.
SKIPS = {
    JAX_NN_MXFP8: "nothing in the formats; keeps BF16 (float32) residuals instead of quantized "
                  "copies, re-quantizing them in the backward",
    JAX_NN_NVFP4: "the quantized backward (dgrad and wgrad run in BF16), RHT, stochastic rounding, "
                  "16x16 weight tiles",
    QWIX_FP8: "nothing (the same per-tensor work; the forward bytes serve the backward)",
    QWIX_MXFP8: "keeps BF16 residuals (re-quantized along M and N in the backward) rather than "
                "quantized copies; E8M0 scales from a float ceil(log2) rather than RCEIL's bits",
    QWIX_NVFP4: "the FP32 tensor scale (hence the loss scale), RHT, stochastic rounding, 16x16 "
                "weight tiles; keeps BF16 residuals",
}
LOSS_SCALES = {QWIX_NVFP4: 2.0**16}


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
    return model


def qwix_rule(qtype):
    """qwix's QtRule for the layer Linears: "fp8" (E4M3/E5M2, one scale per tensor), "mxfp8" or "nvfp4"
    (tiles of 32 or 16 along every GEMM's contraction axis, dy and residuals quantized)."""
    import qwix  # optional peer
    if qtype == "fp8":
        # qwix scales each non-contracting channel by default; per tensor is its opt-out on
        # every operand (the forward bytes, scalar-scaled, then serve the backward as ours do).
        per_tensor = {f"{k}_disable_channelwise_axes": True for k in ("lhs", "rhs", "dlhs_grad", "drhs_grad")}
        return qwix.QtRule(module_path=r".*layers.*", weight_qtype=jnp.float8_e4m3fn,
                           act_qtype=jnp.float8_e4m3fn, bwd_qtype=jnp.float8_e5m2,
                           additional_qt_config=per_tensor)
    tile = 32 if qtype == "mxfp8" else 16
    return qwix.QtRule(module_path=r".*layers.*", weight_qtype=qtype, act_qtype=qtype, bwd_qtype=qtype,
                       tile_size=tile, bwd_weight_grad_tile_size=tile,
                       additional_qt_config=dict(dlhs_tile_size=tile, drhs_tile_size=tile, dlhs_residual_qtype=qtype,
                                                 drhs_residual_qtype=qtype))


def qwix_model(model, sample_input, qtype):
    import qwix  # optional peer
    return qwix.quantize_model(model, qwix.QtProvider([qwix_rule(qtype)]), sample_input)


def peer_setups():
    """(name, setup(model, sample input) -> the model to time) per peer row; a qwix setup
    raises ImportError where qwix is not installed."""
    return [
        (JAX_NN_MXFP8, lambda m, x: apply_jax_nn(m, "mxfp8")),
        (JAX_NN_NVFP4, lambda m, x: apply_jax_nn(m, "nvfp4")),
        (QWIX_FP8, lambda m, x: qwix_model(m, x, "fp8")),
        (QWIX_MXFP8, lambda m, x: qwix_model(m, x, "mxfp8")),
        (QWIX_NVFP4, lambda m, x: qwix_model(m, x, "nvfp4")),
    ]
