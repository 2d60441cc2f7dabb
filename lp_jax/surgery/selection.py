"""Which GEMMs a recipe runs on, for NNX and Linen models alike: the rules, the layer
container, the layer policy and every refusal, decided before any model is changed.

A GEMM here is ``(keys, path, module, kind)``: the module's path as keys and '/'-joined, the
module (NNX) or a record of it (Linen), and its kind. ``problem`` says why a GEMM cannot be
given lp_jax's; ``seen_elsewhere`` lists the other modules a rule matches (for the error of a
rule that matches no GEMM).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

from lp_jax.recipes import Recipe
from lp_jax.surgery.layer_container import LayerContainer, find_container

# Never quantized (embedding, LM head), whatever include says.
NEVER = re.compile(r"(?:^|/)(?:embed\w*|lm_head|tok_embeddings|wte|output_head|head)(?:/|$)")


def patterns(rules) -> list[str]:
    if rules is None:
        return []
    return [rules] if isinstance(rules, str) else list(rules)


@dataclasses.dataclass
class Selection:
    """``chosen``: (path, module, kind, layer or None, stacked) the recipe's GEMM goes to
    (``layer`` set: the policy may keep it in BF16; ``stacked``: per slice); ``left``: the
    others, as (path, module, kind)."""

    container: LayerContainer | None
    num_layers: int
    chosen: list
    left: list

    def is_bf16_by_policy(self, recipe: Recipe, layer) -> bool:
        return layer is not None and recipe.layer_is_bf16(layer, self.num_layers)


def select(gemms, recipe: Recipe, include, exclude, layers: str | None, num_layers: int | None,
           problem: Callable, seen_elsewhere: Callable[[str], list[str]], caller: str) -> Selection:
    """The GEMMs ``recipe`` runs on, or a one-line ValueError (``caller`` names the API)."""
    includes, excludes = patterns(include), patterns(exclude)
    for which, rules in (("include", includes), ("exclude", excludes)):
        for rule in rules:
            if not any(re.search(rule, text) for _, text, _, _ in gemms):
                others = seen_elsewhere(rule)
                seen = (f"it matches only modules that hold no GEMM {caller} can swap: {', '.join(others[:4])}"
                        if others else f"the model's GEMMs are {', '.join(t for _, t, _, _ in gemms[:4]) or 'none'}"
                        + (", ..." if len(gemms) > 4 else ""))
                raise ValueError(f"{caller}: {which} rule {rule!r} matches no GEMM; {seen}")
    for rule in includes:
        matched = [(text, module, kind) for _, text, module, kind in gemms if re.search(rule, text)]
        if all(NEVER.search(text) for text, _, _ in matched):
            what = ", ".join(f"{t} ({k}{': ' + p if (p := problem(m, k)) else ''})" for t, m, k in matched[:4])
            raise ValueError(f"{caller}: include rule {rule!r} matches only the embedding or LM head ({what}), "
                             "which are never quantized")
    container = find_container(gemms, layers)
    if num_layers is None:
        num_layers = container.num_layers if container is not None else 0
    needs_layers = recipe.first_bf16_layers or recipe.last_bf16_layers or recipe.bf16_layers
    if container is None and needs_layers and recipe.quantized:
        raise ValueError(f"layer policy {recipe.policy} needs the model's layers, but {caller} found no "
                         f"layer container among {len(gemms)} GEMMs: name it with layers=, or use "
                         "policy='F0L0'")
    if recipe.first_bf16_layers + recipe.last_bf16_layers > num_layers and recipe.quantized:
        raise ValueError(f"layer policy {recipe.policy} keeps more layers in BF16 than the model has "
                         f"({num_layers})")
    beyond = [i for i in recipe.bf16_layers if i >= num_layers]
    if beyond and recipe.quantized:
        raise ValueError(f"bf16_layers {beyond} are not layers of this model (it has {num_layers})")

    chosen, left, problems = [], [], []
    for _, path, module, kind in gemms:
        default = container is None or path in container.index or path in container.members
        selected = any(re.search(p, path) for p in includes) if includes else default
        if any(re.search(p, path) for p in excludes) or NEVER.search(path) or not selected:
            left.append((path, module, kind))
        elif bad := problem(module, kind):
            problems.append(f"{path}: {bad}")
        else:
            stacked = container is not None and container.stacked and path in container.members
            layer = container.index.get(path) if container is not None else None
            chosen.append((path, module, kind, layer, stacked))
    if problems:
        raise ValueError(f"{caller} cannot quantize {len(problems)} selected GEMMs (exclude them): "
                         + "; ".join(problems))
    if not chosen:
        seen = ", ".join(f"{t} ({k})" for _, t, _, k in gemms[:6]) + (", ..." if len(gemms) > 6 else "")
        rules = "".join(f", {name}={r[0] if len(r) == 1 else r}" for name, r in (("include", includes),
                                                                                  ("exclude", excludes)) if r)
        raise ValueError(f"{caller} selected no GEMM to run {recipe.name}: saw {len(gemms)} GEMMs"
                         f"{' (' + seen + ')' if gemms else ''}{rules}; the embedding and the LM head are "
                         "never selected")
    return Selection(container, num_layers, chosen, left)
