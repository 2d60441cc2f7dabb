"""Which container holds a model's repeated blocks, and each GEMM's layer index in it.

Found from the model's structure, not from names: an indexed container is a path whose
children are numbered (an ``nnx.List`` or ``nnx.Sequential``: ``h/3/...``; an ``nnx.Dict``
with keys '0', '1', ...; attributes ``block_0``, ``block_1``, ... give the container
``block``); a stacked container is the outermost module whose GEMMs all carry one more
leading axis than one layer's kernel (blocks made by ``nnx.vmap``, run by ``nnx.scan``),
its depth being that axis. Without ``layers=``, a container nested in another's blocks
(experts inside a layer) is not a candidate, and two candidates are an error that asks for
``layers=``.
"""
from __future__ import annotations

import dataclasses
import re

from lp_jax.surgery.gemm_modules import kernel_of, per_layer_kernel_ndim

_NUMBERED = re.compile(r"^(.+)_(\d+)$")


@dataclasses.dataclass(frozen=True)
class LayerContainer:
    path: str  # '/'-joined, as the layers= keyword names it
    num_layers: int
    stacked: bool
    # '/'-joined GEMM path -> its layer index (indexed containers); stacked: the GEMMs in it
    index: dict = dataclasses.field(default_factory=dict, compare=False)
    members: frozenset = frozenset()

    def describe(self) -> str:
        kind = "stacked over a leading axis" if self.stacked else "indexed"
        return f"{self.path!r} ({kind}, {self.num_layers} layers)"


def _index_positions(keys, module=None):
    """[(container path, layer index)] for every numbered key of a GEMM's path, outermost
    first. A GEMM's own name in Linen's automatic form (``Dense_2`` for an nn.Dense) numbers
    modules, not blocks."""
    out = []
    own_class = getattr(module, "class_name", type(module).__name__)
    for j, key in enumerate(keys):
        if isinstance(key, int) or (isinstance(key, str) and key.isdigit()):
            out.append(("/".join(map(str, keys[:j])), int(key)))
        elif isinstance(key, str) and (m := _NUMBERED.match(key)):
            if j == len(keys) - 1 and m.group(1) == own_class:
                continue
            out.append(("/".join(map(str, (*keys[:j], m.group(1)))), int(m.group(2))))
    return out


def _stacked_depth(module, kind):
    kernel, ndim = kernel_of(module), per_layer_kernel_ndim(module, kind)
    if kernel is None or ndim is None or len(kernel.shape) <= ndim:
        return None
    return kernel.shape[0]


def _candidates(gemms, nested: bool) -> dict[str, LayerContainer]:
    indexed: dict[str, dict[str, int]] = {}
    for keys, text, module, _ in gemms:
        positions = _index_positions(keys, module)
        for container, i in positions if nested else positions[:1]:
            indexed.setdefault(container, {})[text] = i
    found = {c: LayerContainer(c, max(idx.values()) + 1, False, idx, frozenset(idx))
             for c, idx in indexed.items()}
    depths = {text: _stacked_depth(module, kind) for keys, text, module, kind in gemms
              if not _index_positions(keys, module)}
    for keys, text, _, _ in gemms:
        if depths.get(text) is None:
            continue
        for n in range(len(keys)):  # the shortest prefix whose GEMMs are all stacked alike
            prefix = "/".join(map(str, keys[:n]))
            under = [t for k, t, _, _ in gemms if tuple(k[:n]) == tuple(keys[:n])]
            if all(depths.get(t) == depths[text] for t in under):
                found.setdefault(prefix, LayerContainer(prefix, depths[text], True,
                                                        members=frozenset(under)))
                break
    return found


def find_container(gemms, layers: str | None) -> LayerContainer | None:
    """The model's layer container: the one named by ``layers``, else the only candidate,
    else None (no candidate). ValueError for a name that is none of them, or for several."""
    if layers is not None:
        found = _candidates(gemms, nested=True)
        if layers not in found:
            seen = ", ".join(c.describe() for c in found.values()) or "none"
            raise ValueError(f"layers={layers!r} names no layer container of this model; "
                             f"containers found: {seen}")
        return found[layers]
    found = _candidates(gemms, nested=False)
    if len(found) > 1:
        seen = ", ".join(c.describe() for c in found.values())
        raise ValueError(f"apply_recipe found several layer containers ({seen}): name one with layers=")
    return next(iter(found.values()), None)
