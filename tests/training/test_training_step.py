"""The jitted train step: accumulation, the non-finite guard, masking, SR keys."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lp_jax.training.state import place_batch
from lp_jax.training.step import eval_step, train_step
from tests.support.toy_models import LM_VOCAB, batch, setup


def run_step(graphdef, spec, state, host_batch):
    placed = place_batch(host_batch, spec.accum_steps, spec.mesh)
    return train_step(graphdef, spec, state, placed)


def test_accumulation_matches_one_big_batch():
    host = batch(4)
    g1, s1, st1 = setup(accum=1)
    g2, s2, st2 = setup(accum=2)
    new1, m1 = run_step(g1, s1, st1, host)
    new2, m2 = run_step(g2, s2, st2, host)
    np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-6)
    np.testing.assert_allclose(m1["grad_norm"], m2["grad_norm"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(new1["params"]), jax.tree.leaves(new2["params"])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert int(new1["step"]) == int(new1["opt_steps"]) == 1 and float(m1["tokens"]) == 4 * 8


def test_loss_goes_down_and_lr_follows_the_schedule():
    graphdef, spec, state = setup()
    host = batch(4)
    losses, lrs = [], []
    for _ in range(8):
        state, m = run_step(graphdef, spec, state, host)
        losses.append(float(m["loss"]))
        lrs.append(float(m["lr"]))
    assert losses[-1] < losses[0] - 0.5
    assert lrs[0] == 0.0 and abs(lrs[1] - 1e-2) < 1e-8  # warmup 1 step from 0


def test_nonfinite_step_is_skipped_and_counted():
    graphdef, spec, state = setup()
    host = batch(4)
    state, _ = run_step(graphdef, spec, state, host)
    before = jax.tree.map(np.asarray, state)
    # An id with no embedding row: the lookup yields NaN, as a shard from another
    # tokenizer would (the loop's debug.inject_nan_at_steps feeds the same).
    after, m = run_step(graphdef, spec, state, dict(host, tokens=np.full_like(host["tokens"], LM_VOCAB)))
    assert not bool(m["finite"]) and np.isnan(float(m["loss"]))
    for a, b in zip(jax.tree.leaves(before["params"]) + jax.tree.leaves(before["opt_state"]),
                    jax.tree.leaves(after["params"]) + jax.tree.leaves(after["opt_state"])):
        np.testing.assert_array_equal(a, b)  # bit for bit: no update, no moment change
    assert (int(after["step"]), int(after["opt_steps"]), int(after["nonfinite_steps"])) == (2, 1, 1)
    assert int(after["nonfinite_in_a_row"]) == 1  # the streak is in the (checkpointed) state
    after, m = run_step(graphdef, spec, after, host)  # and training goes on
    assert bool(m["finite"]) and int(after["opt_steps"]) == 2
    assert int(after["nonfinite_in_a_row"]) == 0 and int(after["nonfinite_steps"]) == 1


def test_overflowed_activations_count_as_a_failed_step():
    """Activations past FP32's range make RMSNorm's output 0: loss ln(vocab) exactly and a
    zero gradient norm, which is no learning step and must not pass as a finite one."""
    from models.config import preset
    from models.llama import Llama

    cfg = preset("tiny", num_layers=1)
    graphdef, spec, state = setup(model=lambda rngs: Llama(cfg, rngs=rngs))
    embedding = state["params"]["embed"]["embedding"]
    embedding.set_value(embedding[...] * 1e22)  # rows of ~2e20: their squares overflow
    before = jax.tree.map(np.asarray, state["params"])
    after, m = run_step(graphdef, spec, state, batch(4))
    assert float(m["grad_norm"]) == 0.0
    np.testing.assert_allclose(float(m["loss"]), np.log(cfg.vocab_size), rtol=1e-6)
    assert not bool(m["finite"]) and int(after["nonfinite_steps"]) == 1
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after["params"])):
        np.testing.assert_array_equal(a, b)


def test_masked_targets_do_not_count():
    graphdef, spec, state = setup()
    host = batch(2)
    host["loss_mask"][:, 4:] = False
    other = {k: v.copy() for k, v in host.items()}
    other["targets"][:, 4:] = (other["targets"][:, 4:] + 1) % 32
    n1, c1 = eval_step(graphdef, spec, state, place_batch(host, 1, spec.mesh))
    n2, c2 = eval_step(graphdef, spec, state, place_batch(other, 1, spec.mesh))
    assert float(c1) == float(c2) == 2 * 4 and float(n1) == float(n2)


@pytest.mark.slow
def test_stochastic_rounding_bits_follow_step_and_microbatch():
    host = batch(4)
    graphdef, spec, state = setup(noisy=True)
    # The same state and batch give the same loss when recomputed ...
    copy = jax.tree.map(jnp.copy, state)
    _, a = run_step(graphdef, spec, state, host)
    _, b = run_step(graphdef, spec, jax.tree.map(jnp.copy, copy), host)
    assert float(a["loss"]) == float(b["loss"])
    # ... but another step number draws other bits.
    shifted = dict(jax.tree.map(jnp.copy, copy), step=jnp.int32(5))
    _, c = run_step(graphdef, spec, shifted, host)
    assert float(c["loss"]) != float(a["loss"])
    # Micro-batches draw different bits from each other: two identical halves of the
    # batch do not give identical contributions when noise is on.
    g2, s2, st2 = setup(accum=2, noisy=True)
    twice = {k: np.concatenate([v[:2], v[:2]]) for k, v in host.items()}
    _, d = run_step(g2, s2, st2, twice)
    g1, s1, st1 = setup(accum=1, noisy=True)
    _, e = run_step(g1, s1, st1, {k: v[:2] for k, v in host.items()})
    assert float(d["loss"]) != float(e["loss"])
