"""The NNX modules that hold a GEMM, and how apply_recipe sets, resets and checks each kind.

Kinds: ``nnx.Linear``, ``nnx.LinearGeneral`` (its ``dot_general``; a contraction over several
axes reaches ``lp_jax.dot_general`` as it is, which flattens it to one K axis, as Transformer
Engine does), ``nnx.Einsum`` (its ``einsum_op``: ``jnp.einsum`` with ``_dot_general`` set to
lp_jax's), a user module with a ``dot_general`` or ``einsum_op`` attribute, and a module of
code outside Flax that holds a parameter of rank 2 or more and none of those attributes
("own GEMM": MaxText's ``DenseGeneral`` calls ``jax.lax.dot_general`` on its kernel itself),
a grouped GEMM of experts (a module with a ``ragged_dot`` attribute, called as
``jax.lax.ragged_dot``: it gets ``lp_jax.ragged_dot``'s, which runs each group through the
dot_general chosen for it),
reached by moving the instance to a subclass whose ``__call__`` intercepts that call
(``lp_jax.surgery.interception``). A GEMM
lp_jax.dot_general cannot run (batch dimensions, the kernel as the einsum's left operand)
is refused by ``problem`` before anything is changed.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes
from jax import lax

from lp_jax.gemm.dot_general import KeepKernelDtype, LowPrecisionDotGeneral
from lp_jax.gemm.ragged_dot import LowPrecisionRaggedDot
from lp_jax.surgery.gemm_call import einsum_problem, run_with
from lp_jax.surgery.interception import Frame, frame
from lp_jax.surgery.layer_policy import LayerPolicyDotGeneral

OURS = (LowPrecisionDotGeneral, LayerPolicyDotGeneral)
# A module whose class sets this to True holds a GEMM that is never quantized (a MoE router,
# which Megatron keeps in FP32): apply_recipe does not list it.
NEVER_QUANTIZED = "lp_never_quantized"


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


OWN = "own GEMM"


def _holds_weight(node) -> bool:
    """A module of code outside Flax holding a parameter of rank 2 or more (a kernel it may
    contract itself; Flax's own non-GEMM layers, Embed and Conv, are not)."""
    if type(node).__module__.split(".")[0] == "flax":
        return False
    return any(isinstance(v, nnx.Param) and len(getattr(v, "shape", ())) >= 2 for v in vars(node).values())


def _base(cls: type) -> type:
    return getattr(cls, "_lp_base", cls)


_INTERCEPTING: dict = {}


def intercepting_class(base: type) -> type:
    """``base`` with a ``__call__`` that runs its GEMMs on the instance's ``lp_dot_general``:
    one subclass per class, so graphdefs of equal models stay equal."""
    if base in _INTERCEPTING:
        return _INTERCEPTING[base]

    def __call__(self, *args, **kwargs):
        dg = self.lp_dot_general
        where = f"apply_recipe: {base.__name__}"
        own = Frame(lambda op, a, k: run_with(dg, op, a, k, where),
                    lambda: [v.shape for v in vars(self).values() if isinstance(v, nnx.Param)])
        with frame(own):
            out = base.__call__(self, *args, **kwargs)
        if own.calls == 0:
            raise ValueError(f"{where} was selected for its own GEMM, but its call ran no jax.lax.dot_general "
                             "or jnp.einsum on its parameters: exclude it")
        return out

    cls = type(base.__name__, (base,), {"__call__": __call__, "_lp_base": base, "__module__": base.__module__,
                                        "__qualname__": base.__qualname__})
    _INTERCEPTING[base] = cls
    return cls


def gemm_modules(model):
    """(path keys, '/'-joined path, module, kind) of every module holding a GEMM, in graph order."""
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module) or getattr(node, NEVER_QUANTIZED, False):
            continue
        text = "/".join(map(str, path))
        if isinstance(node, nnx.Linear):
            yield path, text, node, "Linear"
        elif isinstance(node, nnx.LinearGeneral):
            yield path, text, node, "LinearGeneral"
        elif isinstance(node, nnx.Einsum):
            yield path, text, node, "Einsum"
        elif "ragged_dot" in vars(node) and callable(node.ragged_dot):
            yield path, text, node, "ragged_dot"
        elif "dot_general" in vars(node) and callable(node.dot_general):
            yield path, text, node, "dot_general"
        elif "einsum_op" in vars(node) and callable(node.einsum_op):
            yield path, text, node, "einsum_op"
        elif _holds_weight(node):
            yield path, text, node, OWN


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
    if kind == "ragged_dot":
        return 3  # [groups, K, N]
    return None


def kernel_of(module):
    kernel = getattr(module, "kernel", None)
    return kernel if isinstance(kernel, nnx.Variable) else None


def current(module, kind: str):
    """The dot_general the module runs now (an Einsum's is inside its einsum_op)."""
    if kind in ("Einsum", "einsum_op"):
        op = module.einsum_op
        return op.dot_general if isinstance(op, LowPrecisionEinsum) else op
    if kind == OWN:
        return getattr(module, "lp_dot_general", None)
    if kind == "ragged_dot":
        op = module.ragged_dot
        return op.dot_general if isinstance(op, LowPrecisionRaggedDot) else op
    return module.dot_general


def is_default(module, kind: str) -> bool:
    """Still on Flax's own GEMM (so apply_recipe may give it lp_jax's BF16 one)."""
    if kind == "Linear":
        return module.dot_general is lax.dot_general
    if kind == "LinearGeneral":
        return module.dot_general in (None, lax.dot_general) and module.dot_general_cls is None
    if kind == "Einsum":
        return module.einsum_op is jnp.einsum
    if kind == "ragged_dot":
        return module.ragged_dot is lax.ragged_dot
    return False  # a user module's own GEMM is its business


def set_gemm(module, kind: str, dg):
    if kind == OWN:
        module.__class__ = intercepting_class(_base(type(module)))
        module.lp_dot_general = dg
        return
    if kind in ("Einsum", "einsum_op"):
        module.einsum_op = LowPrecisionEinsum(dg)
    elif kind == "ragged_dot":
        module.ragged_dot = LowPrecisionRaggedDot(dg)
    else:
        module.dot_general = dg
    if kind in ("Linear", "LinearGeneral", "Einsum"):
        module.promote_dtype = KeepKernelDtype()


def reset(module, kind: str):
    """Undoes an earlier apply_recipe (a GEMM that is not lp_jax's is kept)."""
    if not isinstance(current(module, kind), OURS):
        return
    if kind == OWN:
        module.__class__ = _base(type(module))
        del module.lp_dot_general
        return
    if kind in ("Einsum", "einsum_op"):
        module.einsum_op = jnp.einsum
    elif kind == "ragged_dot":
        module.ragged_dot = lax.ragged_dot
    else:
        module.dot_general = None if kind == "LinearGeneral" else lax.dot_general
    if kind in ("Linear", "LinearGeneral", "Einsum"):
        module.promote_dtype = nnx_dtypes.promote_dtype
