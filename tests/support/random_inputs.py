"""Random test inputs for the quantizer tests: normal, normal with outliers, log-uniform over
1e-30..1e30, and BF16 values (docs/quantizer_tests.md)."""
import ml_dtypes
import numpy as np


def normal(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def normal_with_outliers(rng, shape):
    """Normal, with about 1 element in 100 blown up to magnitude ~1e3 (one per block on average
    for MXFP8 when it hits: outliers are what per-tensor scaling handles worst)."""
    x = rng.standard_normal(shape)
    hit = rng.random(shape) < 0.01
    x[hit] = np.sign(x[hit]) * 1e3 * (1 + rng.random(hit.sum()))
    return x.astype(np.float32)


def log_uniform(rng, shape):
    """Magnitudes log-uniform over 1e-30..1e30 (all FP32 normal), random signs."""
    mag = 10.0 ** rng.uniform(-30, 30, shape)
    return (rng.choice([-1.0, 1.0], shape) * mag).astype(np.float32)


def bf16_valued(rng, shape):
    """bfloat16 inputs (ml_dtypes.bfloat16): what the recipes feed the quantizers."""
    return (rng.standard_normal(shape) * 3).astype(ml_dtypes.bfloat16)


DISTRIBUTIONS = {"normal": normal, "outliers": normal_with_outliers, "log_uniform": log_uniform,
                 "bf16": bf16_valued}
