"""The probe: statistics of all six GEMM operands of every quantized Linear, on one batch.

``instrument(model, recipe)`` wraps each quantized Linear's dot_general in a ``ProbeDotGeneral``;
``collect`` runs one forward and backward and returns the statistics, one
[layers, 6, len(STATS)] array per Linear. Inside a ``collecting`` scope the GEMMs compute what
they compute without the probe (stochastically rounded operands are measured with bits of
their own, so the GEMM's bits stay the step's); outside it a ProbeDotGeneral is the plain
GEMM. How the statistics leave the backward pass (identity custom-VJP taps, per-layer sinks):
docs/telemetry.md.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import warnings
import zlib
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lp_jax import context
from lp_jax.gemm.dot_general import LowPrecisionDotGeneral
from lp_jax.gemm.operands import shares_bytes
from lp_jax.recipes import OPERAND_FIELDS, Recipe
from lp_jax.surgery.layer_policy import LayerPolicyDotGeneral
from lp_jax.surgery.swap import IN_LAYERS, LAYER_INDEX
from lp_jax.telemetry.stats import STATS, operand_stats

OPERANDS = OPERAND_FIELDS  # fprop_x, fprop_w, dgrad_dy, dgrad_w, wgrad_x, wgrad_dy
# (operand, axis of the 2-D tensor it is quantized along): x [M, K], W [K, N], dy [M, N]
_INPUT_OPERANDS = (("fprop_x", 1), ("fprop_w", 0), ("dgrad_w", 1), ("wgrad_x", 0))
_OUTPUT_OPERANDS = (("dgrad_dy", 1), ("wgrad_dy", 0))
_SR_TAGS = {"dgrad_dy": 1, "wgrad_dy": 2}


@dataclasses.dataclass
class _Collecting:
    sinks: dict  # linear name -> [num_layers, 6, len(STATS)] zeros (traced)
    key: Any  # typed JAX key for the statistics' own stochastic rounding


_SCOPE: contextvars.ContextVar[_Collecting | None] = contextvars.ContextVar(
    "lp_jax_quant_stats", default=None)


@contextlib.contextmanager
def collecting(sinks: dict, key) -> Iterator[None]:
    """ProbeDotGenerals traced inside feed their statistics to ``sinks`` (each tap's backward
    returns them as the cotangent of its row, ``sinks[linear][layer]``); outside, they are the
    plain GEMM."""
    token = _SCOPE.set(_Collecting(sinks, key))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def _stats_rows(recipe, tensors_by_operand, key_data):
    """[6, len(STATS)]: the statistics of the given operands, zeros for the others. Two uses
    of one tensor whose quantized copies are the same bytes (shares_bytes: per-tensor FP8,
    NVFP4 16x16 weight tiles) are measured once."""
    rows, done = [], {}
    for name in OPERANDS:
        spec = getattr(recipe, name)
        if name not in tensors_by_operand or spec.fmt is None:
            rows.append(jnp.zeros((len(STATS),), jnp.float32))
            continue
        t, axis = tensors_by_operand[name]
        same = [other for other, row in done.items() if tensors_by_operand[other][0] is t
                and shares_bytes(getattr(recipe, other), spec)]
        if same:
            rows.append(done[same[0]])
            continue
        key = None
        if spec.stochastic:
            key = jax.random.fold_in(jax.random.wrap_key_data(key_data), _SR_TAGS[name])
        done[name] = operand_stats(t, spec, axis, key)
        rows.append(done[name])
    return jnp.stack(rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tap_inputs(recipe, x, w, row):
    return x, w


def _tap_inputs_fwd(recipe, x, w, row):
    return (x, w), (x, w)


def _tap_inputs_bwd(recipe, res, g):
    x, w = res
    x2 = x.reshape(-1, x.shape[-1])
    wc = w.astype(x.dtype)  # the GEMM quantizes the BF16 cast of the FP32 master
    tensors = {name: (x2 if name.endswith("_x") else wc, axis) for name, axis in _INPUT_OPERANDS}
    return g[0], g[1], _stats_rows(recipe, tensors, None)


_tap_inputs.defvjp(_tap_inputs_fwd, _tap_inputs_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tap_output(recipe, y, row, key_data):
    return y


def _tap_output_fwd(recipe, y, row, key_data):
    return y, key_data


def _tap_output_bwd(recipe, key_data, dy):
    dy2 = dy.reshape(-1, dy.shape[-1])
    tensors = {name: (dy2, axis) for name, axis in _OUTPUT_OPERANDS}
    return dy, _stats_rows(recipe, tensors, key_data), None


_tap_output.defvjp(_tap_output_fwd, _tap_output_bwd)


@dataclasses.dataclass(frozen=True)
class ProbeDotGeneral:
    """The Linear's own dot_general (``inner``), with the statistics taps around it while a
    ``collecting`` scope is open. ``recipe`` gives the formats the statistics use (the
    run's recipe); ``linear`` names the Linear inside its layer ('attn/q_proj')."""

    inner: Any
    recipe: Recipe
    linear: str

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                 out_sharding=None):
        kwargs = dict(precision=precision, preferred_element_type=preferred_element_type,
                      out_sharding=out_sharding)
        scope = _SCOPE.get()
        if scope is None:
            return self.inner(lhs, rhs, dimension_numbers, **kwargs)
        (lc, rc), (lb, rb) = dimension_numbers
        if lb or rb or tuple(lc) != (lhs.ndim - 1,) or tuple(rc) != (0,) or rhs.ndim != 2:
            raise ValueError(f"quant stats: {self.linear} is not a Linear-style contraction "
                             f"(dimension numbers {dimension_numbers})")
        layer = context.current_layer()
        layer = 0 if layer is None else layer
        row = scope.sinks[self.linear][layer]
        key = jax.random.fold_in(jax.random.fold_in(scope.key, layer),
                                 zlib.crc32(self.linear.encode()) & 0x7FFFFFFF)
        lhs, rhs = _tap_inputs(self.recipe, lhs, rhs, row)
        y = self.inner(lhs, rhs, dimension_numbers, **kwargs)
        return _tap_output(self.recipe, y, row, jax.random.key_data(key))


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a probe measures: the recipe, the layers, the Linears of a layer (sorted), and
    which layers the recipe's layer policy keeps in BF16 (those have no statistics)."""

    recipe: Recipe
    num_layers: int
    linears: tuple[str, ...]

    def layer_is_bf16(self, layer: int) -> bool:
        return self.recipe.layer_is_bf16(layer, self.num_layers)


def _linear_name(path: str) -> str:
    m = LAYER_INDEX.search(path) or IN_LAYERS.search(path)
    return path[m.end():].lstrip("/")


def instrument(model, recipe: Recipe) -> Layout:
    """Wraps, in place, the dot_general of every Linear inside the transformer layers that
    ``apply_recipe`` quantized in a ProbeDotGeneral measuring with ``recipe``'s formats
    (stacked Linears with a per-slice policy too: their BF16 slices' rows are dropped by
    the records). Linears the policy keeps in BF16 stay as they are: each layer adds 42
    quantizations to the probe's program, and a BF16 layer has nothing to report. Returns
    the Layout of the statistics."""
    if not recipe.quantized:
        raise ValueError(f"quant stats: recipe {type(recipe).__name__} quantizes nothing")
    names, indices, depths = set(), [], []
    for path, node in nnx.iter_graph(model):
        path = "/".join(map(str, path))
        if not (isinstance(node, nnx.Linear) and IN_LAYERS.search(path)):
            continue
        inner = node.dot_general
        if isinstance(inner, ProbeDotGeneral):
            inner = inner.inner
        if not isinstance(inner, (LowPrecisionDotGeneral, LayerPolicyDotGeneral)):
            continue  # not selected by apply_recipe (a user's own GEMM): not measured
        m = LAYER_INDEX.search(path)
        if m is not None:
            indices.append(int(m.group(1)))
        elif node.kernel.ndim > 2:
            depths.append(node.kernel.shape[0])
        name = _linear_name(path)
        names.add(name)
        if isinstance(inner, LowPrecisionDotGeneral) and not inner.recipe.quantized:
            continue  # kept in BF16 by the layer policy
        node.dot_general = ProbeDotGeneral(inner, recipe, name)
    if not names:
        raise ValueError("quant stats: the model has no Linear swapped by apply_recipe inside "
                         "its transformer layers")
    num_layers = max(indices) + 1 if indices else max(depths, default=1)
    return Layout(recipe, num_layers, tuple(sorted(names)))


def probe_sinks(layout: Layout) -> dict:
    return {name: jnp.zeros((layout.num_layers, len(OPERANDS), len(STATS)), jnp.float32)
            for name in layout.linears}


def collect(loss_fn, layout: Layout, key, weights):
    """(statistics {linear: [layers, 6, len(STATS)]}, aux) of ``loss_fn(weights)``, which
    returns (a scalar loss, aux). ``weights`` (the model state the loss merges) is
    differentiated too, its gradient thrown away: a model run by ``nnx.scan`` refuses state
    from outside the differentiated function's trace. The GEMMs' backward computes weight
    gradients anyway, so this adds no GEMM."""
    def with_sinks(sinks, weights):
        with collecting(sinks, key):
            return loss_fn(weights)

    (stats, _), aux = jax.grad(with_sinks, argnums=(0, 1), has_aux=True, allow_int=True)(
        probe_sinks(layout), weights)
    return stats, aux


def as_numpy(stats: dict) -> dict:
    return {name: np.asarray(jax.device_get(v)) for name, v in stats.items()}


def aggregate(per_batch: list[dict]) -> dict:
    """The statistics of several probes as one: amax and the largest scale exponent the
    maximum, the smallest exponent the minimum, the fractions and the SQNR (dB) the mean of
    the finite values (an SQNR of -inf in any batch, values lost to NaN blocks, stays -inf;
    +inf, an exact copy, only where every batch was exact)."""
    out = {}
    for name in per_batch[0]:
        stacked = np.stack([s[name] for s in per_batch])  # [batches, layers, 6, STATS]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices give NaN
            mean = np.nanmean(np.where(np.isinf(stacked), np.nan, stacked), axis=0)
            out[name] = np.where(np.isnan(mean), stacked[0], mean)
            for stat, reduce in (("amax", np.max), ("scale_exp_min", np.nanmin),
                                 ("scale_exp_max", np.nanmax)):
                out[name][..., STATS.index(stat)] = reduce(stacked[..., STATS.index(stat)], axis=0)
        sqnr = STATS.index("sqnr_db")
        lost = np.any(np.isneginf(stacked[..., sqnr]), axis=0)
        out[name][..., sqnr] = np.where(lost, -np.inf, out[name][..., sqnr])
    return out
