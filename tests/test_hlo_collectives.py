"""bench/hlo_collectives.py reads collective bytes from real compiled HLO, loops included
(4 forced CPU devices, in a subprocess)."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r'''
import json
import jax, jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from bench.hlo_collectives import collective_bytes, trip_counts

mesh = Mesh(jax.devices()[:4], ("d",), axis_types=(AxisType.Auto,))
ws = jax.ShapeDtypeStruct((5, 64, 32), jnp.float32, sharding=NamedSharding(mesh, P(None, "d", None)))
x = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=NamedSharding(mesh, P()))

def f(x, ws):
    def body(carry, w):  # each step gathers its [64, 32] weight from 4 shards of [16, 32]
        w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P()))
        return carry + jnp.sum(x @ w), None
    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), ws)
    return total

text = jax.jit(f, out_shardings=NamedSharding(mesh, P())).lower(x, ws).compile().as_text()
print(json.dumps({"bytes": collective_bytes(text), "trips": trip_counts(text)}))
'''


def test_collective_bytes_count_loop_trips():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 5 in result["trips"]
    assert result["bytes"]["all-gather"] == 5 * 16 * 32 * 4  # 5 trips x one f32 [16, 32] shard
    assert result["bytes"]["reduce-scatter"] == result["bytes"]["all-to-all"] == 0
