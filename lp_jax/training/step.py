"""The jitted train and eval steps.

``train_step`` and ``eval_step`` take the model's graphdef and a hashable StepSpec (which
holds the mesh) as static arguments and the state as an ordinary pytree: ``nnx.merge``
runs inside, at trace time only. Each is a ``jax.jit`` with explicit in/out shardings from
``partitioning`` (state by the parameter rules, batches over (data, fsdp), metrics
replicated), built once per (spec, state structure) and cached, so two runs with the
same config in one process (the resume tests) share one compilation. A precision recipe
lives in the graphdef (the swapped ``dot_general``), so switching recipe compiles a new
step.

Inside, the forward runs under the mesh and ``partitioning.ACTIVATION_RULES`` (the
model's logical activation constraints), and gradients are constrained to the
parameters' shardings: FSDP reduce-scatters them, as ZeRO-3 does.

Stochastic-rounding bits: the forward of micro-batch ``m`` of step ``s`` runs inside
``lp_jax.context.rng_scope(fold_in(fold_in(key(seed), s), m))``, so a resumed run
redraws exactly the bits the uninterrupted run drew.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lp_jax import context
from lp_jax.training.optimizer import OptimizerSpec, learning_rate_schedule, make_optimizer
from lp_jax.training.partitioning import ACTIVATION_RULES, batch_sharding, state_shardings


@dataclasses.dataclass(frozen=True)
class StepSpec:
    optimizer: OptimizerSpec
    accum_steps: int
    mesh: Mesh


def global_norm(tree) -> jax.Array:
    """sqrt of the sum of squares of all leaves (what clip_by_global_norm compares)."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def token_nll(logits, targets, mask):
    """(sum of next-token negative log-likelihoods over unmasked tokens, their count), FP32."""
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    mask = mask.astype(jnp.float32)
    return jnp.sum((log_z - target_logit) * mask), jnp.sum(mask)


def _forward_nll(graphdef, params, rest, micro, key, mesh):
    model = nnx.merge(graphdef, params, rest)
    # The abstract mesh makes the model's logical constraints (models.sharding) concrete;
    # jit's in/out shardings supply the devices.
    with context.rng_scope(key), jax.sharding.use_abstract_mesh(mesh.abstract_mesh), \
            nnx.logical_axis_rules(ACTIVATION_RULES):
        logits = model(micro["tokens"], positions=micro["positions"],
                       segment_ids=micro["segment_ids"])
    return token_nll(logits, micro["targets"], micro["loss_mask"])


def _shardings_key(spec: StepSpec, state: dict):
    leaves, treedef = jax.tree.flatten(state)
    return spec, treedef, tuple(tuple(x.shape) for x in leaves)


def _shardings(spec: StepSpec, treedef, shapes):
    abstract = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes])
    return state_shardings(abstract, spec.mesh), batch_sharding(spec.mesh), NamedSharding(spec.mesh, P())


@functools.lru_cache(maxsize=64)
def _jitted_train_step(spec: StepSpec, treedef, shapes):
    state_sh, batch_sh, replicated = _shardings(spec, treedef, shapes)
    return jax.jit(_train_step, static_argnums=(0, 1), donate_argnums=(2,),
                   in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, replicated))


@functools.lru_cache(maxsize=64)
def _jitted_eval_step(spec: StepSpec, treedef, shapes):
    state_sh, batch_sh, replicated = _shardings(spec, treedef, shapes)
    return jax.jit(_eval_step, static_argnums=(0, 1), in_shardings=(state_sh, batch_sh),
                   out_shardings=replicated)


def jitted_train_step(spec: StepSpec, state):
    """The jax.jit of the train step for this spec and state structure (state may be
    ShapeDtypeStructs: ``.lower(graphdef, spec, state, batch)`` compiles it abstractly,
    as bench/bench_sharding.py does). The loop builds it once per run and calls it as
    ``step(graphdef, spec, state, batch)``."""
    return _jitted_train_step(*_shardings_key(spec, state))


def train_step(graphdef, spec: StepSpec, state: dict, batch: dict):
    """One optimizer step (see _train_step); the state is donated."""
    return jitted_train_step(spec, state)(graphdef, spec, state, batch)


def eval_step(graphdef, spec: StepSpec, state: dict, batch: dict):
    """(summed NLL, token count) of a global batch (see _eval_step)."""
    return _jitted_eval_step(*_shardings_key(spec, state))(graphdef, spec, state, batch)


def _train_step(graphdef, spec: StepSpec, state: dict, batch: dict):
    """One optimizer step over a global batch of [accum, micro, L] arrays.

    A step whose loss or gradient norm is not finite leaves params and optimizer state
    unchanged (skipped, counted); the caller decides whether to go on.
    """
    tx = make_optimizer(spec.optimizer)
    params, rest = state["params"], state["rest"]
    step = state["step"] + 1
    step_key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), step)
    grad_fn = jax.value_and_grad(
        lambda p, micro, key: _forward_nll(graphdef, p, rest, micro, key, spec.mesh), has_aux=True)
    # Gradients sharded like the parameters: each micro-batch's are reduce-scattered.
    grad_shardings = state_shardings(params, spec.mesh)

    def accumulate(carry, xs):
        micro, index = xs
        (nll, count), grads = grad_fn(params, micro, jax.random.fold_in(step_key, index))
        grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
        grad_sum, nll_sum, count_sum = carry
        return (jax.tree.map(jnp.add, grad_sum, grads), nll_sum + nll, count_sum + count), None

    zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params), grad_shardings)
    init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
    (grad_sum, nll_sum, count), _ = jax.lax.scan(
        accumulate, init, (batch, jnp.arange(spec.accum_steps)))
    # Token mean over the whole global batch, however it was split into micro-batches.
    count = jnp.maximum(count, 1.0)
    loss = nll_sum / count
    grads = jax.tree.map(lambda g: g / count, grad_sum)
    grad_norm = global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    updates, new_opt_state = tx.update(grads, state["opt_state"], params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    new_state = {
        "params": keep(new_params, params),
        "rest": rest,
        "opt_state": keep(new_opt_state, state["opt_state"]),
        "step": step,
        "opt_steps": state["opt_steps"] + finite.astype(jnp.int32),
        "nonfinite_steps": state["nonfinite_steps"] + (~finite).astype(jnp.int32),
        "rng": state["rng"],
    }
    lr = learning_rate_schedule(spec.optimizer)(state["opt_steps"])
    metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "finite": finite,
               "tokens": count}
    return new_state, metrics


def _eval_step(graphdef, spec: StepSpec, state: dict, batch: dict):
    """(summed NLL, token count) of a global batch, with the training forward (same
    recipe); stochastic rounding, if any, draws from a fixed key so that validation
    losses of different steps are comparable."""
    key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), -1 & 0x7FFFFFFF)

    def body(carry, xs):
        micro, index = xs
        nll, count = _forward_nll(graphdef, state["params"], state["rest"], micro,
                                  jax.random.fold_in(key, index), spec.mesh)
        return (carry[0] + nll, carry[1] + count), None

    init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
    (nll, count), _ = jax.lax.scan(body, init, (batch, jnp.arange(spec.accum_steps)))
    return nll, count
