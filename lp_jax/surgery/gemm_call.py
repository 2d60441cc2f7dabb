"""Runs an intercepted ``lax.dot_general`` / ``jnp.einsum`` call with lp_jax's GEMM (the
handler ``lp_jax.surgery.interception`` frames call, for NNX and Linen modules alike), and
says which einsums lp_jax's GEMM can run."""
from __future__ import annotations

import dataclasses

import opt_einsum

from lp_jax.surgery.interception import original_einsum


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


_DOT_GENERAL_ARGS = ("precision", "preferred_element_type", "out_sharding")


def run_with(dg, op: str, args, kwargs, where: str):
    """The call ``op(*args, **kwargs)`` with ``dg`` as its GEMM; an einsum lp_jax cannot run
    (batch dimensions, the kernel's axes first) is a one-line ValueError naming ``where``."""
    if op == "dot_general":
        lhs, rhs, dimension_numbers, *rest = args
        kw = dict(zip(_DOT_GENERAL_ARGS, rest)) | {k: v for k, v in kwargs.items() if k in _DOT_GENERAL_ARGS}
        return dg(lhs, rhs, dimension_numbers, **kw)
    subscripts, inputs, kernel = args
    if kwargs.get("_dot_general") is not None:
        raise ValueError(f"{where}: its einsum brings its own _dot_general; exclude it")
    bad = einsum_problem(subscripts, inputs.shape, kernel.shape)
    if bad:
        raise ValueError(f"{where}: lp_jax cannot run einsum {subscripts!r}: {bad}; exclude it")
    kw = dict(kwargs)
    kw["preferred_element_type"] = kw.get("preferred_element_type") or inputs.dtype
    return original_einsum(subscripts, inputs, kernel, _dot_general=dg, **kw)
