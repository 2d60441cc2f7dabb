"""lp_jax.telemetry.stats against a NumPy computation on the NumPy oracle's quantization
(tests/support/numpy_reference.py), for every format, including all-zero and non-finite inputs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lp_jax.recipes import OperandSpec
from lp_jax.telemetry.stats import STATS, operand_stats
from tests.support import numpy_reference as R
from tests.support.numpy_reference_casts import E2M1, E4M3, E5M2, decode
from tests.support.numpy_reference_four_over_six import quantize_nvfp4_4over6

ELEMENT = {"fp8_e4m3": E4M3, "fp8_e5m2": E5M2, "fp8_block": E4M3, "fp8_block_e5m2": E5M2, "mxfp8": E4M3,
           "nvfp4": E2M1}
FLT_MAX = np.finfo(np.float32).max


def numpy_stats(x, spec: OperandSpec, axis: int) -> dict:
    """The statistics of docs/telemetry.md, computed in float64 from the oracle's codes."""
    t = np.asarray(x, np.float32)
    if spec.rht:
        t = R.hadamard(t, axis=axis)
    if spec.block_scale_search:
        ref = quantize_nvfp4_4over6(t, axis, spec.block_2d, spec.metric)
    else:
        ref = R.quantize(t, spec.fmt, axis, block_2d=spec.block_2d, scale_rule=spec.scale_rule)
    deq = ref.dequantized.astype(np.float64)
    t64 = t.astype(np.float64)
    finite = np.isfinite(t64)
    nonzero = finite & (t64 != 0)
    n = max(int(nonzero.sum()), 1)
    stored = np.abs(decode(ref.data, ELEMENT[spec.fmt]))
    with np.errstate(invalid="ignore", over="ignore"):
        lost = bool(np.any(finite & ~np.isfinite(deq)))
        signal = np.sum(np.where(finite, t64, 0) ** 2)
        noise = np.sum(np.where(finite, t64 - np.where(np.isfinite(deq), deq, 0), 0) ** 2)
    if lost:
        sqnr = -np.inf
    elif noise == 0:
        sqnr = np.inf
    else:
        sqnr = 10 * np.log10(signal / noise)
    if spec.fmt in ("fp8_e4m3", "fp8_e5m2"):
        amax_b = np.array([np.max(np.abs(t))])
        exponent = np.floor(np.log2(np.float64(ref.scale_factor)))[None]
        at_limit = np.array([R.per_tensor_scale(amax_b[0], ELEMENT[spec.fmt].max_value) == FLT_MAX])
    elif spec.fmt == "mxfp8":
        amax_b = np.max(np.abs(R._blocks(t, axis, 32)), axis=-1)
        code = np.moveaxis(ref.scale, axis, -1).astype(np.int64)
        exponent, at_limit = code - 127.0, (code == 0) | (code == 254)
    elif spec.fmt in ("fp8_block", "fp8_block_e5m2"):
        blocks, axes = (R._tiles(t, 128), (-3, -1)) if spec.block_2d else (R._blocks(t, axis, 128), -1)
        with np.errstate(invalid="ignore"):
            amax_b = np.max(np.abs(blocks), axis=axes)  # NaN where a block holds one
        scale_b = R.fp8_block_scale(np.max(np.abs(np.where(np.isnan(blocks), 0, blocks)), axis=axes),
                                    ELEMENT[spec.fmt].max_value)
        exponent = -np.log2(scale_b.astype(np.float64))  # of scale_inv, a power of two
        at_limit = scale_b == np.float32(2.0 ** 127)  # fmax / amax overflowed
    else:
        if spec.block_2d:
            amax_b = np.max(np.abs(R._tiles(t)), axis=(-3, -1))
            s_b = ref.scale_factor.astype(np.float64)
        else:
            amax_b = np.max(np.abs(R._blocks(t, axis, 16)), axis=-1)
            s_b = np.moveaxis(ref.scale_factor, axis, -1).astype(np.float64)
        with np.errstate(divide="ignore"):
            exponent = np.where(s_b > 0, np.floor(np.log2(s_b)), np.nan)
        at_limit = s_b < 2.0 ** -6
    # What the GEMM multiplies is zero where the element is, or (NVFP4) its block scale.
    element_scale = 1.0
    if spec.fmt == "nvfp4":
        element_scale = (R._tiles_per_element(s_b, t.shape) if spec.block_2d else
                         R._per_element(s_b, t.shape, axis, 16))
    kept = nonzero & ref.data_known & np.isfinite(deq)  # not in a NaN block
    used = np.isfinite(amax_b) & (amax_b > 0)
    with_exp = used & ~np.isnan(exponent)
    return {
        "amax": np.max(np.abs(t)),
        "underflow": np.sum(kept & (stored * element_scale == 0)) / n,
        "saturation": np.sum(kept & (stored == ELEMENT[spec.fmt].max_value)) / n,
        "sqnr_db": sqnr,
        "scale_exp_min": np.min(exponent[with_exp]) if with_exp.any() else np.nan,
        "scale_exp_max": np.max(exponent[with_exp]) if with_exp.any() else np.nan,
        "scale_at_limit": np.sum(used & at_limit) / max(int(used.sum()), 1),
    }


def _inputs():
    rng = np.random.default_rng(7)
    base = rng.standard_normal((48, 40)).astype(np.float32)
    spiky = base * np.exp(rng.uniform(-12, 3, base.shape)).astype(np.float32)  # wide range
    outlier = base.copy()
    outlier[5, 7] = 1e6  # pushes the other NVFP4 block scales below E4M3's normal range
    # E8M0 codes near 0, NVFP4's tensor scale clamped. No subnormal input: CPU arithmetic
    # flushes those to zero, a platform effect that is no business of these statistics.
    tiny = np.sign(base) * (1 + np.abs(base)) * np.float32(1e-37)
    nan = base.copy()
    nan[3, 30] = np.nan
    inf = base.copy()
    inf[40, 2] = -np.inf
    cases = {"normal": base, "spiky": spiky, "outlier": outlier, "tiny": tiny,
             "zeros": np.zeros_like(base), "nan": nan, "inf": inf}
    return {k: jnp.asarray(v, jnp.bfloat16) for k, v in cases.items()}


SPECS = {
    "fp8_e4m3": (OperandSpec("fp8_e4m3"), 1),
    "fp8_e5m2": (OperandSpec("fp8_e5m2"), 0),
    "fp8_block_rows": (OperandSpec("fp8_block"), 1),
    "fp8_block_cols": (OperandSpec("fp8_block"), 0),
    "fp8_block_tiles": (OperandSpec("fp8_block", block_2d=True), 0),
    "fp8_block_e5m2_cols": (OperandSpec("fp8_block_e5m2"), 0),
    "mxfp8_rows": (OperandSpec("mxfp8"), 1),
    "mxfp8_cols": (OperandSpec("mxfp8"), 0),
    "mxfp8_floor": (OperandSpec("mxfp8", scale_rule="floor"), 1),
    "nvfp4_1d": (OperandSpec("nvfp4"), 1),
    "nvfp4_2d": (OperandSpec("nvfp4", block_2d=True), 0),
    "nvfp4_rht": (OperandSpec("nvfp4", rht=True), 0),
    "nvfp4_4over6": (OperandSpec("nvfp4", block_scale_search="4over6"), 1),
    "nvfp4_4over6_cols": (OperandSpec("nvfp4", block_scale_search="4over6"), 0),
    "nvfp4_4over6_2d_mse": (OperandSpec("nvfp4", block_2d=True, block_scale_search="4over6",
                                        metric="mse"), 0),
}
INPUTS = _inputs()
stats_of = jax.jit(operand_stats, static_argnums=(1, 2))


def _cases(spec):
    # The RHT of tiny values cancels into float32 subnormals, and 4/6 decodes them to
    # subnormals (its tensor scale, 1536 / amax, is clamped to FLT_MAX): the statistics'
    # CPU arithmetic flushes those.
    flushes = spec.rht or spec.block_scale_search
    return {k: v for k, v in INPUTS.items() if not (flushes and k == "tiny")}


@pytest.mark.parametrize("spec_name", list(SPECS))
def test_stats_equal_numpy(spec_name):
    spec, axis = SPECS[spec_name]
    for case, x in _cases(spec).items():
        got = dict(zip(STATS, np.asarray(stats_of(x, spec, axis)).astype(np.float64)))
        want = numpy_stats(np.asarray(x.astype(jnp.float32)), spec, axis)
        for stat in STATS:
            g, w = got[stat], float(want[stat])
            rtol = 1e-4 if stat == "sqnr_db" else 1e-6  # float32 sums against float64
            assert (np.isnan(g) and np.isnan(w)) or g == pytest.approx(w, rel=rtol), \
                f"{spec_name} {case} {stat}: {g} != numpy {w}"


def test_the_cases_reach_every_statistic():
    """The inputs above are not vacuous: each statistic takes a non-trivial value somewhere."""
    seen = {s: set() for s in STATS}
    for spec, axis in SPECS.values():
        for case, x in _cases(spec).items():
            for stat, v in zip(STATS, np.asarray(stats_of(x, spec, axis))):
                seen[stat].add((case, "nan" if np.isnan(v) else str(v) if np.isinf(v) else
                                "zero" if v == 0 else "value"))
    assert ("outlier", "value") in seen["underflow"] and ("outlier", "value") in seen["scale_at_limit"]
    assert ("tiny", "value") in seen["scale_at_limit"]  # E8M0 code 0
    assert ("normal", "value") in seen["saturation"]
    assert ("zeros", "inf") in seen["sqnr_db"] and ("zeros", "nan") in seen["scale_exp_min"]
    assert ("nan", "nan") in seen["amax"] and ("inf", "inf") in seen["amax"]
    # A NaN takes its MXFP8 block's finite neighbours with it; per-tensor FP8 keeps them.
    assert ("nan", "-inf") in seen["sqnr_db"] and ("nan", "value") in seen["sqnr_db"]


def test_bf16_operand_is_refused():
    with pytest.raises(ValueError, match="not quantized"):
        operand_stats(jnp.ones((16, 16), jnp.bfloat16), OperandSpec(), 0)
