"""AdamW on FP32 master weights, the learning-rate schedule, and the hyperparameters the
jitted step needs, as one hashable value.

The transformation is ``clip_by_global_norm -> adamw`` (optax), in Megatron's order, with
decoupled weight decay on parameters of two or more dimensions only and moments in the
parameters' dtype, FP32. Gradient accumulation is the step's own, not ``optax.MultiSteps``
(docs/training.md, "Optimization").
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """Everything the optimizer and schedule depend on; hashable, so it can be a static
    argument of the jitted step (the same spec in two runs reuses one compilation)."""

    peak_lr: float
    min_lr: float
    init_lr: float
    warmup_steps: int
    decay_steps: int
    decay: str  # cosine | linear | constant
    b1: float
    b2: float
    eps: float
    weight_decay: float
    clip_grad_norm: float

    @classmethod
    def from_config(cls, config) -> "OptimizerSpec":
        s, o = config.schedule, config.optimizer
        return cls(peak_lr=s.peak_lr, min_lr=s.min_lr, init_lr=s.init_lr,
                   warmup_steps=s.warmup_steps,
                   decay_steps=s.decay_steps if s.decay_steps is not None else config.steps,
                   decay=s.decay, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                   clip_grad_norm=o.clip_grad_norm)


def learning_rate_schedule(spec: OptimizerSpec) -> optax.Schedule:
    """Linear warmup from init_lr to peak_lr over warmup_steps, then decay to min_lr at
    decay_steps (counted from 0, warmup included, like Megatron's lr_decay_iters), then
    min_lr. The argument is the number of updates applied before this one: the first step
    runs at init_lr (0 in the Llama 3 recipe), as in Megatron."""
    warmup = max(spec.warmup_steps, 0)
    decay_len = max(spec.decay_steps - warmup, 1)

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        warm = spec.init_lr + (spec.peak_lr - spec.init_lr) * count / max(warmup, 1)
        progress = jnp.clip((count - warmup) / decay_len, 0.0, 1.0)
        if spec.decay == "cosine":
            decayed = spec.min_lr + (spec.peak_lr - spec.min_lr) * 0.5 * (1 + jnp.cos(jnp.pi * progress))
        elif spec.decay == "linear":
            decayed = spec.peak_lr + (spec.min_lr - spec.peak_lr) * progress
        elif spec.decay == "constant":
            decayed = jnp.full_like(progress, spec.peak_lr)
        else:
            raise ValueError(f"schedule.decay {spec.decay!r} is not one of cosine, linear, constant")
        return jnp.where(count < warmup, warm, decayed)

    return schedule


def decay_mask(params):
    """True for parameters that get weight decay: matrices, not the 1-D norm scales and
    biases. With scanned layers a norm scale is stacked to [layers, dim], so the rule
    also looks at the parameter's name (Flax names them 'scale' and 'bias')."""
    def is_matrix(path, x):
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        return x.ndim >= 2 and not (names and names[-1] in ("scale", "bias"))

    return jax.tree_util.tree_map_with_path(is_matrix, params)


def make_optimizer(spec: OptimizerSpec) -> optax.GradientTransformation:
    adamw = optax.adamw(learning_rate_schedule(spec), b1=spec.b1, b2=spec.b2, eps=spec.eps,
                        weight_decay=spec.weight_decay, mask=decay_mask)
    if spec.clip_grad_norm > 0:
        return optax.chain(optax.clip_by_global_norm(spec.clip_grad_norm), adamw)
    return adamw
