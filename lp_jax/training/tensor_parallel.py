"""Which Linears reduce their tensor-parallel partial sums in BF16 (``mesh.tp_reduce_dtype``).

After ``apply_recipe``, the trainer marks every Linear running lp_jax's GEMM whose kernel the
partitioning rules split over ``tensor``: "row" where the input features are on ``tensor``
(o_proj, down_proj: the forward's partial sums), "column" where the output features are
(q/k/v/gate/up and the LM head: the backward's input-gradient partial sums). Those GEMMs
then reduce over ``tensor`` with BF16 on the wire and an FP32 sum
(lp_jax/gemm/tensor_reduce.py). With ``tp_reduce_dtype: fp32``, or without a tensor axis,
the marks are cleared and the partitioner all-reduces the FP32 partial sums.

Only a static attribute of the dot_general changes (part of the graphdef): the state tree
and the checkpoints are the same either way.
"""
from __future__ import annotations

import dataclasses

from flax import nnx

from lp_jax.gemm.dot_general import LowPrecisionDotGeneral
from lp_jax.training.config import TP_REDUCE_DTYPES
from lp_jax.training.weight_gather import kernel_spec


def reduction_kind(path: str, kernel_shape, mesh_shape: dict[str, int]) -> str | None:
    """"row" / "column" when the kernel [in, out] has its in / out features on tensor, else None."""
    if mesh_shape.get("tensor", 1) <= 1 or len(kernel_shape) != 2:
        return None
    on_tensor = [entry == "tensor" or (isinstance(entry, tuple) and "tensor" in entry)
                 for entry in kernel_spec(path, kernel_shape, mesh_shape)]
    return "row" if on_tensor[0] else "column" if on_tensor[1] else None


def set_tensor_reductions(model, mesh_shape: dict[str, int], tp_reduce_dtype: str = "bf16") -> dict[str, str]:
    """Sets (or clears) the tensor reduction of every Linear on lp_jax's GEMM, in place;
    returns {path: "row" | "column"} for those reducing in BF16."""
    if tp_reduce_dtype not in TP_REDUCE_DTYPES:
        raise ValueError(f"tp_reduce_dtype={tp_reduce_dtype!r} is invalid: choose one of "
                         f"{', '.join(TP_REDUCE_DTYPES)}")
    marked = {}
    for path, node in nnx.iter_graph(model):
        dg = getattr(node, "dot_general", None)
        if not isinstance(node, nnx.Linear) or not isinstance(dg, LowPrecisionDotGeneral):
            continue
        name = "/".join(map(str, path))
        kind = reduction_kind(name, node.kernel.shape, mesh_shape) if tp_reduce_dtype == "bf16" else None
        if kind is not None:
            marked[name] = kind
        if dg.tensor_reduce != kind:
            node.dot_general = dataclasses.replace(dg, tensor_reduce=kind)
    return marked
