"""The NNX modules that hold a GEMM, and how apply_recipe sets, resets and checks each kind.

Kinds: ``nnx.Linear``, ``nnx.LinearGeneral`` (its ``dot_general``; a contraction over several
axes reaches ``lp_jax.dot_general`` as it is, which flattens it to one K axis, as Transformer
Engine does), ``nnx.Einsum`` (its ``einsum_op``: ``jnp.einsum`` with ``_dot_general`` set to
lp_jax's), and a user module with a ``dot_general`` or ``einsum_op`` attribute. A GEMM
lp_jax.dot_general cannot run (batch dimensions, the kernel as the einsum's left operand)
is refused by ``problem`` before anything is changed.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import opt_einsum
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes
from jax import lax

from lp_jax.gemm.dot_general import KeepKernelDtype, LowPrecisionDotGeneral
from lp_jax.surgery.layer_policy import LayerPolicyDotGeneral

OURS = (LowPrecisionDotGeneral, LayerPolicyDotGeneral)


@dataclasses.dataclass(frozen=True)
class LowPrecisionEinsum:
    """``einsum_op`` for ``nnx.Einsum``: ``jnp.einsum(s, inputs, kernel,
    _dot_general=dot_general)``. The output dtype is the inputs' (as a Linear's) unless the
    module asks for ``preferred_element_type``: the kernel arrives in FP32 (KeepKernelDtype)
    and would otherwise promote the output to FP32."""

    dot_general: LowPrecisionDotGeneral | LayerPolicyDotGeneral

    def __call__(self, einsum_str, inputs, kernel, precision=None, preferred_element_type=None,
                 out_sharding=None):
        bad = einsum_problem(einsum_str, inputs.shape, kernel.shape)
        if bad:
            raise ValueError(f"lp_jax cannot run einsum {einsum_str!r}: {bad}")
        return jnp.einsum(einsum_str, inputs, kernel, precision=precision,
                          preferred_element_type=preferred_element_type or inputs.dtype,
                          out_sharding=out_sharding, _dot_general=self.dot_general)


def einsum_problem(einsum_str: str, lhs_shape=None, rhs_shape=None) -> str | None:
    """Why ``jnp.einsum(einsum_str, inputs, kernel, _dot_general=lp_jax's)`` cannot run the
    kernel as the GEMM's weight, or None. Without shapes, a string with '...' is not judged
    (the call judges it)."""
    if lhs_shape is None:
        if "..." in einsum_str:
            return None
        if "->" not in einsum_str:
            return "it has no '->' output"
        ins, out = einsum_str.split("->")
        ops = ins.split(",")
    else:
        parsed_ins, out, _ = opt_einsum.parser.parse_einsum_input(
            (einsum_str, _Shaped(tuple(lhs_shape)), _Shaped(tuple(rhs_shape))))
        ops = parsed_ins.split(",")
    if len(ops) != 2:
        return f"it has {len(ops)} operands, not inputs and kernel"
    lhs, rhs = ops
    batch = [c for c in out if c in lhs and c in rhs]
    if batch:
        return f"{''.join(batch)!r} appear in inputs, kernel and output (batch dimensions)"
    if len(set(lhs)) != len(lhs) or len(set(rhs)) != len(rhs):
        return "an operand repeats a letter (a diagonal)"
    contracted = [c for c in lhs if c in rhs]
    if not contracted:
        return "nothing is contracted"
    free_lhs = "".join(c for c in lhs if c in out)
    free_rhs = "".join(c for c in rhs if c in out)
    if free_rhs + free_lhs == out:  # jnp.einsum would call dot_general(kernel, inputs)
        return (f"output {out!r} puts the kernel's axes first, so jnp.einsum would make the "
                "kernel the GEMM's left operand")
    return None


@dataclasses.dataclass(frozen=True)
class _Shaped:  # what opt_einsum's parser reads of an operand: no array is made
    shape: tuple


def gemm_modules(model):
    """(path keys, '/'-joined path, module, kind) of every module holding a GEMM, in graph order."""
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module):
            continue
        text = "/".join(map(str, path))
        if isinstance(node, nnx.Linear):
            yield path, text, node, "Linear"
        elif isinstance(node, nnx.LinearGeneral):
            yield path, text, node, "LinearGeneral"
        elif isinstance(node, nnx.Einsum):
            yield path, text, node, "Einsum"
        elif "dot_general" in vars(node) and callable(node.dot_general):
            yield path, text, node, "dot_general"
        elif "einsum_op" in vars(node) and callable(node.einsum_op):
            yield path, text, node, "einsum_op"


def problem(module, kind: str) -> str | None:
    """Why this module's GEMM cannot be given lp_jax's, or None."""
    if kind == "LinearGeneral":
        if module.batch_axis:
            return (f"nnx.LinearGeneral with batch_axis {dict(module.batch_axis)} (lp_jax.dot_general "
                    "has no batch dimensions)")
        if module.dot_general_cls is not None:
            return "nnx.LinearGeneral with a dot_general_cls (it would be used instead of dot_general)"
    if kind == "Einsum" and module.einsum_str is not None:
        bad = einsum_problem(module.einsum_str)
        if bad:
            return f"nnx.Einsum {module.einsum_str!r}: {bad}"
    return None


def per_layer_kernel_ndim(module, kind: str) -> int | None:
    """The kernel's rank in one layer: more means the module is stacked over layers (nnx.vmap);
    None where the module does not say (a user module)."""
    if kind == "Linear":
        return 2
    if kind == "LinearGeneral":
        return len(module.batch_axis) + len(module.in_features) + len(module.out_features)
    if kind == "Einsum":
        return len(module.kernel_shape)
    return None


def kernel_of(module):
    kernel = getattr(module, "kernel", None)
    return kernel if isinstance(kernel, nnx.Variable) else None


def current(module, kind: str):
    """The dot_general the module runs now (an Einsum's is inside its einsum_op)."""
    if kind in ("Einsum", "einsum_op"):
        op = module.einsum_op
        return op.dot_general if isinstance(op, LowPrecisionEinsum) else op
    return module.dot_general


def is_default(module, kind: str) -> bool:
    """Still on Flax's own GEMM (so apply_recipe may give it lp_jax's BF16 one)."""
    if kind == "Linear":
        return module.dot_general is lax.dot_general
    if kind == "LinearGeneral":
        return module.dot_general in (None, lax.dot_general) and module.dot_general_cls is None
    if kind == "Einsum":
        return module.einsum_op is jnp.einsum
    return False  # a user module's own GEMM is its business


def set_gemm(module, kind: str, dg):
    if kind in ("Einsum", "einsum_op"):
        module.einsum_op = LowPrecisionEinsum(dg)
    else:
        module.dot_general = dg
    if kind in ("Linear", "LinearGeneral", "Einsum"):
        module.promote_dtype = KeepKernelDtype()


def reset(module, kind: str):
    """Undoes an earlier apply_recipe (a GEMM that is not lp_jax's is kept)."""
    if not isinstance(current(module, kind), OURS):
        return
    if kind in ("Einsum", "einsum_op"):
        module.einsum_op = jnp.einsum
    else:
        module.dot_general = None if kind == "LinearGeneral" else lax.dot_general
    if kind in ("Linear", "LinearGeneral", "Einsum"):
        module.promote_dtype = nnx_dtypes.promote_dtype
