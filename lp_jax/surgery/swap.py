"""apply_recipe: set the dot_general of the selected GEMM modules of any NNX model, in place.

GEMM modules: ``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Einsum`` and modules with a
``dot_general`` or ``einsum_op`` attribute (``lp_jax.surgery.gemm_modules``). Selection: by
default every GEMM inside the model's layer container (found from its structure,
``lp_jax.surgery.layer_container``: ``layers/3/attn/q_proj``, ``h/3/mlp/fc``), or every GEMM
where the model has none; never the embedding or the LM head, whatever the rules say;
``include`` and ``exclude`` are regular expressions (or lists of them) searched in the
'/'-joined path. Layers the recipe keeps in BF16 (FiLj, ``bf16_layers``) and, unless
``fp32_weight_gradients=False``, the unselected Flax GEMMs get lp_jax's BF16 GEMM, whose
weight gradient is FP32 (docs/numerics.md); a user's own dot_general is left alone. Stacked
layers get the policy per slice (``LayerPolicyDotGeneral``). Only static attributes change
(``dot_general``, ``einsum_op``, ``promote_dtype``), so a checkpoint from one recipe loads
into a model swapped to another; calling apply_recipe again replaces what the previous call
set. Bad input (a rule matching no GEMM, nothing selected, a layer policy without layers, a
GEMM lp_jax cannot run) is a one-line ValueError raised before anything is changed.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Protocol

from flax import nnx

from lp_jax.gemm.dot_general import LowPrecisionDotGeneral
from lp_jax.recipes import BF16, Recipe, get_recipe
from lp_jax.surgery.gemm_modules import gemm_modules, is_default, problem, reset, set_gemm
from lp_jax.surgery.selection import NEVER, select  # noqa: F401 (NEVER: read by the telemetry)
from lp_jax.surgery.layer_policy import LayerPolicyDotGeneral
# IN_LAYERS, LAYER_INDEX (lp_jax's Llama's layer paths) are imported from here by the
# telemetry and the sensitivity study; SwapReport by lp_jax's public API.
from lp_jax.surgery.report import IN_LAYERS, LAYER_INDEX, SwapReport, record_backends  # noqa: F401

def _placed(dg: LowPrecisionDotGeneral, path: str, module, kind: str, layout: Layout | None,
            report: SwapReport) -> LowPrecisionDotGeneral:
    """``dg`` with the layout's weight gather and tensor reduction for this Linear (the
    trainer's layouts are for ``nnx.Linear`` kernels [in, out]; other kinds get none)."""
    if layout is None or kind != "Linear":
        return dg
    shape = module.kernel.shape
    gather, reduce = layout.gather(path, shape, dg.recipe), layout.tensor_reduce(path, shape)
    if gather is not None:
        report.gathered.append(path)
    if reduce is not None:
        report.tensor_reduced[path] = reduce
    return dataclasses.replace(dg, gather=gather, tensor_reduce=reduce, partly_manual=layout.partly_manual)


class Layout(Protocol):
    """How a Linear's GEMM meets the mesh (``lp_jax.parallel.linear_layout.LinearLayout``)."""

    def gather(self, path: str, kernel_shape, recipe: Recipe) -> tuple | None: ...

    def tensor_reduce(self, path: str, kernel_shape) -> str | None: ...

    @property
    def partly_manual(self) -> bool: ...

    @property
    def partitioned(self) -> bool: ...


def apply_recipe(model, recipe: Recipe | str, include=None, exclude=None,
                 num_layers: int | None = None, fp32_weight_gradients: bool = True,
                 layout: Layout | None = None, layers: str | None = None) -> SwapReport:
    """Swaps in ``recipe`` (a Recipe or a name) on the selected GEMMs of ``model`` (any
    ``nnx.Module``: its nnx.Linear, nnx.LinearGeneral, nnx.Einsum and modules with a
    ``dot_general`` or ``einsum_op``); the unselected Flax ones get lp_jax's BF16 GEMM (FP32
    weight gradients) unless ``fp32_weight_gradients=False``, which leaves them as they are.

    ``layers`` names the container of the repeated blocks ('/'-joined path, e.g. "h" or
    "transformer/blocks") where finding it from the structure is ambiguous or wrong.
    ``layout`` (the trainer's mesh) decides, in the same pass, which nnx.Linear GEMMs gather
    quantized weight bytes under FSDP and which reduce tensor-parallel sums in BF16; without
    one, none does. Every check runs before the model is changed: a ValueError leaves it as
    it was."""
    if isinstance(recipe, str):
        recipe = get_recipe(recipe)
    if layout is not None and layout.partitioned and recipe.quantize_impl == "auto":
        # The Pallas quantizers bring no partitioning rule (their amax is over what they are
        # given): where the GEMMs see arrays the partitioner splits, "auto" keeps XLA's.
        recipe = dataclasses.replace(recipe, quantize_impl="xla")
    bridges = [(path, node) for path, node in nnx.iter_graph(model) if isinstance(node, nnx.bridge.ToNNX)]
    if bridges:
        return _apply_to_bridged(model, bridges, recipe, include, exclude, layers, num_layers,
                                 fp32_weight_gradients)
    gemms = list(gemm_modules(model))

    def seen_elsewhere(rule):
        return [f"{'/'.join(map(str, path))} ({type(node).__name__})" for path, node in nnx.iter_graph(model)
                if isinstance(node, nnx.Module) and path and re.search(rule, "/".join(map(str, path)))]

    # Decide every GEMM's fate first: nothing changes unless all of it can be done.
    sel = select(gemms, recipe, include, exclude, layers, num_layers, problem, seen_elsewhere, "apply_recipe")
    container, num_layers = sel.container, sel.num_layers

    bf16 = BF16(backend=recipe.backend)
    report = SwapReport(type(recipe).__name__, recipe.policy, num_layers,
                        layer_container=container.path if container is not None else None,
                        stacked_container=container is not None and container.stacked)
    for path, module, kind in sel.left:
        reset(module, kind)
        report.not_selected.append(path)
        if fp32_weight_gradients and is_default(module, kind) and problem(module, kind) is None:
            set_gemm(module, kind, _placed(LowPrecisionDotGeneral(bf16), path, module, kind, layout, report))
            report.fp32_weight_gradients.append(path)
    partly_manual = layout is not None and layout.partly_manual
    for path, module, kind, layer, stacked in sel.chosen:
        if stacked:
            set_gemm(module, kind, LayerPolicyDotGeneral(recipe, num_layers, partly_manual=partly_manual))
            report.per_slice[path] = recipe.policy
        elif sel.is_bf16_by_policy(recipe, layer):
            set_gemm(module, kind, _placed(LowPrecisionDotGeneral(bf16), path, module, kind, layout, report))
            report.bf16_by_policy.append(path)
        else:
            set_gemm(module, kind, _placed(LowPrecisionDotGeneral(recipe), path, module, kind, layout, report))
            report.quantized[path] = type(recipe).__name__
    record_backends(report, recipe, bf16, partly_manual)
    return report


def _apply_to_bridged(model, bridges, recipe: Recipe, include, exclude, layers, num_layers,
                      fp32_weight_gradients) -> SwapReport:
    """A model holding Linen models through ``nnx.bridge.ToNNX``: each gets
    ``apply_recipe_linen`` with the rules (on the Linen model's own paths), its GEMMs planned
    at its first call; the NNX GEMMs beside them are not selected (BF16, FP32 weight
    gradients)."""
    from lp_jax.surgery.linen import apply_recipe_linen

    report = SwapReport(type(recipe).__name__, recipe.policy, num_layers or 0)
    # Every Linen model is swapped first, so a refusal leaves the NNX model as it was.
    swapped = [(path, node, apply_recipe_linen(node.to_nnx__module, recipe, include, exclude, layers,
                                               num_layers, fp32_weight_gradients)) for path, node in bridges]
    for path, node, linen in swapped:
        node.to_nnx__module = linen
        report.bridged["/".join(map(str, path))] = linen
    bf16 = BF16(backend=recipe.backend)
    for _, path, module, kind in gemm_modules(model):
        reset(module, kind)
        report.not_selected.append(path)
        if fp32_weight_gradients and is_default(module, kind) and problem(module, kind) is None:
            set_gemm(module, kind, LowPrecisionDotGeneral(bf16))
            report.fp32_weight_gradients.append(path)
    record_backends(report, recipe, bf16)
    return report
