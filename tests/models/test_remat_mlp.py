"""remat="mlp": the backward rebuilds the MLP block (its norm, gate, up, SwiGLU and the down
projection's copies of the product) from the mid-layer residual, which the layer keeps anyway.
The loss and every gradient are the same bits as remat="none"; the layer keeps exactly the
MLP block's activations less, and nothing instead."""
import collections

import jax.numpy as jnp
import pytest

from lp_jax.config.yaml_io import load_config
from lp_jax.training.validate import resolve
from models import llama
from tests.support.forced_devices import run_python
from tests.support.jaxpr_eqns import count_eqns
from tests.support.layer_residuals import layer_vjp_leaves
from tests.support.recompute_bits import model

B, L = 2, 40  # 80 tokens: no weight's size is a multiple of it at the tiny shapes
T = B * L
CFG = llama.preset("tiny")
D, F = CFG.hidden_size, CFG.intermediate_size


@pytest.mark.slow  # a subprocess compiling eight value-and-grads
def test_same_loss_and_gradients_bit_for_bit():
    """With XLA's excess precision off, as tests/models/test_mlp_product_recompute.py says why."""
    cases = ["bf16:mlp", "fp8_cs:mlp", "mxfp8:mlp", "nvfp4:mlp"]
    proc = run_python(["tests/support/recompute_bits.py", "mlp", *cases], devices=1,
                      xla_flags="--xla_allow_excess_precision=false")
    assert proc.stdout.split("\n")[:-1] == [f"{c.replace(':', ' ')} True" for c in cases]


def _per_token_residuals(recipe: str, remat: str) -> collections.Counter:
    """(shape, dtype) of each per-token tensor layer 0's VJP keeps, with multiplicity."""
    leaves = layer_vjp_leaves(model(recipe, False, remat), B, L)
    return collections.Counter((leaf.shape, leaf.dtype.name) for leaf in leaves
                               if leaf.size and leaf.size % T == 0)


# What the MLP block's GEMMs and SwiGLU keep under remat="none": the norm output as each of
# gate's and up's inputs (BF16, or their FP8 / NVFP4 wgrad copies with NVFP4's block scales),
# gate and up, and the product as the down projection's input (or its copy).
MLP_BLOCK_RESIDUALS = {
    "bf16": {((B, L, D), "bfloat16"): 2, ((B, L, F), "bfloat16"): 3},
    "fp8_cs": {((T, D), "float8_e4m3fn"): 2, ((B, L, F), "bfloat16"): 2, ((T, F), "float8_e4m3fn"): 1},
    "nvfp4": {((D, T), "float4_e2m1fn"): 2, ((D, T // 16), "float8_e4m3fn"): 2, ((B, L, F), "bfloat16"): 2,
              ((F, T), "float4_e2m1fn"): 1, ((F, T // 16), "float8_e4m3fn"): 1},
}


@pytest.mark.parametrize("recipe", sorted(MLP_BLOCK_RESIDUALS))
def test_the_layer_keeps_exactly_the_mlp_blocks_activations_less(recipe):
    kept, rebuilt = _per_token_residuals(recipe, "none"), _per_token_residuals(recipe, "mlp")
    assert not rebuilt - kept, f"kept instead: {dict(rebuilt - kept)}"
    assert dict(kept - rebuilt) == MLP_BLOCK_RESIDUALS[recipe]


@pytest.mark.slow
def test_the_trainers_steps_run_it(monkeypatch):
    """The trainer merges the model inside its scans (train and validation steps): the
    rebuild must not write back into Variables of another trace. Its losses equal remat
    none's to BF16 roundings (XLA's default excess precision; bits: the slow test)."""
    import numpy as np

    from lp_jax.training.state import place_batch
    from lp_jax.training.step import eval_step, train_step
    from tests.support import toy_models

    def run(remat):
        monkeypatch.setattr(toy_models, "ToyLM", lambda rngs, noisy: model("nvfp4", False, remat))
        graphdef, spec, state = toy_models.setup(accum=2)
        host = toy_models.batch(4)
        nll, count = eval_step(graphdef, spec, state, place_batch(host, 2, spec.mesh))
        _, metrics = train_step(graphdef, spec, state, place_batch(host, 2, spec.mesh))  # donates
        return float(metrics["loss"]), float(nll) / float(count)

    np.testing.assert_allclose(run("mlp"), run("none"), rtol=1e-2)


def test_generation_with_a_kv_cache_runs_the_block_as_it_is():
    """A trained model's config keeps its remat: decoding with a KV cache calls the MLP
    block plainly and gives remat none's tokens."""
    from flax import nnx

    from models.generate import generate

    prompt = jnp.array([[3, 9, 27, 5]], jnp.int32)
    out = {remat: generate(llama.Llama(llama.preset("tiny", remat=remat, num_layers=1), rngs=nnx.Rngs(0)),
                           prompt, max_new_tokens=5) for remat in ("none", "mlp")}
    assert jnp.array_equal(out["mlp"], out["none"])


def test_a_run_takes_it_and_does_not_also_rebuild_the_product(tmp_path):
    plan = resolve(load_config(None, [f"run_dir={tmp_path}", "data.source=mock", "precision=nvfp4",
                                      "model.remat=mlp"]), check_files=False)
    assert plan.model_config.remat == "mlp"
    assert plan.model_config.recompute_mlp_product is False  # inside the rebuilt block already
    with pytest.raises(ValueError, match="remat='mlpp'; allowed: .*mlp"):
        llama.preset("tiny", remat="mlpp")


def _backward_reduce_maxes(remat: str) -> int:
    import jax
    from flax import nnx

    m = model("fp8_cs", False, remat)
    graphdef, params, rest = nnx.split(m.layers[0], nnx.Param, ...)
    body = m._layer_fn(graphdef)
    x = jnp.ones((B, L, D), m.config.dtype)
    rope = llama.rope_tables(jnp.broadcast_to(jnp.arange(L), (B, L)), m.config)
    mask = llama.causal_document_mask(None, B, L)
    out, vjp = jax.vjp(lambda p, x: body(p, rest, x, jnp.int32(0), rope, mask, None), params, x)
    return count_eqns(jax.make_jaxpr(vjp)(out).jaxpr, lambda eqn: eqn.primitive.name == "reduce_max")


def test_the_rebuild_casts_to_fp8_with_the_forwards_amaxes():
    """FP8-CS's tensor amaxes are kept (models.config.REBUILD_SAVED, a scalar each): the
    rebuilt block casts gate's, up's and down's inputs again without reducing them again,
    so its backward takes as many maxima as remat none's (it took 6 more before)."""
    assert _backward_reduce_maxes("mlp") == _backward_reduce_maxes("none")
