"""Shared by the Pallas kernel tests: bit equality of two QuantizedTensors, and inputs with
every kind of value the quantizers treat specially (docs/quantizer_tests.md)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import lp_jax as lp
from tests.support import quantize_checks as qc
from tests.support import random_inputs


def assert_same_bits(got, want, what=""):
    """Pallas against XLA: same types and shapes, and every bit of data and scales equal,
    NaN-aware as tests/support/quantize_checks.py compares with the oracle (a NaN code must meet a NaN
    code of the format; its sign and payload are not part of the contract)."""
    assert (got.fmt, got.axis, got.block_2d) == (want.fmt, want.axis, want.block_2d), what
    scale_fmt = {"mxfp8": qc.E8M0, "nvfp4": qc.E4M3}.get(want.fmt)
    for field in ("data", "scale", "global_scale"):
        g, w = getattr(got, field), getattr(want, field)
        if w is None:
            assert g is None, (what, field)
            continue
        assert g.dtype == w.dtype and g.shape == w.shape, (what, field, g.dtype, w.dtype, g.shape, w.shape)
        label = f"{what} {field}"
        if field == "data":
            qc.assert_codes_equal(qc.codes(g), qc.codes(w), qc.ELEMENT[want.fmt], what=label)
        elif field == "scale" and scale_fmt is not None:
            qc.assert_codes_equal(qc.codes(g), qc.codes(w), scale_fmt, what=label)
        else:  # float32 tensor factors
            qc.assert_f32_equal(g, w, what=label)


def mixed(shape, seed=0, nonfinite=False):
    """float32 rows from every random_inputs distribution, and special blocks: a zero block,
    FP32 subnormals, huge values (near FLT_MAX), values on the E4M3 and E8M0 rounding edges
    (448, 449, 2^k and one ulp above), and with ``nonfinite`` NaN, +inf and -inf."""
    rng = np.random.default_rng(seed)
    gens = list(random_inputs.DISTRIBUTIONS.values())
    x = np.concatenate([np.asarray(gens[i % len(gens)](rng, (1,) + shape[1:]), np.float32)
                        for i in range(shape[0])]).reshape(shape)
    flat = x.reshape(-1, shape[-1])
    flat[0, :32] = 0  # a zero block (MXFP8 and NVFP4)
    if flat.shape[0] > 1:
        flat[1, :8] = np.float32(1e-40) * np.arange(1, 9)  # FP32 subnormals
        flat[1, 8:12] = [3e38, -3.4e38, 1e30, -2e-38]
    if flat.shape[0] > 2:
        flat[2, :6] = [448, 449, 500, 2.0**-10, np.nextafter(np.float32(448), np.float32(1e9)), -1.75]
    if nonfinite:
        flat[-1, :3] = [np.nan, np.inf, -np.inf]  # NaN and inf in one block (its amax is NaN)
        flat[-2, 1] = np.nan  # a NaN alone in its block
        flat[0, 40 % shape[-1]] = np.inf
    return jnp.asarray(x)


def both_impls(x, fmt, axis=-1, **kw):
    """Quantizes x with both implementations, asserts the same bits, returns Pallas's."""
    want = lp.quantize(x, fmt, axis, impl="xla", **kw)
    got = lp.quantize(x, fmt, axis, impl="pallas", **kw)
    assert_same_bits(got, want, f"{fmt} axis={axis} {kw} shape={x.shape} {x.dtype}")
    return got
