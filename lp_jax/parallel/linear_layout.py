"""Where a Linear's weight lives on the mesh, and what its GEMM does about it.

``apply_recipe(model, recipe, layout=LinearLayout(mesh_shape, tp_reduce_dtype))`` gives
each Linear, in the pass that picks its recipe, its kernel's mesh layout when the GEMM
all-gathers quantized bytes over ``fsdp`` (``precision.param_gather``,
``lp_jax.gemm.param_gather``), and "row" or "column" when it reduces its tensor-parallel
partial sums in BF16 (``mesh.tp_reduce_dtype``, ``lp_jax.gemm.tensor_reduce``). Only static
attributes of the dot_general change: the state tree and the checkpoints are the same
whatever the layout (docs/scaling.md).
"""
from __future__ import annotations

import dataclasses
from typing import Literal

from jax.sharding import PartitionSpec as P

from lp_jax.config.schema import TP_REDUCE_DTYPES
from lp_jax.parallel.partitioning import param_spec, spec_without
from lp_jax.recipes import Recipe

Reduction = Literal["row", "column"]


def kernel_spec(path: str, kernel_shape, mesh_shape: dict[str, int]) -> tuple:
    """The mesh axes of a Linear's 2-D kernel [in, out] (one entry per dimension) by the rules."""
    return (tuple(param_spec(f"{path}/kernel", tuple(kernel_shape), mesh_shape)) + (None, None))[:2]


def _on(axis: str, entry) -> bool:
    return entry == axis or (isinstance(entry, tuple) and axis in entry)


@dataclasses.dataclass(frozen=True)
class LinearLayout:
    """The mesh's sizes by axis name and ``mesh.tp_reduce_dtype``."""

    mesh_shape: dict[str, int]
    tp_reduce_dtype: str = "bf16"

    def __post_init__(self):
        if self.tp_reduce_dtype not in TP_REDUCE_DTYPES:
            raise ValueError(f"tp_reduce_dtype={self.tp_reduce_dtype!r} is invalid: choose one of "
                             f"{', '.join(TP_REDUCE_DTYPES)}")

    @property
    def partly_manual(self) -> bool:
        """The trainer's data shard_map is manual over an axis that splits (data > 1) and
        leaves another that splits to the partitioner (fsdp or tensor > 1): JAX's custom
        partitioners fail to compile there (docs/plan.md, known limits)."""
        splits = lambda axis: self.mesh_shape.get(axis, 1) > 1  # noqa: E731
        return splits("data") and any(splits(a) for a in self.mesh_shape if a != "data")

    @property
    def partitioned(self) -> bool:
        """Some GEMM sees arrays the partitioner splits (fsdp or tensor > 1); with data
        parallelism alone the trainer's data shard_map is manual and every GEMM is local."""
        return any(n > 1 for a, n in self.mesh_shape.items() if a != "data")

    def gather(self, path: str, kernel_shape, recipe: Recipe) -> tuple | None:
        """The kernel's mesh layout when the GEMM all-gathers its quantized bytes, else None."""
        if not (recipe.quantized and recipe.param_gather) or self.mesh_shape.get("fsdp", 1) <= 1 \
                or len(kernel_shape) != 2:
            return None
        layout = kernel_spec(path, kernel_shape, self.mesh_shape)
        if "fsdp" not in layout:
            return None
        # Size-1 axes split nothing, and inside the trainer's data shard_map they are manual
        # (partitioning.data_shard_map_axes): the gather's own shard_map must not name them.
        ones = [a for a, n in self.mesh_shape.items() if n == 1]
        return tuple(spec_without(P(*layout), ones))

    def tensor_reduce(self, path: str, kernel_shape) -> Reduction | None:
        """"row" / "column" when the GEMM reduces its tensor-parallel partial sums in BF16."""
        if self.tp_reduce_dtype != "bf16" or self.mesh_shape.get("tensor", 1) <= 1 or len(kernel_shape) != 2:
            return None
        on_tensor = [_on("tensor", entry) for entry in kernel_spec(path, kernel_shape, self.mesh_shape)]
        return "row" if on_tensor[0] else "column" if on_tensor[1] else None
