"""bench/hlo_collectives.py reads collective bytes from real compiled HLO, loops included
(4 forced CPU devices, in a subprocess)."""
import json

from tests.support.forced_devices import run_python

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
    proc = run_python(["-c", SCRIPT], devices=4, timeout=120)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 5 in result["trips"]
    assert result["bytes"]["all-gather"] == 5 * 16 * 32 * 4  # 5 trips x one f32 [16, 32] shard
    assert result["bytes"]["reduce-scatter"] == result["bytes"]["all-to-all"] == 0


WIDENED = r'''
import json
import jax, jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from bench.hlo_collectives import all_gathers

mesh = Mesh(jax.devices()[:4], ("d",), axis_types=(AxisType.Auto,))
def body(w):  # a bf16 and a uint8 gather of [16, 32] shards
    b = lax.all_gather(w.astype(jnp.bfloat16), "d", axis=0, tiled=True)
    u = lax.all_gather(lax.bitcast_convert_type(w.astype(jnp.float8_e4m3fn), jnp.uint8), "d", axis=0, tiled=True)
    return b.astype(jnp.float32) + u.astype(jnp.float32)
f = jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P(), check_vma=False)
w = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("d")))
text = jax.jit(f).lower(w).compile().as_text()
print(json.dumps(sorted((g["dtype"], g["wire"], g["bytes"]) for g in all_gathers(text))))
'''


def test_all_gathers_see_through_xla_cpu_widening():
    """XLA:CPU compiles a bf16 all-gather as convert-to-f32 then an f32 all-gather; the
    bytes the program moves are the bf16 ones (a uint8 gather is kept as it is)."""
    proc = run_python(["-c", WIDENED], devices=4, timeout=120)
    gathers = [tuple(g) for g in json.loads(proc.stdout.strip().splitlines()[-1])]
    assert gathers == [("f32", "bf16", 16 * 32 * 2), ("u8", "u8", 16 * 32)], gathers
