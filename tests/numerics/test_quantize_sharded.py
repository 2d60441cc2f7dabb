"""Quantizing an array sharded over 8 CPU devices equals the unsharded result bit for bit.

The tensor amax of FP8-CS and NVFP4 must be global (over all shards), and blocks that cross
shard boundaries must come out the same. The device count is fixed when JAX starts, so the
check runs in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8.
"""
import pytest

from tests.support.forced_devices import run_python

SCRIPT = r'''
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import lp_jax as lp

assert jax.device_count() == 8, jax.devices()
x = np.random.default_rng(0).standard_normal((64, 96)).astype(np.float32)
x[5, 7] = 300.0  # the tensor amax lives on one shard only
key = jax.random.key(0)
cases = [("fp8_e4m3", -1, {}), ("fp8_e5m2", 0, {}), ("mxfp8", -1, {}), ("mxfp8", 0, {}),
         ("nvfp4", -1, {}), ("nvfp4", 0, {}), ("nvfp4", -1, {"block_2d": True}),
         ("nvfp4", -1, {"rounding": "stochastic", "key": key})]

def bits(tree):
    return [np.atleast_1d(np.asarray(leaf)).view(np.uint8) for leaf in jax.tree.leaves(tree)]

def quantizer(fmt, axis, kw):
    return jax.jit(lambda a: lp.quantize(a, fmt, axis, **kw))

unsharded = {i: quantizer(*c)(jnp.asarray(x)) for i, c in enumerate(cases)}
failures, checked = [], 0
# Auto: GSPMD propagates shardings; Explicit: the default of jax.make_mesh in JAX 0.12, with
# shardings in the types (what per-call out_sharding code uses).
for axis_type in (AxisType.Auto, AxisType.Explicit):
    mesh = jax.make_mesh((8,), ("d",), axis_types=(axis_type,))
    for spec in (P("d", None), P(None, "d")):
        xs = jax.device_put(x, NamedSharding(mesh, spec))
        for i, (fmt, axis, kw) in enumerate(cases):
            name = f"{axis_type.name} mesh, x sharded {spec}, {fmt} axis={axis} {sorted(kw)}"
            checked += 1
            try:
                with jax.set_mesh(mesh):
                    got = quantizer(fmt, axis, kw)(xs)
                    deq = lp.dequantize(got)
            except Exception as e:
                failures.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                continue
            same = all(np.array_equal(w, g) for w, g in zip(bits(unsharded[i]), bits(got), strict=True))
            same &= np.array_equal(bits(lp.dequantize(unsharded[i])), bits(deq))
            if not same:
                failures.append(f"{name}: bits differ from the unsharded result")
print("CHECKED", checked)
print("FAILURES", len(failures))
print("\n".join(failures))
'''


@pytest.fixture(scope="module")
def sharded_report():
    """Runs SCRIPT once; returns {mesh kind: [failure lines]}."""
    proc = run_python(["-c", SCRIPT], timeout=300)
    assert "CHECKED 32" in proc.stdout, proc.stdout
    lines = proc.stdout.splitlines()
    return {kind: [line for line in lines if line.startswith(f"{kind} mesh")] for kind in ("Auto", "Explicit")}


@pytest.mark.slow
def test_sharded_quantize_equals_unsharded_auto_mesh(sharded_report):
    failures = sharded_report["Auto"]
    assert not failures, "\n".join(failures)


def test_sharded_quantize_equals_unsharded_explicit_mesh(sharded_report):
    # jax.make_mesh's default in JAX 0.12: shardings are part of the array types, and a
    # reshape that splits a sharded axis into blocks needs an explicit out_sharding.
    failures = sharded_report["Explicit"]
    assert not failures, "\n".join(failures)
