"""The quantized dot_general: fprop, dgrad and wgrad each in the recipe's formats.

``dot_general(recipe)`` returns a frozen, hashable callable with the ``lax.dot_general``
signature plus the ``out_sharding`` keyword that ``nnx.Linear`` passes, so it can be set as
``linear.dot_general``. Its custom VJP keeps only quantized copies as residuals, never BF16
tensors, the same for every GEMM backend (``lp_jax.gemm.backends``); stochastic rounding
draws bits keyed by (seed, step, layer, call site) via ``lp_jax.context``, so a resumed run
draws the same bits. Weight gradients come back in FP32 only with ``KeepKernelDtype`` as the
Linear's promote_dtype (``apply_recipe`` sets both; set it yourself when you pass this
dot_general to an ``nnx.Linear`` by hand; docs/numerics.md).
"""
from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from lp_jax import context
from lp_jax.gemm import backends, param_gather, tensor_reduce
from lp_jax.gemm.operands import operand, operand_pair, per_tensor, shares_bytes, stored
from lp_jax.gemm.out_sharding import with_out_sharding
from lp_jax.gemm.prepared_kernel import PreparedKernel, weight_operands
from lp_jax.numerics.manual_axes import amax_scope
from lp_jax.recipes import Recipe, get_recipe

_SR_DGRAD, _SR_WGRAD = 1, 2  # fold-in tags for the two stochastically rounded dy copies


@dataclasses.dataclass(frozen=True)
class _GemmConfig:
    recipe: Recipe
    backend: str  # "auto" (decided per platform when lowering) or a forced backend
    native: str | None  # the recipe's own backend, which "auto" picks when lowered for CUDA
    w_dtype: jnp.dtype  # dtype of the kernel as passed in: the weight gradient comes back in it
    out_dtype: jnp.dtype  # y: the activation dtype, or preferred_element_type
    x_dtype: jnp.dtype  # activations: the compute dtype of all three GEMMs and of dx
    gather: tuple | None = None  # the kernel's mesh layout when FSDP gathers quantized bytes
    tensor_reduce: str | None = None  # "row" / "column": fprop / dgrad reduced over tensor in BF16


def _needs_key(recipe: Recipe) -> bool:
    return recipe.dgrad_dy.stochastic or recipe.wgrad_dy.stochastic


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _linear(cfg: _GemmConfig, x, w, key_data):
    """y[M, N] = x[M, K] @ w[K, N], with the recipe's quantization."""
    return _forward(cfg, x, w, key_data)[0]


def _gemm(cfg, a, b, contracting, compute_dtype, out_dtype):
    return backends.gemm(cfg.backend, cfg.native, a, b, contracting, compute_dtype, out_dtype)


def _split_gemm(cfg, kind, a, b, contracting, compute_dtype, out_dtype):
    """_gemm of the GEMM a ``kind`` ("row": fprop, "column": dgrad) tensor-parallel layer
    splits over tensor: where the Linear is marked so, its partials reduced in out_dtype on
    the wire and FP32 arithmetic (``lp_jax.gemm.tensor_reduce``); else the plain _gemm."""
    if not tensor_reduce.applies(cfg.tensor_reduce, kind):
        return _gemm(cfg, a, b, contracting, compute_dtype, out_dtype)
    run = lambda a, b, dtype: _gemm(cfg, a, b, contracting, compute_dtype, dtype)  # noqa: E731
    return tensor_reduce.gemm(run, a, b, contracting, out_dtype)


def _forward(cfg, x, w, key_data):
    # FSDP: each shard quantized, the bytes gathered; dgrad_w stays sharded.
    if param_gather.applies(cfg.recipe, cfg.gather):
        fw, dgrad_w = param_gather.forward(cfg.recipe, cfg.gather, w, x.dtype)
    else:
        fw, dgrad_w = weight_operands(cfg.recipe, w, x.dtype)
    return _forward_with(cfg, x, fw, dgrad_w, key_data)


def _forward_with(cfg, x, fw, dgrad_w, key_data):
    """y and the residuals, given the weight's copies (fw for this GEMM, dgrad_w kept)."""
    # The recipe's amax scope covers every tensor amax taken here and in the backends.
    with amax_scope(cfg.recipe.amax_scope):
        return _quantized_forward(cfg, x, fw, dgrad_w, key_data)


def _quantized_forward(cfg, x, fw, dgrad_w, key_data):
    r = cfg.recipe
    # Only copies the backward keeps are packed here, in a layout every backend reads; the
    # others are quantized inside the GEMM by the backend that runs it.
    # A tensor's two copies come as a pair: the Pallas quantizer writes both in one read.
    if shares_bytes(r.fprop_x, r.wgrad_x):
        fx = wgrad_x = stored(x, r.fprop_x, axis=1)
    else:
        fx, wgrad_x = operand_pair(x, r.fprop_x, 1, r.wgrad_x, 0, keep_b=True)
    y = _split_gemm(cfg, "row", fx, fw, ((1,), (0,)), x.dtype, cfg.out_dtype)  # row-parallel: K on tensor
    return y, (wgrad_x, dgrad_w, key_data)


def _linear_bwd(cfg, res, dy):
    with amax_scope(cfg.recipe.amax_scope):
        return _quantized_backward(cfg, res, dy)


def _quantized_backward(cfg, res, dy):
    r = cfg.recipe
    wgrad_x, dgrad_w, key_data = res
    if param_gather.applies(r, cfg.gather):  # ZeRO-3: the weight is gathered again for dgrad
        dgrad_w = param_gather.backward(cfg.gather, dgrad_w)
    key = jax.random.wrap_key_data(key_data) if key_data is not None else None
    sr_key = lambda tag: None if key is None else jax.random.fold_in(key, tag)  # noqa: E731
    if shares_bytes(r.dgrad_dy, r.wgrad_dy):
        if per_tensor(r.dgrad_dy):
            # dy's FP8-CS amax is not fused into dy's producer: fused into SwiGLU's backward
            # (a reduction with several outputs), XLA left that kernel's exp(-gate) out and
            # wrote it in float32 ([tokens, F]) for it to read. Apart, the amax is one more
            # read of dy in BF16 (the 8B layer on a GB200: 16.75 -> 15.98 GB, docs/plan_results.md).
            dy = lax.optimization_barrier(dy)
        g_dgrad = g_wgrad = operand(dy, r.dgrad_dy, axis=1, key=sr_key(_SR_DGRAD))
    else:
        g_dgrad, g_wgrad = operand_pair(dy, r.dgrad_dy, 1, r.wgrad_dy, 0, sr_key(_SR_DGRAD), sr_key(_SR_WGRAD),
                                        keep_b=False)
    compute = cfg.x_dtype
    dx = _split_gemm(cfg, "column", g_dgrad, dgrad_w, ((1,), (1,)), compute, compute)  # column-parallel: N on tensor
    dw = _gemm(cfg, wgrad_x, g_wgrad, ((0,), (0,)), compute, cfg.w_dtype)
    return dx, dw, None


_linear.defvjp(_forward, _linear_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _prepared_linear(cfg: _GemmConfig, x, w, fw, dgrad_w, key_data):
    """_linear with the weight's copies made ahead (``lp_jax.gemm.prepared_kernel``): ``w``
    is read for nothing but its gradient, which comes back as _linear's."""
    return _forward_with(cfg, x, fw, dgrad_w, key_data)[0]


def _prepared_forward(cfg, x, w, fw, dgrad_w, key_data):
    return _forward_with(cfg, x, fw, dgrad_w, key_data)


def _prepared_bwd(cfg, res, dy):
    dx, dw, _ = _linear_bwd(cfg, res, dy)
    return dx, dw, None, None, None


_prepared_linear.defvjp(_prepared_forward, _prepared_bwd)


@dataclasses.dataclass(frozen=True)
class LowPrecisionDotGeneral:
    """Drop-in ``dot_general`` for ``nnx.Linear`` running the recipe's GEMMs.

    Supports any contracting dimensions (flattened into K) and leading dimensions of the
    inputs (flattened into M, the tokens); dot_general batch dimensions are not supported
    (a Linear has none) and raise.
    """

    recipe: Recipe
    # The kernel's mesh layout (e.g. ("fsdp", "tensor")), set by the trainer for FSDP:
    # with recipe.param_gather the weight's quantized bytes are all-gathered
    # (``lp_jax.gemm.param_gather``). None: the partitioner gathers the BF16 weight.
    gather: tuple | None = None
    # Set by the trainer with mesh.tp_reduce_dtype=bf16: "row" (kernel K on tensor: fprop's
    # partial sums) or "column" (N on tensor: dgrad's) are reduced over tensor with the
    # activation dtype on the wire (``lp_jax.gemm.tensor_reduce``). None: the partitioner
    # all-reduces them in FP32.
    tensor_reduce: str | None = None
    # Set by the trainer when its data shard_map is partly manual (mesh data > 1 with fsdp or
    # tensor > 1, ``LinearLayout.partly_manual``), where JAX's custom partitioners fail to
    # compile: the wgmma backend's GEMM (a custom partitioning) is then not chosen by auto
    # and refused when forced.
    partly_manual: bool = False

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                 out_sharding=None):
        # out_sharding: a sharding constraint on an Auto mesh; on an Explicit mesh the GEMM
        # runs with those axes Auto and the result is typed out_sharding (``lp_jax.gemm.out_sharding``).
        if isinstance(rhs, PreparedKernel):  # the weight's copies made ahead, once per step
            return with_out_sharding(
                lambda x, _: self._prepared_gemm(x, rhs, dimension_numbers, preferred_element_type),
                lhs, rhs.w, dimension_numbers, out_sharding)
        return with_out_sharding(
            lambda l, r: self._gemm(l, r, dimension_numbers, preferred_element_type),
            lhs, rhs, dimension_numbers, out_sharding)

    def _config(self, x2, w2, out_dtype) -> _GemmConfig:
        return _GemmConfig(self.recipe, backends.resolved(self.recipe),
                           backends.cuda_native(self.recipe, self.partly_manual),
                           jnp.dtype(w2.dtype), out_dtype, jnp.dtype(x2.dtype), self.gather,
                           self.tensor_reduce)

    def _key_data(self):
        return jax.random.key_data(context.site_key()) if _needs_key(self.recipe) else None

    def _prepared_gemm(self, lhs, kernel: PreparedKernel, dimension_numbers, preferred_element_type):
        (lc, rc), (lb, rb) = dimension_numbers
        lc, rc = tuple(a % lhs.ndim for a in lc), tuple(a % kernel.ndim for a in rc)
        if lb or rb or kernel.ndim != 2 or rc != (0,) or lc != (lhs.ndim - 1,):
            raise ValueError(f"a PreparedKernel {kernel.shape} is contracted as a Linear's: its first "
                             f"axis with the input's last, got {dimension_numbers}")
        if kernel.recipe != self.recipe or self.gather is not None:
            raise ValueError(f"this PreparedKernel was made for recipe {kernel.recipe.name} without a "
                             f"weight gather; this GEMM runs {self.recipe.name} (gather {self.gather})")
        if jnp.dtype(lhs.dtype) != jnp.dtype(kernel.x_dtype):
            raise ValueError(f"this PreparedKernel's copies are for {kernel.x_dtype} inputs, got {lhs.dtype}")
        x2 = lhs.reshape(-1, lhs.shape[-1])
        out_dtype = jnp.dtype(preferred_element_type or x2.dtype)
        fw, dgrad_w = kernel.operands()
        cfg = self._config(x2, kernel.w, out_dtype)
        y = _prepared_linear(cfg, x2, kernel.w, fw, dgrad_w, self._key_data())
        return y.reshape(lhs.shape[:-1] + kernel.shape[1:])

    def _gemm(self, lhs, rhs, dimension_numbers, preferred_element_type):
        (lc, rc), (lb, rb) = dimension_numbers
        if lb or rb:
            raise ValueError("lp_jax.dot_general supports Linear-style contractions only: "
                             f"got batch dimensions {lb}, {rb}")
        lc, rc = tuple(a % lhs.ndim for a in lc), tuple(a % rhs.ndim for a in rc)
        lfree = [a for a in range(lhs.ndim) if a not in lc]
        rfree = [a for a in range(rhs.ndim) if a not in rc]
        x = jnp.transpose(lhs, lfree + list(lc))
        w = jnp.transpose(rhs, list(rc) + rfree)
        out_shape = x.shape[:len(lfree)] + w.shape[len(rc):]
        k = math.prod(x.shape[len(lfree):])
        x2 = x.reshape(-1, k)
        w2 = w.reshape(k, -1)
        if not jnp.issubdtype(x2.dtype, jnp.floating):
            raise ValueError(f"lp_jax.dot_general needs floating inputs, got {x2.dtype}")
        key_data = self._key_data()
        out_dtype = jnp.dtype(preferred_element_type or x2.dtype)
        if self.gather is not None and (rhs.ndim != 2 or rc != (0,)):
            raise ValueError(f"param_gather needs a Linear kernel [in, out] contracted over its first "
                             f"axis, got shape {rhs.shape} contracted over {rc}")
        if self.partly_manual and self.recipe.quantized and backends.resolved(self.recipe) == "wgmma":
            raise ValueError("backend 'wgmma' does not compile on a mesh with data > 1 and fsdp or "
                             "tensor > 1 (its custom partitioning fails inside the partly manual data "
                             "shard_map); use data = 1 or fsdp = tensor = 1, or backend 'auto'")
        return _linear(self._config(x2, w2, out_dtype), x2, w2, key_data).reshape(out_shape)


def dot_general(recipe: Recipe | str, **overrides) -> LowPrecisionDotGeneral:
    """The quantized dot_general for ``recipe`` (a Recipe or a name for get_recipe)."""
    if isinstance(recipe, str) or overrides:
        recipe = get_recipe(recipe, **overrides)
    return LowPrecisionDotGeneral(recipe)


@dataclasses.dataclass(frozen=True)
class KeepKernelDtype:
    """``promote_dtype`` for Flax's Linear, LinearGeneral and Einsum (NNX) and Dense,
    DenseGeneral and Einsum (Linen) that casts inputs and bias but not the kernel.

    The FP32 kernel then reaches the quantized dot_general, which casts it to BF16 itself,
    so the weight gradient stays FP32 instead of being rounded to BF16 on the way back.
    NNX passes the arrays as one tuple, Linen one by one: both are accepted.
    """

    def __call__(self, *args, dtype=None, inexact=True):
        inputs, kernel, bias = args[0] if len(args) == 1 else args
        if dtype is not None:
            inputs = inputs.astype(dtype) if inputs is not None else None
            bias = bias.astype(dtype) if bias is not None else None
        return inputs, kernel, bias

