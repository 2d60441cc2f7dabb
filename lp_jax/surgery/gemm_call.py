"""Runs an intercepted ``lax.dot_general`` / ``jnp.einsum`` call with lp_jax's GEMM: the
handler ``lp_jax.surgery.interception`` frames call, for NNX and Linen modules alike."""
from __future__ import annotations

from lp_jax.surgery.gemm_modules import einsum_problem
from lp_jax.surgery.interception import original_einsum

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
