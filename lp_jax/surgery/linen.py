"""apply_recipe_linen: the recipe on the GEMMs of a Flax Linen model whose modules the user
did not construct (Hugging Face's Flax Llama and GPT-2, say).

The module returned is the model's own class, subclassed: the same fields, the same
parameter tree, so a checkpoint of one loads into the other. Its ``init``/``init_with_output``
and ``apply`` run the model under ``flax.linen.intercept_methods``: each module's method
call is a frame of ``lp_jax.surgery.interception``, and the ``jax.lax.dot_general`` /
``jnp.einsum`` calls a selected module makes on its own parameter run lp_jax's GEMM
(``nn.Dense``, ``nn.DenseGeneral`` and ``nn.Einsum`` reach JAX that way too, and get
``KeepKernelDtype`` as their ``promote_dtype`` so the FP32 kernel reaches the GEMM and its
weight gradient stays FP32, as for NNX).

Which GEMMs there are is only known by running the model, so each new call signature is
first traced abstractly (``jax.eval_shape``, no FLOPs) to list them; then the same rules,
layer container, layer policy and refusals as ``apply_recipe`` (``selection.select``)
decide the plan, a ValueError raised before anything runs. ``linen_report(module)`` gives
the ``SwapReport`` of the latest plan.
"""
from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Mapping

import flax.linen as nn
import jax
import numpy as np

from lp_jax.gemm.dot_general import KeepKernelDtype, LowPrecisionDotGeneral
from lp_jax.recipes import BF16, Recipe, get_recipe
from lp_jax.surgery.gemm_call import einsum_problem, run_with
from lp_jax.surgery.interception import Frame, frame
from lp_jax.surgery.report import SwapReport, record_backends
from lp_jax.surgery.selection import patterns, select

_FLAX_KINDS = ((nn.DenseGeneral, "nn.DenseGeneral"), (nn.Dense, "nn.Dense"), (nn.Einsum, "nn.Einsum"))
_local = threading.local()


@dataclasses.dataclass(frozen=True)
class LinenSettings:
    recipe: Recipe
    include: tuple = ()
    exclude: tuple = ()
    layers: str | None = None
    num_layers: int | None = None
    fp32_weight_gradients: bool = True


@dataclasses.dataclass
class SeenGemm:
    """A GEMM the abstract trace found: the module's class, how it computes (``kind``), why
    lp_jax cannot run it (None: it can), and whether it is Flax's own layer on Flax's GEMM."""

    class_name: str
    kind: str
    problem: str | None
    flax_default: bool


def _path(module: nn.Module) -> str:
    # A module applied on its own inside another's call (a tied head: ``lm_head.apply(...)``)
    # is the root of its own scope: its name stands for its path.
    return "/".join(module.path) or (module.name or "")


def _kind(module) -> str | None:
    return next((name for cls, name in _FLAX_KINDS if isinstance(module, cls)), None)


def _own_param_shapes(module) -> list:
    params = module.variables.get("params", {}) if module.scope is not None else {}
    return [np.shape(nn.meta.unbox(v)) for v in params.values() if not isinstance(v, Mapping)]


def _flax_problem(module, kind: str | None) -> str | None:
    if kind in ("nn.Dense", "nn.DenseGeneral"):
        if module.dot_general is not None or module.dot_general_cls is not None:
            return f"{kind} with its own dot_general (left as it is)"
        if kind == "nn.DenseGeneral" and module.batch_dims:
            return f"nn.DenseGeneral with batch_dims {module.batch_dims} (lp_jax.dot_general has no batch dimensions)"
    return None


def _discovery(seen: dict, modules: list):
    def intercept(next_fun, args, kwargs, context):
        module = context.module
        path, kind = _path(module), _kind(module)
        modules.append((path, type(module).__name__))
        if isinstance(module, nn.Embed) and context.method_name == "attend":
            seen.setdefault(path, SeenGemm(type(module).__name__, "nn.Embed.attend",
                                           "a tied embedding used as a head", False))
            with frame(None):
                return next_fun(*args, **kwargs)
        flax_problem = _flax_problem(module, kind)
        if flax_problem and "own dot_general" in flax_problem:
            seen.setdefault(path, SeenGemm(type(module).__name__, kind, flax_problem, False))
            with frame(None):
                return next_fun(*args, **kwargs)

        def handler(op, gemm_args, gemm_kwargs):
            problem = flax_problem
            if problem is None and op == "einsum":
                bad = einsum_problem(gemm_args[0], gemm_args[1].shape, gemm_args[2].shape)
                problem = f"einsum {gemm_args[0]!r}: {bad}" if bad else None
            seen.setdefault(path, SeenGemm(type(module).__name__, kind or f"calls {op}", problem,
                                           kind is not None))
            return NotImplemented  # runs JAX's own: the trace only looks

        with frame(Frame(handler, lambda: _own_param_shapes(module))):
            return next_fun(*args, **kwargs)
    return intercept


def _applying(plan: dict):
    def intercept(next_fun, args, kwargs, context):
        module = context.module
        path = _path(module)
        dg = plan.get(path)
        if dg is None or context.method_name == "attend":
            with frame(None):
                return next_fun(*args, **kwargs)
        gemm_frame = Frame(lambda op, a, k: run_with(dg, op, a, k, f"apply_recipe_linen: {path}"),
                           lambda: _own_param_shapes(module))
        promote = _kind(module) is not None
        if promote:
            kept = module.promote_dtype
            object.__setattr__(module, "promote_dtype", KeepKernelDtype())
        try:
            with frame(gemm_frame):
                return next_fun(*args, **kwargs)
        finally:
            if promote:
                object.__setattr__(module, "promote_dtype", kept)
    return intercept


def _plan(settings: LinenSettings, seen: dict, modules: list) -> tuple[dict, SwapReport]:
    recipe = settings.recipe
    gemms = [(tuple(path.split("/")) if path else (), path, rec, rec.kind) for path, rec in seen.items()]

    def seen_elsewhere(rule):
        return sorted({f"{p} ({c})" for p, c in modules if p and re.search(rule, p)})

    sel = select(gemms, recipe, settings.include or None, settings.exclude or None, settings.layers,
                 settings.num_layers, lambda rec, kind: rec.problem, seen_elsewhere, "apply_recipe_linen")
    bf16 = BF16(backend=recipe.backend)
    container = sel.container
    report = SwapReport(type(recipe).__name__, recipe.policy, sel.num_layers,
                        layer_container=container.path if container is not None else None)
    plan = {}
    for path, rec, _ in sel.left:
        report.not_selected.append(path)
        if settings.fp32_weight_gradients and rec.flax_default and rec.problem is None:
            plan[path] = LowPrecisionDotGeneral(bf16)
            report.fp32_weight_gradients.append(path)
    for path, _, _, layer, _ in sel.chosen:
        if sel.is_bf16_by_policy(recipe, layer):
            plan[path] = LowPrecisionDotGeneral(bf16)
            report.bf16_by_policy.append(path)
        else:
            plan[path] = LowPrecisionDotGeneral(recipe)
            report.quantized[path] = type(recipe).__name__
    record_backends(report, recipe, bf16)
    return plan, report


def _is_array(leaf) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


class _Active:
    """Marks the quantized module's own entry points as running (its __call__ checks)."""

    def __enter__(self):
        _local.depth = getattr(_local, "depth", 0) + 1

    def __exit__(self, *exc):
        _local.depth -= 1


def _run(module, base_entry, args, kwargs):
    cls = type(module)
    leaves, treedef = jax.tree.flatten((args, kwargs))
    where = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
    key = (base_entry.__name__, treedef, tuple((i, np.shape(leaves[i]), str(leaves[i].dtype)) for i in where),
           tuple(repr(leaf) for i, leaf in enumerate(leaves) if i not in set(where)))
    plan = cls._lp_plans.get(key)
    if plan is None:
        seen, modules = {}, []

        def trace(arrays):
            full = list(leaves)
            for i, a in zip(where, arrays):
                full[i] = a
            a, k = jax.tree.unflatten(treedef, full)
            with _Active(), nn.intercept_methods(_discovery(seen, modules)):
                base_entry(module, *a, **k)

        jax.eval_shape(trace, [leaves[i] for i in where])
        plan, cls._lp_report = _plan(cls._lp_settings, seen, modules)
        cls._lp_plans[key] = plan
    with _Active(), nn.intercept_methods(_applying(plan)):
        return base_entry(module, *args, **kwargs)


_CLASSES: dict = {}


def _quantized_class(base: type, settings: LinenSettings) -> type:
    key = (base, settings)
    if key in _CLASSES:
        return _CLASSES[key]

    @nn.nowrap
    def apply(self, variables, *args, **kwargs):
        return _run(self, base.apply, (variables, *args), kwargs)

    @nn.nowrap
    def init_with_output(self, rngs, *args, **kwargs):
        return _run(self, base.init_with_output, (rngs, *args), kwargs)

    def __call__(self, *args, **kwargs):
        if getattr(_local, "depth", 0) == 0:
            raise ValueError(f"{type(self).__name__} (from apply_recipe_linen) runs its recipe through its own "
                             "init/apply only, and was called inside another module: apply_recipe_linen the "
                             "outermost module instead")
        return base.__call__(self, *args, **kwargs)

    namespace = {"apply": apply, "init_with_output": init_with_output, "__call__": __call__,
                 "_lp_settings": settings, "_lp_plans": {}, "_lp_report": None, "_lp_base": base,
                 "__module__": base.__module__}
    cls = type(f"LowPrecision{base.__name__}", (base,), namespace)
    _CLASSES[key] = cls
    return cls


def apply_recipe_linen(module: nn.Module, recipe: Recipe | str, include=None, exclude=None,
                       layers: str | None = None, num_layers: int | None = None,
                       fp32_weight_gradients: bool = True) -> nn.Module:
    """``module`` (an unbound ``flax.linen.Module``) as a module of the same parameter tree
    whose ``init`` and ``apply`` run ``recipe`` (a Recipe or a name) on the selected GEMMs,
    by the rules of ``apply_recipe``: every GEMM in the layer container (``h/3/...``,
    ``layers_3/...``, ``Block_3/...``) or, without one, in the model; ``include``/``exclude``
    regexes on '/'-joined module paths; never the embedding or the LM head; the unselected
    Flax layers on lp_jax's BF16 GEMM (FP32 weight gradients) unless
    ``fp32_weight_gradients=False``. GEMMs reached: ``nn.Dense``, ``nn.DenseGeneral``,
    ``nn.Einsum`` and any module calling ``jax.lax.dot_general`` / ``jnp.einsum`` on its own
    parameter (or its transpose). The plan is made at the first ``init``/``apply`` of each
    call signature, where bad rules raise a one-line ValueError; ``linen_report(module)``
    returns it. Call the returned module's ``init``/``apply`` (it must be the outermost)."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"apply_recipe_linen takes a flax.linen.Module, not {type(module).__name__} "
                         "(an nnx.Module goes to lp_jax.apply_recipe)")
    if module.scope is not None:
        raise ValueError("apply_recipe_linen takes an unbound module (the model, not one bound inside apply)")
    if isinstance(recipe, str):
        recipe = get_recipe(recipe)
    for rule in patterns(include) + patterns(exclude):
        re.compile(rule)
    base = getattr(type(module), "_lp_base", type(module))
    settings = LinenSettings(recipe, tuple(patterns(include)), tuple(patterns(exclude)), layers, num_layers,
                             fp32_weight_gradients)
    cls = _quantized_class(base, settings)
    fields = {f.name: getattr(module, f.name) for f in dataclasses.fields(module)
              if f.init and f.name not in ("parent",)}
    return cls(**fields)


def linen_report(module: nn.Module) -> SwapReport:
    """The SwapReport of the latest plan of a module from ``apply_recipe_linen``; ValueError
    before its first init/apply (the plan is made there)."""
    report = getattr(type(module), "_lp_report", None)
    if not hasattr(type(module), "_lp_settings"):
        raise ValueError(f"{type(module).__name__} does not come from apply_recipe_linen")
    if report is None:
        raise ValueError("linen_report: the plan is made at the module's first init or apply; call one first")
    return report
