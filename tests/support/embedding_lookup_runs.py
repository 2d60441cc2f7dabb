"""The vocabulary-parallel embedding lookup on 8 forced CPU devices, for test_embedding_lookup.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/support/embedding_lookup_runs.py

Prints one JSON line per check:

- "lookup": inside a shard_map manual over ``data`` on (data, fsdp, tensor) = (2, 2, 2), with
  the trainer's activation rules, ``embedding_lookup`` against ``jnp.take`` (rows compared as
  bits; the table holds -0.0s) and its table gradient against ``np.add.at`` (cotangents are
  small integers, so every FP32 sum is exact whatever its order);
- "step": the trainer's step for a 2-layer tiny Llama on 2x2x2 at sequence 128, where
  the partitioner's plain gather aborted the compilation, against one device.
"""
from __future__ import annotations

import json
import re

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lp_jax.parallel.mesh import make_mesh
from lp_jax.parallel.partitioning import activation_rules
from models.embedding_lookup import embedding_lookup

VOCAB, HIDDEN, BATCH, SEQ = 384, 128, 8, 128


def lookup_check() -> dict:
    rng = np.random.default_rng(0)
    table = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    table[rng.random(table.shape) < 0.05] = -0.0
    tokens = rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)
    tokens[0, :4] = [0, VOCAB - 1, VOCAB // 2 - 1, VOCAB // 2]  # both ends of both slices
    cot = rng.integers(-4, 5, (BATCH, SEQ, HIDDEN)).astype(np.float32)
    mesh = make_mesh(2, 2, 2)

    def per_rank(table, tokens, cot):
        with nnx.logical_axis_rules(activation_rules(("data",))):
            rows, vjp = jax.vjp(lambda t: embedding_lookup(t, tokens), table)
        (grad,) = vjp(cot)
        return rows, jax.lax.psum(grad, "data")

    @jax.jit
    def run(table, tokens, cot):
        return jax.shard_map(per_rank, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                             out_specs=(P("data"), P()), axis_names=frozenset({"data"}),
                             check_vma=False)(table, tokens, cot)

    with jax.set_mesh(mesh):
        placed = (jax.device_put(table, NamedSharding(mesh, P("tensor", "fsdp"))),
                  jax.device_put(tokens, NamedSharding(mesh, P(("data", "fsdp")))),
                  jax.device_put(cot, NamedSharding(mesh, P(("data", "fsdp")))))
        rows, grad = run(*placed)
        hlo = run.lower(*placed).compile().as_text()
    want_grad = np.zeros_like(table)
    np.add.at(want_grad, tokens.reshape(-1), cot.reshape(-1, HIDDEN))
    rows = np.asarray(rows)
    return {"check": "lookup", "rows_bits_equal": bool(np.array_equal(rows.view(np.int32),
                                                                       table[tokens].view(np.int32))),
            "negative_zeros": int(np.sum(np.signbit(rows) & (rows == 0))),
            "grad_equal": bool(np.array_equal(np.asarray(grad), want_grad)),
            # the path taken: rows summed as int32 bits, gradients reduce-scattered over fsdp
            "int_row_sums": len(re.findall(r"= s32\[\d+,\d+,\d+\][^ ]* all-reduce\(", hlo)),
            "reduce_scatters": hlo.count(" reduce-scatter(")}


def step_check() -> dict:
    from lp_jax.training import state as state_lib
    from lp_jax.training.step import train_step
    from tests.support import sharded_runs

    sharded_runs.SEQ = SEQ
    losses = {}
    for mesh_sizes in ((1, 1, 1), (2, 2, 2)):
        cfg, graphdef, spec, state, mesh = sharded_runs.build("bf16", "bfloat16", mesh_sizes)
        batch = sharded_runs.batches(cfg.vocab_size)[0]
        _, metrics = train_step(graphdef, spec, state, state_lib.place_batch(batch, 1, mesh))
        losses[str(mesh_sizes)] = float(metrics["loss"])
    return {"check": "step", "losses": losses}


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    for check in (lookup_check, step_check):
        print(json.dumps(check()), flush=True)
