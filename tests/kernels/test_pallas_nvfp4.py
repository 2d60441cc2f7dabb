"""lp.quantize(impl="pallas") gives lp.quantize(impl="xla")'s bits for NVFP4: 1x16 blocks
along each axis, 16x16 tiles, nearest and stochastic rounding (the same key, the same bits),
ragged shapes, special and non-finite values (Pallas GPU interpreter on CPU)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lp_jax as lp
from tests.support.pallas_checks import both_impls as _both
from tests.support.pallas_checks import mixed

KEY = jax.random.key(7)


def test_nvfp4_1x16_nearest_and_stochastic():
    x = mixed((40, 72))
    _both(x, "nvfp4", axis=1)
    _both(x, "nvfp4", axis=0)
    # The same key draws the same bits in the kernel as in XLA, along either axis.
    a = _both(x.astype(jnp.bfloat16), "nvfp4", axis=1, rounding="stochastic", key=KEY)
    _both(x.astype(jnp.bfloat16), "nvfp4", axis=0, rounding="stochastic", key=KEY)
    # ... and a different key different bits (the bits are not ignored).
    b = lp.quantize(x.astype(jnp.bfloat16), "nvfp4", 1, rounding="stochastic", key=jax.random.key(8), impl="pallas")
    assert not np.array_equal(np.asarray(a.data).view(np.uint8), np.asarray(b.data).view(np.uint8))


def test_nvfp4_16x16_tiles_and_non_finite_tensors():
    x = mixed((3, 40, 24))  # batched 16x16 tiles over the last two axes, both ragged
    _both(x, "nvfp4", block_2d=True)
    _both(x.astype(jnp.bfloat16), "nvfp4", block_2d=True, rounding="stochastic", key=KEY)
    _both(mixed((40, 72), nonfinite=True), "nvfp4")  # NaN amax: S_enc 1, NaN blocks stay NaN
    _both(jnp.zeros((50,), jnp.bfloat16), "nvfp4")  # 1-D, all zeros


@pytest.mark.slow  # about 40 s on 2 cores: 2 x 2 tiles of 128 in the interpreter
def test_nvfp4_grids_of_several_tiles_draw_the_same_bits():
    """Tiles past the first (i, j > 0, and a batch for 16x16): each tile's amax partial,
    scales and SR indices land where the XLA path puts them."""
    x = mixed((136, 144)).astype(jnp.bfloat16)  # 2 x 2 tiles of 128, ragged
    _both(x, "nvfp4", axis=1, rounding="stochastic", key=KEY)
    _both(x, "nvfp4", axis=0, rounding="stochastic", key=KEY)
    _both(mixed((2, 264, 136)), "nvfp4", block_2d=True, rounding="stochastic", key=KEY)  # 2 x 2 x 2 tiles
