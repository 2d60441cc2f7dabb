"""Comparisons of lp_jax quantizer outputs with the NumPy oracle (tests/support/numpy_reference.py).

Low-precision arrays are compared as raw codes (uint8 views), NaN-aware: where the oracle
holds a NaN code the implementation must hold a NaN code of the same format (any sign or
payload); everywhere else the bytes must be equal, signed zeros included.

One platform allowance (docs/numerics.md, "Platform notes: subnormals on CPU"): XLA on CPU
flushes FP32 subnormals to zero, in inputs and in results (FTZ and DAZ). So (a) where an input element is an FP32
subnormal its data byte is not compared and its dequantized value only has to be within
FLT_MIN of the oracle (`subnormal_inputs=True`); (b) an output that is itself an FP32
subnormal in the oracle may be flushed: a stored scale_inv or S_dec may be a zero of the
same sign, a dequantized value need only be within FLT_MIN. Nothing else is tolerated: in
particular a dequantized value that is FP32-normal in the oracle must be exact even when
it is computed from a subnormal factor (an E8M0 code 0, scale_inv = 2^-128, a tiny S_dec),
because the contract defines the product, not the factor, as the result. FP8 block scaling
keeps subnormals on CPU too (its inputs scaled from their integer mantissas, its values
decoded with gradual underflow), so it has no allowance at all (`EXACT_SUBNORMALS`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from tests.support import numpy_reference as ref
from tests.support.numpy_reference_casts import E2M1, E4M3, E5M2, decode

FLT_MIN = np.finfo(np.float32).tiny
# Formats held to the oracle bit for bit for subnormal inputs and outputs as well.
EXACT_SUBNORMALS = {"fp8_block", "fp8_block_e5m2"}
ELEMENT = {"fp8_e4m3": E4M3, "fp8_e5m2": E5M2, "mxfp8": E4M3, "nvfp4": E2M1, "fp8_block": E4M3,
           "fp8_block_e5m2": E5M2}
DATA_DTYPE = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2, "mxfp8": jnp.float8_e4m3fn,
              "nvfp4": jnp.float4_e2m1fn, "fp8_block": jnp.float8_e4m3fn, "fp8_block_e5m2": jnp.float8_e5m2}
SCALE_DTYPE = {"fp8_e4m3": jnp.float32, "fp8_e5m2": jnp.float32, "mxfp8": jnp.float8_e8m0fnu,
               "nvfp4": jnp.float8_e4m3fn, "fp8_block": jnp.float32, "fp8_block_e5m2": jnp.float32}


def codes(a) -> np.ndarray:
    """Raw codes of a low-precision array (one code per byte, as ml_dtypes stores them)."""
    a = np.asarray(a)
    assert a.dtype.itemsize == 1, a.dtype
    return a.view(np.uint8)


def subnormal(a) -> np.ndarray:
    a = np.abs(np.asarray(a, np.float32))
    return (a > 0) & (a < FLT_MIN)


E8M0 = "e8m0"  # block-scale format of MXFP8 for assert_codes_equal


def nan_codes(c, fmt) -> np.ndarray:
    """Which codes are NaN: E8M0 255; E4M3 S.1111.111; E5M2 exponent 11111 with mantissa != 0."""
    c = np.asarray(c)
    if fmt == E8M0:
        return c == ref.E8M0_NAN
    if fmt.nan_code is None:
        return np.zeros(c.shape, bool)
    return np.isnan(decode(c, fmt))


def assert_codes_equal(got, want, fmt, where=None, what="data"):
    """got/want: uint8 codes of element format `fmt` (or E8M0); compared where `where`."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    where = np.ones(want.shape, bool) if where is None else np.broadcast_to(where, want.shape)
    want_nan, got_nan = nan_codes(want, fmt), nan_codes(got, fmt)
    bad = where & np.where(want_nan, ~got_nan, got != want)
    if bad.any():
        idx = tuple(np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {bad.sum()} of {bad.size} codes differ; first at {idx}: "
                             f"got 0x{got[idx]:02x}, want 0x{want[idx]:02x}")


def assert_f32_equal(got, want, flushable=None, atol_where=None, what="value"):
    """Bitwise FP32 equality, NaN-aware. `flushable`: positions that may be a same-signed
    zero instead; `atol_where`: positions that only need to be within FLT_MIN."""
    got = np.asarray(got, np.float32)
    want = np.broadcast_to(np.asarray(want, np.float32), got.shape)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    if flushable is not None:
        same |= np.broadcast_to(flushable, got.shape) & (got == 0) & (np.signbit(got) == np.signbit(want))
    if atol_where is not None:
        with np.errstate(invalid="ignore"):
            same |= np.broadcast_to(atol_where, got.shape) & (np.abs(got - want) <= FLT_MIN)
    if not same.all():
        idx = tuple(np.argwhere(~same)[0])
        raise AssertionError(f"{what}: {(~same).sum()} of {same.size} differ; first at {idx}: "
                             f"got {got[idx]!r}, want {want[idx]!r}")


def check_quantized(lp, q, x, fmt, *, axis=-1, block_2d=False, scale_rule="rceil",
                    subnormal_inputs=False, check_data=True):
    """Asserts that lp_jax's QuantizedTensor `q` of `x` matches the oracle bit for bit."""
    x32 = np.asarray(x).astype(np.float32)
    r = ref.quantize(x32, fmt, axis, block_2d=block_2d, scale_rule=scale_rule)
    assert q.data.dtype == DATA_DTYPE[fmt], f"data dtype {q.data.dtype}"
    assert q.scale.dtype == SCALE_DTYPE[fmt], f"scale dtype {q.scale.dtype}"
    assert q.data.shape == x32.shape and q.scale.shape == r.scale.shape, (q.data.shape, q.scale.shape)
    exact = fmt in EXACT_SUBNORMALS
    if fmt.startswith("fp8"):
        assert_f32_equal(q.scale, r.scale, flushable=None if exact else subnormal(r.scale), what="scale_inv")
    else:
        assert_codes_equal(codes(q.scale), r.scale, E4M3 if fmt == "nvfp4" else E8M0, what=f"{fmt} scale")
    if fmt == "nvfp4":
        assert_f32_equal(q.global_scale, r.global_scale, flushable=subnormal(r.global_scale), what="S_dec")
    else:
        assert q.global_scale is None
    if check_data:
        known = r.data_known & ~subnormal(x32) if subnormal_inputs and not exact else r.data_known
        assert_codes_equal(codes(q.data), r.data, ELEMENT[fmt], known, what=f"{fmt} data")
    return r


_jit_dequantize = None


def check_dequantized(lp, q, r: ref.RefQuantized, x, *, subnormal_inputs=False, jit=False):
    global _jit_dequantize
    if jit and _jit_dequantize is None:
        _jit_dequantize = jax.jit(lp.dequantize)
    got = np.asarray((_jit_dequantize if jit else lp.dequantize)(q))
    assert got.dtype == np.float32 and got.shape == np.shape(x)
    atol = subnormal(r.dequantized)
    if subnormal_inputs:
        atol |= subnormal(np.asarray(x).astype(np.float32))
    if r.fmt in EXACT_SUBNORMALS:
        atol = None
    assert_f32_equal(got, r.dequantized, atol_where=atol, what=f"{r.fmt} dequantized")


@functools.cache
def jitted_quantize(lp, fmt, axis=-1, options=()):
    """One jitted quantizer per variant; options: sorted (keyword, value) pairs."""
    return jax.jit(functools.partial(lp.quantize, fmt=fmt, axis=axis, **dict(options)))


def check_eager_and_jit(lp, x, fmt, axis=-1, *, subnormal_inputs=False, check_data=True,
                        check_dequantized_values=True, modes=("eager", "jit"), **kw):
    """Quantizes x eagerly and under jit, checks both (and, with check_dequantized_values,
    their dequantization) against the oracle; returns [(mode, q), ...] and the oracle's
    RefQuantized."""
    out = []
    for mode in modes:
        if mode == "eager":
            q = lp.quantize(to_jax(x), fmt, axis, **kw)
        else:
            q = jitted_quantize(lp, fmt, axis, tuple(sorted(kw.items())))(to_jax(x))
        try:
            r = check_quantized(lp, q, x, fmt, axis=axis, subnormal_inputs=subnormal_inputs,
                                check_data=check_data, **kw)
            if check_data and check_dequantized_values:
                check_dequantized(lp, q, r, x, subnormal_inputs=subnormal_inputs, jit=mode == "jit")
        except AssertionError as e:
            raise AssertionError(f"{mode}: {e}") from None
        out.append((mode, q))
    return out, r


def to_jax(x):
    """numpy float32 / ml_dtypes.bfloat16 -> jax array of the same dtype."""
    x = np.asarray(x)
    assert x.dtype in (np.float32, ml_dtypes.bfloat16)
    return jnp.asarray(x)
