"""Checkpoints of the other projection layout (models.fused_projections): a run with
separate q/k/v and gate/up resumes fused (and back), and starts another run fused through
init.checkpoint, every parameter and Adam moment joined or split exactly, said in one line."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lp_jax.training.loop import _save, build, run
from lp_jax.training.metrics import read_metrics
from lp_jax.training.validate import resolve
from models.fused_projections import value_at
from tests.training.test_training_loop import tiny

FUSED = "model.fused_projections=true"


def _by_names(state):
    """A train state's leaves as host arrays keyed by their path's names."""
    def names(path):
        return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
    return {names(p): np.asarray(leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}


def _write_checkpoint(config, step: int):
    """A checkpoint of ``config``'s run at ``step``, written as the loop writes one, with
    every float leaf made distinct (the Adam moments are zero in a fresh state); its state
    by names. No step is compiled."""
    built = build(resolve(config))
    try:
        leaves, treedef = jax.tree.flatten(built.state)
        keys = jax.random.split(jax.random.key(step), len(leaves))
        built.state = treedef.unflatten([
            x + jax.random.normal(k, x.shape, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
            for k, x in zip(keys, leaves)])
        _save(built, step)
        return _by_names(built.state)
    finally:
        built.close(failing=False)


def _built_state(config, capsys):
    """(the state a build restores, by names; what it said)."""
    capsys.readouterr()
    built = build(resolve(config))
    try:
        return _by_names(built.state), capsys.readouterr().out
    finally:
        built.close(failing=False)


def _assert_converted(got, saved, cfg):
    assert len(got) > 20 and set(got) != set(saved)  # the layouts differ, paths and all
    assert any("mu" in p and "kernel" in p for p in got)  # Adam's moments are converted too
    for path, array in got.items():
        np.testing.assert_array_equal(array, value_at(path, saved, cfg), err_msg=str(path))


def _config(run_dir, token_cache, *overrides):
    return tiny(run_dir, token_cache, "steps=4", "model.num_layers=1", "data.source=mock", *overrides)


@pytest.mark.slow
def test_resume_joins_a_separate_checkpoint(tmp_path, token_cache, capsys):
    saved = _write_checkpoint(_config(tmp_path, token_cache), 2)
    fused = _config(tmp_path, token_cache, FUSED)
    got, said = _built_state(fused, capsys)
    assert ("checkpoint 2 holds separate q/k/v and gate/up projections: converted exactly to "
            "fused qkv and gate_up (model.fused_projections=true)") in said
    assert any("qkv" in p for p in got) and not any("q_proj" in p for p in got)
    _assert_converted(got, saved, resolve(fused).model_config)


@pytest.mark.slow
def test_resume_splits_a_fused_checkpoint(tmp_path, token_cache, capsys):
    fused = _config(tmp_path, token_cache, FUSED)
    saved = _write_checkpoint(fused, 3)
    got, said = _built_state(_config(tmp_path, token_cache), capsys)
    assert ("checkpoint 3 holds fused qkv and gate_up projections: converted exactly to "
            "separate q/k/v and gate/up (model.fused_projections=false)") in said
    assert any("q_proj" in p for p in got) and not any("qkv" in p for p in got)
    _assert_converted(got, saved, resolve(fused).model_config)


def test_init_checkpoint_joins_a_separate_runs_weights(tmp_path, token_cache, capsys):
    saved = _write_checkpoint(_config(tmp_path / "src", token_cache), 2)
    new = _config(tmp_path / "new", token_cache, FUSED, f"init.checkpoint={tmp_path / 'src'}")
    got, said = _built_state(new, capsys)
    assert "its separate q/k/v and gate/up projections converted exactly to fused qkv and gate_up" in said
    cfg = resolve(new).model_config
    params = {p[1:]: a for p, a in saved.items() if p[0] == "params"}
    fused = {p[1:]: a for p, a in got.items() if p[0] == "params"}
    assert any("qkv" in p for p in fused) and len(fused) == len(params) - 3
    for path, array in fused.items():
        np.testing.assert_array_equal(array, value_at(path, params, cfg), err_msg=str(path))


@pytest.mark.slow
def test_a_run_resumed_fused_trains_on(tmp_path, token_cache):
    """Two steps with separate projections, two more fused: the loss goes on from where it
    was (BF16: the fused forward is the separate one's; the backward sums dx in one GEMM)."""
    run(resolve(tiny(tmp_path / "a", token_cache, "steps=4")))
    run(resolve(tiny(tmp_path / "b", token_cache, "steps=4", "stop_at=2")))
    assert run(resolve(tiny(tmp_path / "b", token_cache, "steps=4", FUSED))).step == 4
    straight = [m["loss"] for m in read_metrics(tmp_path / "a")]
    resumed = [m["loss"] for m in read_metrics(tmp_path / "b")]
    assert resumed[:2] == straight[:2]
    np.testing.assert_allclose(resumed[2:], straight[2:], rtol=1e-2)
