"""Checks, before compiling, that a mesh never splits a quantization block across shards.

Every block of a quantized GEMM operand runs along a contraction axis (K for fprop, N for
dgrad, the tokens M for wgrad; NVFP4's 16x16 weight tiles span K and N, its Hadamard
transform 16 tokens). A mesh that cuts one of those dimensions into shards that are not
whole blocks is rejected, naming the layer, the dimension, the mesh axis and the block
size. Per-tensor scales need no check (docs/scaling.md, "Low precision under sharding").
"""
from __future__ import annotations

import dataclasses

from lp_jax.errors import UserError
from lp_jax.numerics.registry import Format, format_named
from lp_jax.numerics.hadamard import RHT_SIZE as RHT_LENGTH
from lp_jax.recipes import Recipe


class BlockStraddleError(UserError):
    """A mesh would split a quantization block across devices."""


@dataclasses.dataclass(frozen=True)
class Split:
    """How one dimension of one GEMM operand is divided over the mesh."""

    size: int  # the dimension's global length
    shards: int = 1  # product of the mesh axes that split it
    mesh_axes: str = ""  # their names, for messages ("fsdp", "data x fsdp")


@dataclasses.dataclass(frozen=True)
class LinearSplits:
    """The splits of y[M, N] = x[M, K] @ W[K, N] for one Linear (activations and weight may
    split K and N differently: a row-parallel layer's x has K on ``tensor`` and its W too)."""

    x_m: Split
    x_k: Split
    w_k: Split
    w_n: Split
    dy_m: Split
    dy_n: Split


# (operand field of the recipe, tensor, blocked dimension, the other dimension of 16x16 tiles)
_OPERANDS = (
    ("fprop_x", "x", "k", None), ("fprop_w", "w", "k", "n"),
    ("dgrad_dy", "dy", "n", None), ("dgrad_w", "w", "n", "k"),
    ("wgrad_x", "x", "m", None), ("wgrad_dy", "dy", "m", None),
)
_DIM_NAMES = {"m": "M (tokens)", "k": "K (in features)", "n": "N (out features)"}


def _format(spec) -> Format | None:
    return None if spec.fmt is None else format_named(spec.fmt)


def _block(spec) -> int | None:
    fmt = _format(spec)
    size = fmt.block if fmt is not None else None
    if spec.rht:
        size = max(size or 1, RHT_LENGTH)
    return size


def straddles(splits: LinearSplits, recipe: Recipe) -> list[str]:
    """Descriptions of every (operand, dimension) whose shards are not whole blocks."""
    problems = []
    for field, tensor, dim, tile_dim in _OPERANDS:
        spec = getattr(recipe, field)
        block = _block(spec)
        if block is None:
            continue
        dims = [dim] + ([tile_dim] if spec.block_2d and tile_dim else [])
        for d in dims:
            split = getattr(splits, f"{tensor}_{d}")
            if split.shards <= 1:
                continue
            local, rem = divmod(split.size, split.shards)
            if rem or local % block:
                fmt = _format(spec)
                what = f"{fmt.label} " if fmt is not None and fmt.block else ""
                what += f"{block}x{block} tiles" if spec.block_2d else f"{block}-element blocks"
                if spec.rht:
                    what += " (and 16-point Hadamard transform)"
                problems.append(
                    f"{field} {tensor} along {_DIM_NAMES[d]}={split.size}: mesh axis "
                    f"{split.mesh_axes} makes {split.shards} shards of "
                    f"{split.size / split.shards:g}, not a multiple of its {what}")
    return problems


def check_linear(path: str, splits: LinearSplits, recipe: Recipe) -> None:
    """Raises BlockStraddleError naming ``path`` if ``splits`` would split a block."""
    problems = straddles(splits, recipe)
    if problems:
        raise BlockStraddleError(
            f"the mesh splits quantization blocks of {path} ({type(recipe).__name__}): "
            f"{problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
            + "; choose mesh sizes (or micro-batch and sequence length) that keep every "
              "shard a whole number of blocks")
