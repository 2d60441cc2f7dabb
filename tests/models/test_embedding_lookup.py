"""models/embedding_lookup.py: the vocabulary-parallel lookup equals jnp.take bit for bit and
its gradient equals a scatter-add, and the trainer's step compiles on a mesh with data, fsdp
and tensor all > 1 at sequence 128, where XLA's SPMD partitioner aborted on the plain gather
(tests/support/embedding_lookup_runs.py, 8 forced CPU devices in a subprocess)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.embedding_lookup import embedding_lookup
from tests.support.forced_devices import run_python


@pytest.mark.slow
def test_vocab_parallel_lookup_and_sharded_step():
    proc = run_python(["tests/support/embedding_lookup_runs.py"])
    out = {r["check"]: r for r in map(json.loads, filter(lambda l: l.startswith("{"), proc.stdout.splitlines()))}
    lookup = out["lookup"]
    assert lookup["rows_bits_equal"] and lookup["negative_zeros"] > 0, lookup
    assert lookup["grad_equal"], lookup
    assert lookup["int_row_sums"] >= 1 and lookup["reduce_scatters"] >= 1, lookup
    losses = out["step"]["losses"]
    one, sharded = losses["(1, 1, 1)"], losses["(2, 2, 2)"]
    assert abs(sharded / one - 1) <= 1e-5, losses  # FP32 summation order only, as before any update


def test_without_rules_it_is_take_with_its_gradient():
    table = jnp.asarray(np.random.default_rng(0).standard_normal((16, 8)), jnp.float32)
    tokens = jnp.array([[3, 3, 15], [0, 7, 3]], jnp.int32)
    rows, vjp = jax.vjp(lambda t: embedding_lookup(t, tokens), table)
    assert np.array_equal(rows, table[tokens])
    (grad,) = vjp(jnp.ones_like(rows))
    assert np.array_equal(grad[:, 0], np.bincount(np.asarray(tokens).ravel(), minlength=16))
