"""Data parallelism reduces each gradient once per optimizer step, after the micro-batch
loop (8 forced CPU devices, in a subprocess).

The train step of a 2-layer tiny Llama with 4 micro-batches per data rank is compiled for
a pure data-parallel mesh (8,1,1), ZeRO-1 on it, and ZeRO-1 on a mixed mesh (2,2,2), and
its collectives are read from the compiled (XLA:CPU-optimized) HLO with
bench/hlo_collectives.py, each attributed to the mesh axes its device groups span. What
must hold:

- inside the micro-batch loop no sum crosses the data axis (FSDP's per-micro-batch
  gradient reduce-scatter and tensor parallelism's activation all-reduces stay on their
  own axes; FP8-CS's per-tensor amaxes are maxed over data, scalars, combined by XLA a
  few at a time, the weights' hoisted out of the loop);
- outside it, the data-axis sums carry one FP32 gradient (plus a few scalars: the loss,
  the token count, the gradient-norm partials): every gradient element is reduced once;
- with ZeRO-1 the weights are all-gathered over data once, outside the loop.
"""
import json

import pytest

from tests.support.forced_devices import run_python

SCRIPT = r'''
import json, math
import jax, jax.numpy as jnp
from flax import nnx
import lp_jax
from bench.hlo_collectives import collectives, mesh_axes, trip_counts
from lp_jax.training import state as state_lib
from lp_jax.parallel.mesh import make_mesh
from lp_jax.training.optimizer import make_optimizer
from lp_jax.parallel.partitioning import batch_sharding, state_shardings
from lp_jax.training.step import StepSpec, jitted_train_step
from models import llama
from tests.support.sharded_runs import OPTIMIZER

ACCUM, MICRO, SEQ = 4, 8, 32
out = []
for recipe, sizes, zero1 in (("bf16", (8, 1, 1), True), ("fp8_cs", (8, 1, 1), False),
                             ("bf16", (2, 2, 2), True)):
    mesh = make_mesh(*sizes)
    spec = StepSpec(OPTIMIZER, ACCUM, mesh, shard_optimizer=zero1, gather_dtype="bfloat16")
    model = nnx.eval_shape(lambda: llama.Llama(llama.preset("tiny", num_layers=2), rngs=nnx.Rngs(0)))
    lp_jax.apply_recipe(model, lp_jax.get_recipe(recipe, first_bf16_layers=0, last_bf16_layers=0))
    graphdef, params, rest = state_lib.split_model(model)
    target = state_lib.abstract_state((graphdef, params, rest), make_optimizer(OPTIMIZER), 0)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         target, spec.state_shardings(target))
    rows = batch_sharding(mesh)
    batch = {k: jax.ShapeDtypeStruct((ACCUM, MICRO, SEQ), dt, sharding=rows)
             for k, dt in (("tokens", jnp.int32), ("targets", jnp.int32), ("segment_ids", jnp.int32),
                           ("positions", jnp.int32), ("loss_mask", jnp.bool_))}
    text = jitted_train_step(spec, state).lower(graphdef, spec, state, batch).compile().as_text()
    # One FP32 gradient as each device holds it before the data reduction (split over
    # fsdp and tensor, whole over data).
    grad = sum(math.prod(s.shard_shape(p.shape)) * 4 for p, s in
               zip(jax.tree.leaves(params), jax.tree.leaves(state_shardings(params, mesh))))
    names = dict(zip(("data", "fsdp", "tensor"), sizes))
    rows = [dict(kind=c.kind, bytes=c.bytes, runs=c.runs, in_loop=c.in_loop,
                 axes=list(mesh_axes(c.groups, names)), reducer=c.reducer) for c in collectives(text)]
    out.append(dict(recipe=recipe, mesh=list(sizes), zero1=zero1, grad_bytes=grad,
                    trips=trip_counts(text), collectives=rows))
print(json.dumps(out))
'''


@pytest.mark.slow
def test_one_data_axis_gradient_reduction_per_step_outside_the_loop():
    proc = run_python(["-c", SCRIPT], timeout=900)
    for run in json.loads(proc.stdout.strip().splitlines()[-1]):
        where = (run["recipe"], run["mesh"], run["zero1"])
        assert 4 in run["trips"], where  # the micro-batch loop is there
        data = [c for c in run["collectives"] if "data" in c["axes"]]
        sums = [c for c in data if c["kind"] in ("all-reduce", "reduce-scatter") and c["reducer"] == "add"]
        assert not [c for c in sums if c["in_loop"]], (where, sums)
        outside = sum(c["bytes"] * c["runs"] for c in sums)
        assert run["grad_bytes"] <= outside <= run["grad_bytes"] + 1024, (where, outside, run["grad_bytes"])
        maxima = [c for c in data if c["reducer"] == "maximum"]
        if run["recipe"] == "fp8_cs":  # per-tensor amaxes maxed over data: a few scalars each
            assert [c for c in maxima if c["in_loop"]], where
            assert all(c["bytes"] <= 64 for c in maxima), (where, maxima)
        gathers = [c for c in data if c["kind"] == "all-gather"]
        if run["zero1"]:
            assert gathers and not any(c["in_loop"] for c in gathers), (where, gathers)
        else:
            assert not gathers, (where, gathers)
