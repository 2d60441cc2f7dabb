"""The jitted train and eval steps.

Both take the model's graphdef and a hashable StepSpec (which holds the mesh) as static
arguments and the state as a pytree; each is a ``jax.jit`` with explicit in/out shardings
from ``partitioning``, cached per (spec, state structure), so a recipe switch (a new
graphdef) compiles a new step. With ``mesh.data > 1`` the micro-batch loop runs in a
``shard_map`` manual over ``data`` and the gradient is reduced over ``data`` once per step;
ZeRO-1 gathers the weights once per step (docs/scaling.md, "Communication at scale").
Micro-batch ``m`` of step ``s`` draws its stochastic-rounding bits inside
``lp_jax.context.rng_scope(fold_in(fold_in(key(seed), s), m))``, so a resumed run redraws them.
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
from lp_jax.numerics.manual_axes import manual_axes
from lp_jax.parallel.partitioning import (
    activation_rules,
    batch_sharding,
    data_shard_map_axes,
    path_string,
    spec_without,
    state_shardings,
)
from lp_jax.training import weight_cache, zero1_gather
from lp_jax.training.layer_stacks import LayerStacks
from lp_jax.training.optimizer import OptimizerSpec, learning_rate_schedule, make_optimizer
from lp_jax.training.token_loss import token_nll
from lp_jax.training.zero1_gather import Zero1Gather


@dataclasses.dataclass(frozen=True)
class StepSpec:
    optimizer: OptimizerSpec
    accum_steps: int
    mesh: Mesh
    # ZeRO-1: FP32 masters and Adam moments also split over the data axis (mesh.shard_optimizer).
    shard_optimizer: bool = False
    # The dtype ZeRO-1 gathers matrices (rank >= 2) in: the model's compute dtype, exact
    # for the Llama, which reads a matrix only through its cast to that dtype (the
    # Linears' GEMM, the embedding lookup). None: FP32 masters. Kernels whose recipe has
    # param_gather are gathered as FP8/FP4 bytes or in FP32 (``zero1_gather``).
    gather_dtype: str | None = None
    # The scanned layers' weight copies (casts, FP8/FP4 bytes) made once per step before the
    # micro-batch loop instead of in every micro-batch (``lp_jax.training.weight_cache``;
    # the same bits).
    cache_weights: bool = True

    @classmethod
    def from_plan(cls, plan, mesh: Mesh) -> "StepSpec":
        """The spec of a validated run (lp_jax.training.validate.ValidatedRun) on ``mesh``."""
        cfg = plan.config
        return cls(OptimizerSpec.from_config(cfg), plan.accum_steps, mesh,
                   shard_optimizer=cfg.mesh.shard_optimizer,
                   gather_dtype=jnp.dtype(plan.model_config.dtype).name,
                   cache_weights=cfg.precision.cache_weights)

    @property
    def data_ranks(self) -> int:
        return self.mesh.shape["data"]

    def state_shardings(self, tree):
        """The NamedShardings of a train state (or params) under this spec."""
        return state_shardings(tree, self.mesh, self.shard_optimizer)


def global_norm(tree) -> jax.Array:
    """sqrt of the sum of squares of all leaves (what clip_by_global_norm compares)."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def forward_nll(graphdef, params, rest, micro, key, mesh, manual=(), layer_stacks=None):
    """(summed token NLL, token count) of one micro-batch: the loss the quant-stats probe,
    lp_jax.inspect, the study's memory probe, evaluation and bench read.
    ``layer_stacks``: the scanned runs' stacked parameters (``lp_jax.training.layer_stacks``)."""
    nll, count, _ = _forward(graphdef, params, rest, micro, key, mesh, manual, layer_stacks)
    return nll, count


def forward_objective(graphdef, params, rest, micro, key, mesh, manual=(), layer_stacks=None):
    """(what the step differentiates, (summed NLL, token count, model metrics)) of one
    micro-batch. A model that returns ``(logits, extras)`` (models.moe) adds
    ``extras["aux_loss"]`` per token: the objective is the summed NLL plus aux_loss times
    the micro-batch's token count, so that divided by the step's tokens it is the mean NLL
    plus the token-weighted mean aux loss. Its other extras are scalar metrics, named by
    the model's ``extra_metrics``."""
    nll, count, extras = _forward(graphdef, params, rest, micro, key, mesh, manual, layer_stacks)
    extras = dict(extras or {})
    aux = extras.pop("aux_loss", None)
    objective = nll if aux is None else nll + aux.astype(jnp.float32) * count
    return objective, (nll, count, {k: jnp.asarray(v, jnp.float32) for k, v in extras.items()})


def _forward(graphdef, params, rest, micro, key, mesh, manual, layer_stacks):
    model = nnx.merge(graphdef, params, rest)
    # The abstract mesh makes the model's logical constraints (models.sharding) concrete;
    # jit's in/out shardings supply the devices. Inside the data shard_map the context
    # already holds the mesh with ``data`` manual, and the rules leave that axis out.
    abstract = jax.sharding.get_abstract_mesh() if manual else mesh.abstract_mesh
    stacks = {} if layer_stacks is None else {"layer_stacks": layer_stacks}
    with context.rng_scope(key), jax.sharding.use_abstract_mesh(abstract), \
            nnx.logical_axis_rules(activation_rules(manual)):
        # No segment_ids (data.reset_attention_mask=false): plain causal attention per row.
        out = model(micro["tokens"], positions=micro["positions"],
                    segment_ids=micro.get("segment_ids"), **stacks)
    logits, extras = out if isinstance(out, tuple) else (out, None)
    return (*token_nll(logits, micro["targets"], micro["loss_mask"]), extras)


def _shardings_key(spec: StepSpec, state: dict):
    leaves, treedef = jax.tree.flatten(state)
    return spec, treedef, tuple((tuple(x.shape), jnp.dtype(x.dtype).name) for x in leaves)


def _shardings(spec: StepSpec, treedef, shapes):
    abstract = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(s, d) for s, d in shapes])
    return spec.state_shardings(abstract), batch_sharding(spec.mesh), NamedSharding(spec.mesh, P())


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
    as ``bench.bench_sharding`` does). The loop builds it once per run and calls it as
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

    A step whose loss or gradient norm is not finite, or whose gradient norm is 0, leaves
    params and optimizer state unchanged (skipped, counted); the caller decides whether to
    go on.
    """
    tx = make_optimizer(spec.optimizer)
    params, rest = state["params"], state["rest"]
    step = state["step"] + 1
    if spec.data_ranks > 1:
        grads, nll_sum, count, extras = _data_parallel_sums(graphdef, spec, params, rest, batch,
                                                    state["rng"], step)
    else:
        grads, nll_sum, count, extras = _accumulate(graphdef, spec, params, rest, batch, state["rng"], step)
    # Token mean over the whole global batch, however it was split into micro-batches.
    count = jnp.maximum(count, 1.0)
    loss = nll_sum / count
    grads = jax.tree.map(lambda g: g / count, grads)
    grad_norm = global_norm(grads)
    # A gradient norm of exactly 0 is no learning step either: activations past FP32's range
    # (~1.8e19) make RMSNorm's mean square inf and its output 0, so every token gets the same
    # probability (loss ln(vocab)) and no gradient flows; counted and skipped as a NaN is.
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & (grad_norm > 0)

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
        "nonfinite_in_a_row": jnp.where(finite, 0, state["nonfinite_in_a_row"] + 1),
        "rng": state["rng"],
    }
    lr = learning_rate_schedule(spec.optimizer)(state["opt_steps"])
    metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "finite": finite,
               "tokens": count, "extras": extras}
    return new_state, metrics


def _accumulate(graphdef, spec: StepSpec, params, rest, batch, rng, step, manual=(), slices=None):
    """(summed FP32 gradients, summed NLL, token count) over the micro-batches, summed on
    this device: inside the data shard_map (``manual=("data",)``) over this data rank's
    rows only. Gradients are constrained to the parameters' shardings on the other axes
    (FSDP reduce-scatters each micro-batch's, ZeRO-3). A model's scanned layers are stacked
    once, before the loop, and differentiated as stacks (``lp_jax.training.layer_stacks``).
    ``slices``: ZeRO-1's FP32 slices of param_gather kernels (``zero1_gather``), for the
    weight cache to quantize and gather."""
    step_key = jax.random.fold_in(jax.random.wrap_key_data(rng), step)
    specs = jax.tree.map(lambda s: spec_without(s.spec, manual), state_shardings(params, spec.mesh))
    stacks = LayerStacks(graphdef, params, rest)
    if stacks:
        diff = stacks.split()
        diff_specs = stacks.split_specs(specs, diff[1])
        copies = weight_cache.make(stacks, diff[1], slices) if spec.cache_weights else {}

        def loss(diff, micro, key):
            outer, layer_stacks = diff
            layer_stacks = weight_cache.attach(layer_stacks, copies)
            return forward_objective(graphdef, stacks.params(outer), rest, micro, key,
                                     spec.mesh, manual, layer_stacks)
    else:
        diff, diff_specs = params, specs
        loss = lambda p, micro, key: forward_objective(graphdef, p, rest, micro, key, spec.mesh, manual)  # noqa: E731
    if not manual:  # outside a shard_map a constraint names its mesh
        diff_specs = jax.tree.map(lambda s: NamedSharding(spec.mesh, s), diff_specs,
                                  is_leaf=lambda s: isinstance(s, P))
    grad_fn = jax.value_and_grad(loss, has_aux=True)

    def accumulate(carry, xs):
        micro, index = xs
        (_, (nll, count, extras)), grads = grad_fn(diff, micro, jax.random.fold_in(step_key, index))
        grads = jax.lax.with_sharding_constraint(grads, diff_specs)
        grad_sum, nll_sum, count_sum, extras_sum = carry
        return (jax.tree.map(jnp.add, grad_sum, grads), nll_sum + nll, count_sum + count,
                jax.tree.map(jnp.add, extras_sum, extras)), None

    zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, diff), diff_specs)
    names = getattr(nnx.merge(graphdef, params, rest), "extra_metrics", ())
    init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32),
            {name: jnp.zeros((), jnp.float32) for name in names})
    (grad_sum, nll_sum, count, extras_sum), _ = jax.lax.scan(
        accumulate, init, (batch, jnp.arange(spec.accum_steps)))
    if stacks:
        grad_sum = stacks.unsplit(*grad_sum)
    # The model's metrics: the mean over this device's micro-batches.
    return grad_sum, nll_sum, count, jax.tree.map(lambda v: v / spec.accum_steps, extras_sum)


def gathered_weights(spec: StepSpec, params, zero1: Zero1Gather = Zero1Gather()):
    """The weights the forward reads, replicated over ``data``: ZeRO-1's masters gathered
    once per step (matrices in ``spec.gather_dtype``, but the param_gather kernels of
    ``zero1``: in FP32 (``full``) or left as each data rank's FP32 slice (``sliced``), whose
    quantized bytes the weight cache gathers); otherwise the masters themselves."""
    if not spec.shard_optimizer or spec.data_ranks == 1:
        return params

    def one(key_path, p, sharded, whole):
        path = path_string(key_path)
        if path in zero1.sliced:
            return p
        if spec.gather_dtype is not None and p.ndim >= 2 and path not in zero1.full:
            # The cast pinned to the ZeRO-1 layout: otherwise the partitioner may gather
            # the FP32 master and cast after (twice the bytes).
            p = jax.lax.with_sharding_constraint(p.astype(spec.gather_dtype), sharded)
        return jax.lax.with_sharding_constraint(p, whole)

    return jax.tree_util.tree_map_with_path(one, params, spec.state_shardings(params),
                                            state_shardings(params, spec.mesh))


def _data_parallel_sums(graphdef, spec: StepSpec, params, rest, batch, rng, step):
    """_accumulate's sums over the whole batch with one data-axis reduction (docs/scaling.md,
    "Communication at scale"): gradients come back reduced and sharded like the masters."""
    zero1 = zero1_gather.plan(spec, graphdef, params, rest)
    weights = gathered_weights(spec, params, zero1)
    masters_like = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
    manual = data_shard_map_axes(spec.mesh)
    # Every weight whole on each data rank, but the sliced kernels: their ZeRO-1 slices
    # (all of whose mesh axes are manual here).
    weight_specs = jax.tree_util.tree_map_with_path(
        lambda key_path, s: s.spec if path_string(key_path) in zero1.sliced else P(),
        spec.state_shardings(params))

    def local(weights, rest, batch, rng, step):
        # Back to the masters' dtype (exact). The barrier keeps the gathered BF16 values
        # from being folded back into the FP32 masters they were cast from (XLA may drop
        # an f32 -> bf16 -> f32 round trip as excess precision, and gather FP32 instead).
        weights = jax.lax.optimization_barrier(weights)
        slices = {}

        def master(key_path, w, like):
            path = path_string(key_path)
            if path not in zero1.sliced:
                return w.astype(like.dtype)
            slices[path] = (w, zero1.sliced[path])
            # Differentiated for its gradient, never read: the GEMMs read the copies made
            # from the slice.
            return jnp.zeros(like.shape, like.dtype)

        masters = jax.tree_util.tree_map_with_path(master, weights, masters_like)
        with manual_axes(manual, rank_axes=("data",)):
            grads, nll, count, extras = _accumulate(graphdef, spec, masters, rest, batch, rng, step,
                                                    manual=manual, slices=slices)
        stacked = jax.tree.map(lambda g: g[None], grads)
        return (stacked, jax.lax.psum(nll, "data"), jax.lax.psum(count, "data"),
                jax.tree.map(lambda v: jax.lax.pmean(v, "data"), extras))

    # check_vma=False: the body is plain per-rank code. With JAX's replication checks on,
    # the gradient of a data-invariant weight would be psum'd inside the loop (the
    # transpose of its implicit broadcast), and the GEMM backends' platform_dependent
    # branches disagree on the varying-ness of their outputs.
    stacked, nll_sum, count, extras = jax.shard_map(
        local, mesh=spec.mesh, in_specs=(weight_specs, P(), P(None, "data"), P(), P()),
        out_specs=(P("data"), P(), P(), P()), axis_names=set(manual), check_vma=False)(
            weights, rest, batch, rng, step)
    # The step's one data-axis reduction per gradient, into the masters' sharding.
    return (jax.tree.map(lambda g, s: jax.lax.with_sharding_constraint(jnp.sum(g, axis=0), s),
                         stacked, spec.state_shardings(params)),
            nll_sum, count, extras)


def _eval_step(graphdef, spec: StepSpec, state: dict, batch: dict):
    """(summed NLL, token count) of a global batch, with the training forward (same
    recipe); stochastic rounding, if any, draws from a fixed key so that validation
    losses of different steps are comparable."""
    key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), -1 & 0x7FFFFFFF)

    def body(carry, xs):
        micro, index = xs
        nll, count = forward_nll(graphdef, state["params"], state["rest"], micro,
                                  jax.random.fold_in(key, index), spec.mesh)
        return (carry[0] + nll, carry[1] + count), None

    init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
    (nll, count), _ = jax.lax.scan(body, init, (batch, jnp.arange(spec.accum_steps)))
    return nll, count
