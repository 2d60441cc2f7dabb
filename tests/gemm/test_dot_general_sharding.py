"""The quantized dot_general on sharded operands (8 forced CPU devices, in a subprocess).

For each recipe, on Auto and on Explicit meshes, with Megatron's column-parallel,
row-parallel and FSDP layouts: y and dx equal the unsharded results bit for bit, dW to
FP32 summation order, and y carries the requested out_sharding (or, on an Explicit mesh
without one, the sharding lax.dot_general would give). And FP8-CS's tensor amax is a
global all-reduce(max) in the compiled program.
"""
import pytest

from tests.support.forced_devices import run_python

SCRIPT = r'''
import re
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import lp_jax as lp

rng = np.random.default_rng(0)
x = rng.standard_normal((4, 32, 128)).astype(np.float32)
x[1, 2, 3] = 40.0  # the amax lives on one shard
w = (rng.standard_normal((128, 64)) * 0.1).astype(np.float32)
dn = (((2,), (0,)), ((), ()))
# name: (x spec, w spec, requested y spec, y spec an Explicit mesh gives without one)
layouts = {"column": (P("d", None, None), P(None, "t"), P("d", None, "t"), P("d", None, "t")),
           "row": (P("d", None, "t"), P("t", None), P("d", None, None), P("d", None, None)),
           "fsdp": (P("d", None, None), P("d", "t"), P("d", None, "t"), P("d", None, "t"))}
failures, checked = [], 0

def loss_and_grads(dg, out):
    def loss(x, w):
        y = dg(x.astype(jnp.bfloat16), w, dn, out_sharding=out)
        return jnp.sum(y.astype(jnp.float32) ** 2), y
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

for recipe in ("bf16", "fp8_cs", "mxfp8", "nvfp4"):
    dg = lp.dot_general(recipe)
    (_, y0), (gx0, gw0) = loss_and_grads(dg, None)(x, w)
    for axis_type in (AxisType.Auto, AxisType.Explicit):
        mesh = jax.make_mesh((2, 4), ("d", "t"), axis_types=(axis_type, axis_type))
        for name, (xs, ws, ys, default) in layouts.items():
            for requested in (ys, None):
                if requested is None and (axis_type == AxisType.Auto or name == "fsdp"):
                    continue  # Auto picks its own sharding; fsdp's default is column's
                tag = f"{recipe} {axis_type.name} {name} out_sharding={requested}"
                checked += 1
                try:
                    with jax.set_mesh(mesh):
                        xx = jax.device_put(x, NamedSharding(mesh, xs))
                        ww = jax.device_put(w, NamedSharding(mesh, ws))
                        out = None if requested is None else NamedSharding(mesh, requested)
                        (_, y), (gx, gw) = loss_and_grads(dg, out)(xx, ww)
                except Exception as e:
                    failures.append(f"{tag}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                    continue
                want = requested if requested is not None else default
                if tuple(y.sharding.spec) + (None,) * (3 - len(y.sharding.spec)) != tuple(want):
                    failures.append(f"{tag}: y sharded {y.sharding.spec}, wanted {want}")
                if not np.array_equal(np.asarray(y), np.asarray(y0)):
                    failures.append(f"{tag}: y differs from the unsharded result")
                if not np.array_equal(np.asarray(gx), np.asarray(gx0)):
                    failures.append(f"{tag}: dx differs from the unsharded result")
                if not np.allclose(np.asarray(gw), np.asarray(gw0), rtol=1e-5, atol=1e-6 * np.abs(np.asarray(gw0)).max()):
                    failures.append(f"{tag}: dW differs beyond FP32 summation order")

# FP8-CS on a sharded x: the tensor amax is reduced across devices with max (a max over
# the bits of |x|, quantize.abs_max: u16 for a bf16 x).
mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
xx = jax.device_put(x.reshape(128, 128), NamedSharding(mesh, P("d", None)))
hlo = jax.jit(lambda a: lp.dot_general("fp8_cs")(a.astype(jnp.bfloat16), jnp.asarray(w), (((1,), (0,)), ((), ())))).lower(xx).compile().as_text()
amax = [l for l in hlo.splitlines() if re.search(r"= (f32|u16|u32)\[\] all-reduce\(", l) and "reduce_max" in l]
print("AMAX_ALLREDUCE_MAX", any("'d'=8" in l for l in amax))
print("CHECKED", checked)
print("FAILURES", len(failures))
print("\n".join(failures))
'''


@pytest.mark.slow
def test_quantized_dot_general_on_sharded_operands():
    proc = run_python(["-c", SCRIPT])
    assert "CHECKED 32" in proc.stdout, proc.stdout
    assert "FAILURES 0" in proc.stdout, proc.stdout
    assert "AMAX_ALLREDUCE_MAX True" in proc.stdout, proc.stdout
