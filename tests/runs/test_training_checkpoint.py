"""Orbax checkpoints: the whole state, the data iterator, keep-last-k, no poisoned saves."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lp_jax.data import pipeline as data
from lp_jax.parallel.partitioning import state_shardings
from lp_jax.runs.checkpoint import Checkpointer, PoisonedStateError, abstract_like
from lp_jax.training.state import place_batch
from lp_jax.training.step import train_step
from tests.support.toy_models import setup


def iterator():
    src = data.PackedSequences([np.arange(500) % 32], seq_len=8, bos_id=-1)
    return data.train_iterator(src, seed=0, global_batch_size=4, read_threads=1)


@pytest.mark.parametrize("async_save", [True, False])
def test_save_restore_state_and_iterator(tmp_path, async_save):
    graphdef, spec, state = setup()
    it = iterator()
    ckpt = Checkpointer(tmp_path / "ck", keep=2, async_save=async_save)
    for step in range(1, 5):
        host = next(it)
        state, _ = train_step(graphdef, spec, state, place_batch(host, 1, spec.mesh))
        ckpt.save(step, jax.tree.map(jnp.copy, state), it, {"step": step})
    expected_batch = next(it)
    ckpt.close()

    ckpt = Checkpointer(tmp_path / "ck", keep=2)
    assert ckpt.all_steps() == [3, 4] and ckpt.latest_step() == 4
    target = abstract_like(state, state_shardings(state, spec.mesh))
    resumed_it = iterator()
    restored, meta = ckpt.restore(4, target, resumed_it)
    ckpt.close()
    assert meta == {"step": 4}
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype
    np.testing.assert_array_equal(next(resumed_it)["tokens"], expected_batch["tokens"])


def test_never_saves_a_poisoned_state(tmp_path):
    _, _, state = setup()
    bad = dict(state, params=jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.nan), state["params"]))
    ckpt = Checkpointer(tmp_path / "ck", keep=2)
    with pytest.raises(PoisonedStateError, match="refusing to save step 7"):
        ckpt.save(7, bad, None, {})
    ckpt.close()
    assert Checkpointer(tmp_path / "ck", keep=2).latest_step() is None
