"""lp_jax.inspect's sensitivity and policy: a planted bad layer (a few huge weights in one
layer) is ranked most sensitive and kept in BF16; a healthy toy needs no BF16 layer for a
generous budget; FiLj-shaped sets are printed as FiLj, others as precision.bf16_layers."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lp_jax as lp
from lp_jax.inspect import sensitivity as S
from tests.support.toy_models import Toy

TOKENS = jnp.arange(128).reshape(4, 32) % 64
RECIPE = lp.get_recipe("fp8_cs", policy="F0L0")


def loss_of_mask_for(model):
    """mask -> a loss of the model with the masked-in layers quantized (one compiled
    forward): the cross-entropy of its predictions against the all-BF16 model's, so that,
    as for a trained model's loss, every change quantization makes shows as an increase."""
    num_layers = S.make_selectable(model, RECIPE)
    graphdef, state = nnx.split(model)

    @jax.jit
    def log_probs(state, mask):
        with S.quantized_layers(mask):
            return jax.nn.log_softmax(nnx.merge(graphdef, state)(TOKENS).astype(jnp.float32))

    reference = jnp.exp(log_probs(state, jnp.zeros(num_layers, bool)))

    def loss_of_mask(mask):
        return float(-jnp.mean(jnp.sum(reference * log_probs(state, jnp.asarray(mask)), -1)))

    return loss_of_mask, num_layers


def plant_outliers(model):
    """A few weights of layer 0's q_proj 10^6 times the largest, on an input feature the
    embedding leaves at zero: harmless in BF16, but per-tensor FP8 scales to them and every
    other weight of that tensor falls below E4M3's smallest subnormal."""
    table = model.embed.embedding
    table.set_value(table[...].at[:, 5].set(0.0))
    kernel = model.layers[0].q_proj.kernel
    w = np.asarray(kernel[...]).copy()
    w[5, [1, 9, 20]] = 1e6 * np.abs(w).max() * np.array([1, -1, 1])
    kernel.set_value(jnp.asarray(w))


def test_planted_bad_layer_is_found_and_kept_in_bf16():
    model = Toy(num_layers=4)
    plant_outliers(model)
    loss_of_mask, n = loss_of_mask_for(model)
    sens = S.measure(loss_of_mask, n)
    gaps = [sens.gap_pct(x) for x in sens.layer_loss]
    assert sens.ranking()[0] == 0
    assert gaps[0] > 3 * max(abs(g) for g in gaps[1:])
    assert sens.gap_pct(sens.quantized_loss) > 0.5  # all quantized does not fit
    proposal = S.propose(sens, loss_of_mask, budget_pct=0.5)
    assert proposal.bf16_layers == [0] and proposal.gap_pct <= 0.5
    # the first layer: a FiLj fits, printed as such
    assert proposal.fil == (1, 0) and proposal.policy == "F1L0"
    assert proposal.override() == "precision.first_bf16_layers=1 precision.last_bf16_layers=0"


def test_healthy_toy_needs_no_bf16_layer():
    loss_of_mask, n = loss_of_mask_for(Toy(num_layers=4))
    sens = S.measure(loss_of_mask, n)
    assert sens.quantized_loss != sens.bf16_loss  # the mask does switch quantization on
    proposal = S.propose(sens, loss_of_mask, budget_pct=1.0)
    assert proposal.bf16_layers == [] and proposal.policy == "F0L0"
    assert proposal.override() == "precision.first_bf16_layers=0 precision.last_bf16_layers=0"


@pytest.mark.parametrize("losses, expected, override", [
    # layer 2 is the most sensitive, but keeping the last layer in BF16 fits too: FiLj first
    ({(2,): 2.005, (3,): 2.015}, [3], "precision.first_bf16_layers=0 precision.last_bf16_layers=1"),
    # only the most sensitive layer fits: an explicit list
    ({(2,): 2.005}, [2], "precision.bf16_layers=[2]"),
    # nothing with one BF16 layer fits; with two, the greedy pair [1, 2]
    ({(1, 2): 2.01}, [1, 2], "precision.bf16_layers=[1, 2]"),
])
def test_policy_choice(losses, expected, override):
    """Made-up losses (2.0 all BF16, 3.0 all quantized, 2.5 any set not listed)."""
    def loss_of_mask(mask):
        bf16 = tuple(int(i) for i in np.flatnonzero(~np.asarray(mask)))
        return 3.0 if not bf16 else 2.0 if len(bf16) == 4 else losses.get(bf16, 2.5)

    sens = S.Sensitivity(4, bf16_loss=2.0, quantized_loss=3.0, layer_loss=[2.1, 2.2, 2.9, 2.15])
    proposal = S.propose(sens, loss_of_mask, budget_pct=1.0)
    assert proposal.bf16_layers == expected and proposal.override() == override


@pytest.mark.parametrize("layers, expected", [
    ([], (0, 0)), ([0, 1, 7], (2, 1)), ([6, 7], (0, 2)), ([3], None), ([0, 2], None),
    (list(range(8)), (8, 0)),
])
def test_fil_of(layers, expected):
    assert S.fil_of(layers, 8) == expected
