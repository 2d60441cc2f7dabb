"""recompute_mlp_product: the backward rebuilds the SwiGLU product and the down projection's
copies of it from gate and up, which SwiGLU's backward keeps anyway, instead of keeping them.
The loss and every gradient are the same bits; the layer keeps exactly the product's copy
less; a run's default turns it on where that copy would be a quantized one."""
import jax.numpy as jnp
import pytest

from lp_jax.config.yaml_io import load_config
from lp_jax.training.validate import resolve
from models import llama
from tests.support.forced_devices import run_python
from tests.support.layer_residuals import layer_vjp_leaves
from tests.support.recompute_bits import model

B, L = 2, 40  # 80 tokens: no weight's size is a multiple of it at the tiny shapes


@pytest.mark.slow  # a subprocess compiling six train steps
def test_same_loss_and_gradients_bit_for_bit():
    """In a process with XLA's excess precision off: with it on (XLA's default), a BF16
    intermediate fused into another kernel may stay FP32, and the remat's boundaries move
    the fusions, so the two programs differ by BF16 roundings (as any two compilations of
    the same step may: docs/scaling.md)."""
    cases = ["bf16:none", "fp8_cs:megatron", "nvfp4:none"]
    proc = run_python(["tests/support/recompute_bits.py", "product", *cases], devices=1,
                      xla_flags="--xla_allow_excess_precision=false")
    assert proc.stdout.split("\n")[:-1] == [f"{c.replace(':', ' ')} True" for c in cases]


@pytest.mark.slow
def test_the_trainers_steps_run_it(monkeypatch):
    """The trainer merges the model inside its scans (train and validation steps): the remat
    must not write back into Variables of another trace. Its losses equal the kept-input
    model's to BF16 roundings (XLA's default excess precision; bits: the test above)."""
    import numpy as np

    from lp_jax.training.state import place_batch
    from lp_jax.training.step import eval_step, train_step
    from tests.support import toy_models

    def run(recompute):
        monkeypatch.setattr(toy_models, "ToyLM", lambda rngs, noisy: model("fp8_cs", recompute, "none"))
        graphdef, spec, state = toy_models.setup(accum=2)
        host = toy_models.batch(4)
        nll, count = eval_step(graphdef, spec, state, place_batch(host, 2, spec.mesh))
        _, metrics = train_step(graphdef, spec, state, place_batch(host, 2, spec.mesh))  # donates
        return float(metrics["loss"]), float(nll) / float(count)

    kept, recomputed = run(False), run(True)
    np.testing.assert_allclose(recomputed, kept, rtol=1e-2)


def _per_token_residuals(recipe: str, recompute: bool) -> list[tuple]:
    """(shape, dtype) of each per-token tensor layer 0's VJP keeps."""
    leaves = layer_vjp_leaves(model(recipe, recompute, "none"), B, L)
    return sorted((leaf.shape, leaf.dtype.name) for leaf in leaves if leaf.size and leaf.size % (B * L) == 0)


@pytest.mark.parametrize("recipe,dtype", [("bf16", "bfloat16"), ("fp8_cs", "float8_e4m3fn")])
def test_the_layer_keeps_exactly_the_products_copy_less(recipe, dtype):
    """Dropped: the product (BF16) or its FP8 copy, and nothing else; nothing is kept instead."""
    kept, recomputed = _per_token_residuals(recipe, False), _per_token_residuals(recipe, True)
    dropped = list(kept)
    for item in recomputed:
        dropped.remove(item)  # raises if something new is kept
    sizes = [(int(jnp.prod(jnp.array(shape))), name) for shape, name in dropped]
    assert sizes == [(B * L * llama.preset("tiny").intermediate_size, dtype)]


def test_a_run_recomputes_where_it_quantizes_unless_told(tmp_path):
    def plan(*keys):
        return resolve(load_config(None, [f"run_dir={tmp_path}", "data.source=mock", *keys]),
                       check_files=False).model_config.recompute_mlp_product
    assert plan() is False  # BF16 keeps the product, as Megatron's layer does
    assert plan("precision=fp8_cs") is True
    assert plan("precision=fp8_cs", "model.remat=elementwise") is False  # the policy decides
    assert plan("precision=nvfp4", "model.recompute_mlp_product=false") is False
    assert plan("model.recompute_mlp_product=true") is True
    with pytest.raises(ValueError, match="recompute_mlp_product must be true or false"):
        llama.preset("tiny", recompute_mlp_product="yes")
