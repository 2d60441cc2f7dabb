"""The quant-stats probe: what its taps report is operand_stats of the operands the GEMMs
really get (x, W and the backward's dy), for unrolled and scanned layers; BF16 layers are
listed as such; the records follow the documented schema."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lp_jax as lp
from lp_jax import context
from lp_jax.telemetry.probe import OPERANDS, as_numpy, collect, instrument
from lp_jax.telemetry.records import record, table
from lp_jax.telemetry.stats import STATS, operand_stats
from tests.support.toy_models import LINEARS_OF_BLOCK, StackedToy, Toy, loss_fn, unrolled_like

TOKENS = jnp.arange(64).reshape(2, 32) % 64


def probe(model, recipe):
    """(layout, statistics) of one forward and backward of the toy loss."""
    lp.apply_recipe(model, recipe)
    layout = instrument(model, recipe)
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state):
        with context.rng_scope(jax.random.key(0)):
            return collect(lambda s: (loss_fn(nnx.merge(graphdef, s), TOKENS), None), layout,
                           jax.random.key(1), state)[0]

    return layout, as_numpy(run(state))


def _stats(t, spec, axis):
    return np.asarray(jax.jit(operand_stats, static_argnums=(1, 2))(t, spec, axis))


def _close(got, want, what):
    # SQNR's float32 sums may be ordered differently in the two programs.
    np.testing.assert_allclose(got, want, rtol=3e-4, err_msg=what)
    np.testing.assert_array_equal(np.delete(got, STATS.index("sqnr_db")),
                                  np.delete(want, STATS.index("sqnr_db")), err_msg=what)


@pytest.mark.slow
def test_taps_report_the_stats_of_the_real_operands():
    model = Toy(num_layers=1)
    recipe = lp.get_recipe("mxfp8")
    layout, stats = probe(model, recipe)
    assert layout.num_layers == 1 and layout.linears == ("down_proj", "q_proj", "up_proj")
    d = 32
    x0 = model.embed(TOKENS).reshape(-1, d)  # layer 0's q_proj input
    w = model.layers[0].q_proj.kernel[...].astype(jnp.bfloat16)
    got = stats["q_proj"][0]
    for op, t, axis in (("fprop_x", x0, 1), ("wgrad_x", x0, 0), ("dgrad_w", w, 1)):
        _close(got[OPERANDS.index(op)], _stats(t, getattr(recipe, op), axis), op)
    # dy of the last down_proj is the gradient at the residual stream's end.
    xf = model.layers[0](model.embed(TOKENS))
    head = lambda x: -jnp.mean(jax.nn.log_softmax(model.lm_head(x).astype(jnp.float32))[..., 0])  # noqa: E731
    dy = jax.grad(head)(xf).reshape(-1, d)
    got = stats["down_proj"][0]
    _close(got[OPERANDS.index("dgrad_dy")], _stats(dy, recipe.dgrad_dy, 1), "dgrad_dy")
    assert np.all(np.isfinite(stats["up_proj"][:, :, STATS.index("sqnr_db")]))


@pytest.mark.slow
def test_scanned_stack_reports_what_the_unrolled_layers_do():
    stacked = StackedToy(num_layers=2)
    unrolled = unrolled_like(stacked)
    recipe = lp.get_recipe("mxfp8", bf16_layers=[1])
    layout_s, s = probe(stacked, recipe)
    layout_u, u = probe(unrolled, recipe)
    assert layout_s == layout_u
    for name in LINEARS_OF_BLOCK:
        _close(s[name][0], u[name][0], name)
        assert not u[name][1].any()  # the BF16 layer is not measured
    rows = record(7, layout_u, u)["layers"]
    assert [(r["layer"], r["bf16"]) for r in rows if r["linear"] == "q_proj"] == \
        [(0, False), (1, True)]
    assert all(r["operands"] is None for r in rows if r["bf16"])
    assert "| 1 | q_proj | BF16 |" in table(rows)


def test_record_schema():
    model = Toy(num_layers=2)
    layout, stats = probe(model, lp.get_recipe("fp8_cs", policy="F0L1"))
    rec = record(5, layout, stats)
    assert list(rec) == ["schema", "step", "recipe", "policy", "micro_batch", "layers"]
    assert (rec["schema"], rec["step"], rec["recipe"], rec["policy"]) == (1, 5, "fp8_cs", "F0L1")
    row = rec["layers"][0]
    assert list(row) == ["layer", "linear", "bf16", "operands"]
    assert list(row["operands"]) == list(OPERANDS)
    assert list(row["operands"]["fprop_x"]) == list(STATS)
    # per-tensor FP8: fprop and wgrad read the same bytes of x, so the same statistics
    assert row["operands"]["fprop_x"] == row["operands"]["wgrad_x"]
    assert rec["layers"][-1]["bf16"] and rec["layers"][-1]["operands"] is None


def test_instrument_refuses_a_bf16_recipe():
    model = Toy(num_layers=2)
    lp.apply_recipe(model, "bf16")
    with pytest.raises(ValueError, match="quantizes nothing"):
        instrument(model, lp.get_recipe("bf16"))
