"""``precision.options``: any field of the recipe, typed by that field.

The section's keys are the recipe's own field names, so which keys exist depends on the
recipe the run names; they are checked when the run is validated (get_recipe refuses a
field its recipe lacks), not when the YAML is read. Each value is read as its field's type
(``precision.options.bf16_layers=[0, 3]`` a tuple of ints) with the usual one-line error
naming the full key.
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any

from lp_jax.config.schema import PrecisionConfig
from lp_jax.config.yaml_io import coerce
from lp_jax.errors import UserError, one_line
from lp_jax.recipes import RECIPES, get_recipe


def split_overrides(p: PrecisionConfig, key: str = "precision") -> tuple[dict, dict]:
    """(the get_recipe keywords of the section's own keys that ``options`` leaves alone,
    ``options`` typed by the recipe's fields). UserError when a key and an option set one
    field to two values."""
    options = typed_options(p, key)
    own = p.field_overrides()
    defaults = {f.name: f.default for f in dataclasses.fields(p)}
    for name, value in options.items():
        if name in own and own[name] != defaults.get(name) and own[name] != value:
            raise UserError(f"{key}.options.{name}={value!r} and {key}.{name}={own[name]!r} "
                            f"disagree; set one of them")
    return {k: v for k, v in own.items() if k not in options}, options


def typed_options(p: PrecisionConfig, key: str = "precision") -> dict[str, Any]:
    """``p.options`` with each value read as its recipe field's type; names the recipe does
    not have stay as written, for get_recipe to refuse."""
    if p.recipe not in RECIPES:  # no fields to read the values as: get_recipe's one line
        try:
            get_recipe(p.recipe)
        except ValueError as e:
            raise UserError(f"{key}: {one_line(e)}") from None
    hints = _init_field_types(RECIPES[p.recipe])
    return {name: coerce(hints[name], value, f"{key}.options.{name}") if name in hints else value
            for name, value in p.options.items()}


@functools.cache
def _init_field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}
