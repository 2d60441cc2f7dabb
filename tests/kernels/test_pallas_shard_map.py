"""Inside the trainer's data shard_map a per-tensor scale comes from the whole tensor's amax
(every device's piece, lp_jax.numerics.manual_axes): the Pallas kernels' amax reduces over
the manual axes as XLA's does, so both give the same bits there. The devices are stood in
for by a vmap with the axis's name (its collectives reduce over the mapped pieces): Pallas's
GPU interpreter, run on two CPU devices at once, races on its shared memory."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lp_jax as lp
from lp_jax.numerics.manual_axes import manual_axes


@pytest.mark.parametrize("fmt,axis", [("nvfp4", 1), ("nvfp4", 0), ("fp8_e4m3", 1)])
def test_the_kernels_tensor_scale_covers_every_devices_piece_as_xlas_does(fmt, axis):
    x = jax.random.normal(jax.random.key(0), (64, 96), jnp.float32).astype(jnp.bfloat16)
    pieces = x.at[:32].multiply(8).reshape(2, 32, 96)  # the two pieces' amaxes differ

    def run(impl):
        def piece(p):
            with manual_axes(("data",)):
                q = lp.quantize(p, fmt, axis=axis, impl=impl)
            return q.data.astype(jnp.float32), q.global_scale if fmt == "nvfp4" else q.scale
        return [np.asarray(a) for a in jax.jit(jax.vmap(piece, axis_name="data"))(pieces)]

    xla, pallas = run("xla"), run("pallas")
    assert xla[1][0] == xla[1][1]  # one tensor scale: the whole tensor's
    assert all(np.array_equal(a, b) for a, b in zip(xla, pallas))
