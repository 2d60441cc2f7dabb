"""The registry of formats: one ``Format`` object per public format name.

Every per-format choice in lp_jax asks the object (``format_named(fmt)``), never compares
the name (``tests/numerics/test_format_registry.py`` fails on such a comparison outside
the format modules). NVFP4's 4/6 block scales are a variant of NVFP4
(``NVFP4_FORMAT.variant("4over6")``), chosen by ``lp.quantize``'s ``block_scale_search``.
"""
from __future__ import annotations

from lp_jax.numerics.format import Format, FormatVariant
from lp_jax.numerics.fp8_block import FP8_BLOCK_E5M2_FORMAT, FP8_BLOCK_FORMAT
from lp_jax.numerics.fp8_per_tensor import FP8_E4M3, FP8_E5M2
from lp_jax.numerics.mxfp8 import MXFP8_FORMAT
from lp_jax.numerics.nvfp4 import FOUR_OVER_SIX, NVFP4_FORMAT

__all__ = ["FOUR_OVER_SIX", "NAMES", "REGISTRY", "Format", "FormatVariant", "format_named", "names_where"]

# In the order lp.FORMATS lists them.
REGISTRY: dict[str, Format] = {f.name: f for f in (
    FP8_E4M3, FP8_E5M2, MXFP8_FORMAT, NVFP4_FORMAT, FP8_BLOCK_FORMAT, FP8_BLOCK_E5M2_FORMAT)}
NAMES: tuple[str, ...] = tuple(REGISTRY)


def format_named(name: str) -> Format:
    """The format object of a public name; one line (ValueError) listing the names for another."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"fmt={name!r} is not a known format; expected one of {NAMES}") from None


def names_where(has) -> tuple[str, ...]:
    """The names of the formats for which ``has(format)`` is true, in registry order (for
    messages and the vocabularies other layers check against)."""
    return tuple(name for name, f in REGISTRY.items() if has(f))
