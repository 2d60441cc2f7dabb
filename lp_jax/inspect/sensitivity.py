"""Per-layer sensitivity and the proposed layer policy of ``python -m lp_jax.inspect``.

``make_selectable`` gives every transformer layer's Linears a ``SelectableDotGeneral``, the
recipe's GEMM or the BF16 one picked by a traced per-layer mask, so one compiled forward
measures any set of quantized layers on the same batches. ``measure`` gives the losses of all
BF16, all quantized and each layer alone; ``propose`` the fewest BF16 layers whose gap to
all-BF16 fits the budget (the search: docs/telemetry.md).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Iterator

import numpy as np
from flax import nnx
from jax import lax

from lp_jax import context
from lp_jax.gemm.dot_general import KeepKernelDtype, LowPrecisionDotGeneral
from lp_jax.recipes import BF16, Recipe
from lp_jax.surgery.swap import IN_LAYERS, LAYER_INDEX

_MASK: contextvars.ContextVar[Any] = contextvars.ContextVar("lp_jax_inspect_mask", default=None)


@contextlib.contextmanager
def quantized_layers(mask) -> Iterator[None]:
    """Inside, layer l's SelectableDotGenerals run the recipe if mask[l] else BF16."""
    token = _MASK.set(mask)
    try:
        yield
    finally:
        _MASK.reset(token)


@dataclasses.dataclass(frozen=True)
class SelectableDotGeneral:
    recipe: Recipe

    def __call__(self, lhs, rhs, dimension_numbers, **kwargs):
        quantized = LowPrecisionDotGeneral(self.recipe)
        bf16 = LowPrecisionDotGeneral(BF16(backend=self.recipe.backend))
        mask, layer = _MASK.get(), context.current_layer()
        if mask is None or layer is None:
            raise ValueError("SelectableDotGeneral runs inside quantized_layers(mask), in a "
                             "layer_scope")
        return lax.cond(mask[layer], lambda a, b: quantized(a, b, dimension_numbers, **kwargs),
                        lambda a, b: bf16(a, b, dimension_numbers, **kwargs), lhs, rhs)


def make_selectable(model, recipe: Recipe) -> int:
    """Gives every Linear inside the transformer layers (path layers/<i>/...) a
    SelectableDotGeneral of ``recipe``, in place; returns the number of layers."""
    indices = []
    for path, node in nnx.iter_graph(model):
        path = "/".join(map(str, path))
        m = LAYER_INDEX.search(path)
        if isinstance(node, nnx.Linear) and m is not None and IN_LAYERS.search(path):
            node.dot_general = SelectableDotGeneral(recipe)
            node.promote_dtype = KeepKernelDtype()
            indices.append(int(m.group(1)))
    if not indices:
        raise ValueError("the model has no Linear under layers/<i>/ to quantize")
    return max(indices) + 1


@dataclasses.dataclass
class Sensitivity:
    num_layers: int
    bf16_loss: float  # every layer in BF16
    quantized_loss: float  # every layer quantized
    layer_loss: list[float]  # only layer l quantized

    def gap_pct(self, loss: float) -> float:
        return 100.0 * (loss - self.bf16_loss) / self.bf16_loss

    def ranking(self) -> list[int]:
        """Layers, the most sensitive first (ties: the lower index first)."""
        return sorted(range(self.num_layers), key=lambda i: (-self.layer_loss[i], i))


def measure(loss_of_mask: Callable[[np.ndarray], float], num_layers: int) -> Sensitivity:
    none, every = np.zeros(num_layers, bool), np.ones(num_layers, bool)
    return Sensitivity(num_layers, loss_of_mask(none), loss_of_mask(every),
                       [loss_of_mask(np.arange(num_layers) == i) for i in range(num_layers)])


@dataclasses.dataclass
class Proposal:
    bf16_layers: list[int]
    loss: float
    gap_pct: float
    fil: tuple[int, int] | None  # (i, j) when the set is FiLj-shaped
    tried: list[tuple[list[int], float]]  # every candidate measured: (BF16 layers, gap %)

    def override(self) -> str:
        if self.fil is not None:
            return f"precision.first_bf16_layers={self.fil[0]} precision.last_bf16_layers={self.fil[1]}"
        return f"precision.bf16_layers=[{', '.join(map(str, self.bf16_layers))}]"

    @property
    def policy(self) -> str:
        if self.fil is not None:
            return f"F{self.fil[0]}L{self.fil[1]}"
        return f"F0L0+bf16[{','.join(map(str, self.bf16_layers))}]"


def fil_of(layers, num_layers: int) -> tuple[int, int] | None:
    """(i, j) if ``layers`` is exactly the first i and last j layers, else None."""
    s = set(layers)
    i = 0
    while i in s:
        i += 1
    j = 0
    while num_layers - 1 - j in s and num_layers - 1 - j >= i:
        j += 1
    return (i, j) if len(s) == i + j else None


def propose(sens: Sensitivity, loss_of_mask: Callable[[np.ndarray], float],
            budget_pct: float) -> Proposal:
    n = sens.num_layers
    ranking = sens.ranking()
    measured: dict[tuple[int, ...], float] = {}

    def gap(bf16_layers) -> float:
        key = tuple(sorted(bf16_layers))
        if key not in measured:
            mask = np.ones(n, bool)
            mask[list(key)] = False
            measured[key] = loss_of_mask(mask)
        return sens.gap_pct(measured[key])

    for k in range(n + 1):
        fils = [tuple(range(i)) + tuple(range(n - (k - i), n)) for i in range(k + 1)]
        candidates = [tuple(sorted(ranking[:k]))] + [c for c in fils if len(set(c)) == k]
        fitting = [(gap(c), c) for c in dict.fromkeys(candidates) if gap(c) <= budget_pct]
        if not fitting:
            continue
        shaped = [(g, c) for g, c in fitting if fil_of(c, n) is not None]
        g, best = min(shaped or fitting)
        tried = [(list(c), sens.gap_pct(loss)) for c, loss in measured.items()]
        return Proposal(list(best), measured[best], g, fil_of(best, n), tried)
    raise AssertionError("all layers in BF16 always fits")  # k = n has gap 0
