"""Mesh checks that need the model and the recipes, run by validate.resolve before compiling:
whole attention heads per tensor rank, and no quantization block split across devices
(lp_jax.parallel.shard_checks, with the splits that partitioning's rules give each Linear)."""
from __future__ import annotations

import math

from flax import nnx

import lp_jax
from lp_jax.errors import UserError
from lp_jax.gemm.dot_general import LowPrecisionDotGeneral
from lp_jax.model_registry import build_model
from lp_jax.parallel.mesh import BATCH_AXES
from lp_jax.parallel.partitioning import ACTIVATION_RULES, logical_axes, param_spec
from lp_jax.parallel.shard_checks import BlockStraddleError, LinearSplits, Split, check_linear


def _split(size: int, entry, mesh_shape: dict[str, int]):
    names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
    shards = math.prod(mesh_shape.get(n, 1) for n in names)
    return Split(size, shards, " x ".join(names))


def _activation_entry(logical: str | None, size: int, mesh_shape: dict[str, int]):
    """The mesh axes an activation dimension is constrained to (models.sharding.constrain
    leaves a dimension whole when its axes do not divide it)."""
    entry = dict(ACTIVATION_RULES).get(logical) if logical else None
    if entry is None:
        return None
    names = entry if isinstance(entry, tuple) else (entry,)
    return entry if size % math.prod(mesh_shape.get(n, 1) for n in names) == 0 else None


def linear_splits(path: str, kernel_shape: tuple[int, int], mesh_shape: dict[str, int],
                  tokens_per_pass: int):
    """LinearSplits of the Linear at ``path`` under the partitioning rules. tokens_per_pass:
    M of one forward pass over the whole mesh (micro-batch x data x fsdp x expert x seq_len)."""
    k, n = kernel_shape
    kernel = f"{path}/kernel"
    spec = tuple(param_spec(kernel, kernel_shape, mesh_shape)) + (None, None)
    names = logical_axes(kernel, 2) or (None, None)
    m = _split(tokens_per_pass, tuple(a for a in BATCH_AXES if a in mesh_shape), mesh_shape)
    return LinearSplits(
        x_m=m, x_k=_split(k, _activation_entry(names[0], k, mesh_shape), mesh_shape),
        w_k=_split(k, spec[0], mesh_shape), w_n=_split(n, spec[1], mesh_shape),
        dy_m=m, dy_n=_split(n, _activation_entry(names[1], n, mesh_shape), mesh_shape))


def check_heads(model_config, tensor: int) -> None:
    for key in ("num_heads", "num_kv_heads"):
        heads = getattr(model_config, key)
        if heads % tensor:
            raise UserError(f"mesh.tensor={tensor} does not divide model.{key}={heads}: each "
                            "tensor-parallel rank must hold whole attention heads")


def check_experts(model_config, expert: int, model_type: str) -> None:
    """Whole experts per expert-parallel rank, and experts to split at all."""
    if expert == 1:
        return
    experts = getattr(model_config, "num_experts", 0)
    if experts < 2:
        raise UserError(f"mesh.expert={expert} splits a mixture of experts, but model.type={model_type} "
                        "has no experts; use mesh.expert=1 (or model.type=moe)")
    if experts % expert:
        raise UserError(f"mesh.expert={expert} does not divide model.num_experts={experts}: each "
                        "expert-parallel rank must hold whole experts")


def check_dispatch(ep_dispatch_dtype: str, expert: int) -> None:
    """An FP8 dispatch needs a dispatch: expert-parallel ranks to send rows to."""
    if ep_dispatch_dtype != "bf16" and expert == 1:
        raise UserError(f"mesh.ep_dispatch_dtype={ep_dispatch_dtype} sends the expert-parallel dispatch "
                        "in FP8, but mesh.expert=1 dispatches nothing; set mesh.expert above 1 or "
                        "mesh.ep_dispatch_dtype=bf16")


def check_blocks(model_config, recipes, mesh_shape: dict[str, int], micro_batch_size: int,
                 seq_len: int, model_type: str = "llama") -> None:
    """UserError if any recipe would split a quantization block across the mesh, for the
    model of ``model_type`` (lp_jax.model_registry) built from ``model_config``."""
    if all(v == 1 for v in mesh_shape.values()):
        return


    model = nnx.eval_shape(lambda: build_model(model_type, model_config, nnx.Rngs(0)))
    tokens = micro_batch_size * math.prod(mesh_shape.get(a, 1) for a in BATCH_AXES) * seq_len
    for recipe in recipes:
        if not recipe.quantized:
            continue
        lp_jax.apply_recipe(model, recipe)
        for path, node in nnx.iter_graph(model):
            dg = getattr(node, "dot_general", None)
            if not isinstance(node, nnx.Linear) or not isinstance(dg, LowPrecisionDotGeneral):
                continue
            name = "/".join(map(str, path))
            splits = linear_splits(name, tuple(node.kernel.shape), mesh_shape, tokens)
            try:
                check_linear(name, splits, dg.recipe)
            except BlockStraddleError as e:
                raise UserError(str(e)) from None
