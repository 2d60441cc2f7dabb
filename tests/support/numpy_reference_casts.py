"""Element casts of the oracle (docs/numerics.md, "Element formats"), written from the bit layout.

Casts round to nearest, ties to even, and saturate to ±max ("satfinite"). Rounding is done
exactly in float64 on each format's grid (np.rint is round-half-to-even); codes are packed
from sign, biased exponent and mantissa by hand. ml_dtypes is used only by the self-tests
(tests/numerics/test_numpy_reference.py), never here, so the two can check each other.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class ElementFormat:
    name: str
    bits: int  # total bits of a code, sign included
    mant_bits: int  # stored mantissa bits
    bias: int
    max_value: float  # largest finite magnitude ("max" column)
    nan_code: int | None  # the positive NaN code; None: no NaN (E2M1)
    has_inf: bool

    @property
    def exp_bits(self) -> int:
        return self.bits - 1 - self.mant_bits

    @property
    def min_normal_exp(self) -> int:
        return 1 - self.bias


# | E4M3 | float8_e4m3fn | 448   | no inf; NaN only; smallest subnormal 2^-9 |
E4M3 = ElementFormat("fp8_e4m3", 8, 3, 7, 448.0, 0x7F, False)
# | E5M2 | float8_e5m2   | 57344 | has inf |
E5M2 = ElementFormat("fp8_e5m2", 8, 2, 15, 57344.0, 0x7F, True)
# | E2M1 | float4_e2m1fn | 6     | values ±{0, 0.5, 1, 1.5, 2, 3, 4, 6} |
E2M1 = ElementFormat("fp4_e2m1", 4, 1, 1, 6.0, None, False)


def round_to_grid(x, mant_bits: int, min_normal_exp: int, max_value: float) -> np.ndarray:
    """Rounds to the grid of a binary float format, nearest with ties to even; magnitudes above
    max_value (inf included) become ±max_value; NaN stays NaN. Returns float64."""
    x = np.asarray(x, np.float64)
    mag = np.abs(x)
    finite = np.isfinite(mag)
    m = np.where(finite, mag, 0.0)
    _, e = np.frexp(m)  # m = f * 2^e, f in [0.5, 1): floor(log2 m) = e - 1
    exponent = np.maximum(e - 1, min_normal_exp)  # below the normal range: subnormal spacing
    quantum = np.ldexp(1.0, exponent - mant_bits)  # distance between neighbours at m
    # m / quantum is exact (power of two); np.rint rounds half to even, and the integer's
    # parity is the parity of the mantissa's last bit, so this is ties-to-even.
    rounded = np.rint(m / quantum) * quantum
    rounded = np.minimum(np.where(finite, rounded, np.inf), max_value)  # satfinite
    return np.where(np.isnan(x), np.nan, np.copysign(rounded, x))


def encode(values, fmt: ElementFormat) -> np.ndarray:
    """Packs values already on the format's grid (|v| <= max, or NaN) into uint8 codes."""
    v = np.asarray(values, np.float64)
    nan = np.isnan(v)
    mag = np.where(nan, 0.0, np.abs(v))
    subnormal = mag < np.ldexp(1.0, fmt.min_normal_exp)
    _, e = np.frexp(np.where(subnormal, 1.0, mag))
    e = e - 1
    biased = np.where(subnormal, 0, e + fmt.bias)
    mant = np.where(subnormal, mag / np.ldexp(1.0, fmt.min_normal_exp - fmt.mant_bits),
                    (mag / np.ldexp(1.0, e) - 1.0) * (1 << fmt.mant_bits))
    assert np.all(mant == np.round(mant)), "value not on the format's grid"
    sign = np.signbit(v).astype(np.int64) << (fmt.bits - 1)
    code = sign | (biased.astype(np.int64) << fmt.mant_bits) | mant.astype(np.int64)
    if fmt.nan_code is not None:
        code = np.where(nan, sign | fmt.nan_code, code)
    else:
        code = np.where(nan, 0, code)  # no NaN code: the caller marks these as unspecified
    return code.astype(np.uint8)


def cast_satfinite(x, fmt: ElementFormat) -> np.ndarray:
    """ "cast_satfinite": nearest-even, saturating to ±max, NaN kept (where the format has
    one). Returns uint8 codes."""
    return encode(round_to_grid(x, fmt.mant_bits, fmt.min_normal_exp, fmt.max_value), fmt)


def decode(codes, fmt: ElementFormat) -> np.ndarray:
    """uint8 codes -> float32 values, from the bit layout."""
    c = np.asarray(codes).astype(np.int64)
    sign = np.where((c >> (fmt.bits - 1)) & 1, -1.0, 1.0)
    biased = (c >> fmt.mant_bits) & ((1 << fmt.exp_bits) - 1)
    mant = c & ((1 << fmt.mant_bits) - 1)
    sub = mant * np.ldexp(1.0, fmt.min_normal_exp - fmt.mant_bits)
    normal = (1.0 + mant / (1 << fmt.mant_bits)) * np.ldexp(1.0, biased - fmt.bias)
    value = sign * np.where(biased == 0, sub, normal)
    top = biased == (1 << fmt.exp_bits) - 1
    if fmt.has_inf:  # IEEE-like (E5M2): all-ones exponent is inf (mantissa 0) or NaN
        value = np.where(top & (mant == 0), sign * np.inf, value)
        value = np.where(top & (mant != 0), np.nan, value)
    elif fmt.nan_code is not None:  # E4M3 "fn": only S.1111.111 is NaN
        value = np.where((c & 0x7F) == fmt.nan_code, np.nan, value)
    return value.astype(np.float32)


def round_to_bf16(x) -> np.ndarray:
    """Nearest-even to BF16 (8 exponent bits, 7 mantissa bits), no saturation; float64 out."""
    x = np.asarray(x, np.float64)
    bf16_max = float(np.ldexp(2.0 - 2.0**-7, 127))
    r = round_to_grid(x, 7, -126, np.inf)
    # Above bf16_max IEEE rounding overflows to inf once past the half-way point.
    return np.where(np.abs(r) > bf16_max, np.copysign(np.inf, x), r)


def all_finite_values(fmt: ElementFormat) -> tuple[np.ndarray, np.ndarray]:
    """(codes, float64 values) of every finite code of the format."""
    codes = np.arange(1 << fmt.bits, dtype=np.uint8)
    values = decode(codes, fmt).astype(np.float64)
    keep = np.isfinite(values)
    return codes[keep], values[keep]
