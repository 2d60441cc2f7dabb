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


def test_a_state_entry_added_later_restores_as_zero_from_older_checkpoints(tmp_path):
    """Checkpoints written before the state held ``nonfinite_in_a_row`` still resume (the
    streak counts from 0); one that holds it restores its value."""
    _, spec, state = setup()
    state = dict(state, nonfinite_in_a_row=jnp.int32(2))
    older = {k: v for k, v in state.items() if k != "nonfinite_in_a_row"}
    ckpt = Checkpointer(tmp_path / "ck", keep=3, async_save=False)
    ckpt.save(1, older, None, {"step": 1})
    ckpt.save(2, state, None, {"step": 2})
    ckpt.close()

    target = abstract_like(state, state_shardings(state, spec.mesh))
    ckpt = Checkpointer(tmp_path / "ck", keep=3)
    with pytest.raises(ValueError, match="nonfinite_in_a_row"):  # why the option exists
        ckpt.restore(1, target, None)
    restored, _ = ckpt.restore(1, target, None, zero_if_missing=("nonfinite_in_a_row",))
    assert restored["nonfinite_in_a_row"].dtype == jnp.int32
    assert int(restored["nonfinite_in_a_row"]) == 0
    np.testing.assert_array_equal(restored["nonfinite_steps"], older["nonfinite_steps"])
    newer, _ = ckpt.restore(2, target, None, zero_if_missing=("nonfinite_in_a_row",))
    assert int(newer["nonfinite_in_a_row"]) == 2
    found = ckpt.restore_newest(target, None, zero_if_missing=("nonfinite_in_a_row",))
    ckpt.close()
    assert found.step == 2 and not found.skipped
