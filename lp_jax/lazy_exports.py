"""A package's public names, loaded on first use (PEP 562).

A package ``__init__`` that re-exports its API would otherwise import everything beneath
it, JAX included, whenever any of its submodules is imported: a command's argument parser
(``eval.py --help``), ``lp_jax.errors``. With ``lazy_exports`` the names resolve when first
read, and the package's ``TYPE_CHECKING`` block gives type checkers the same names.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, homes: dict[str, tuple[str, ...]],
                 namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """(``__getattr__``, ``__dir__``, ``__all__``) for ``package``, whose names live in the
    modules ``homes`` maps to them; ``namespace`` is the package's ``globals()`` (a name, once
    read, is stored there)."""
    home_of = {name: module for module, names in homes.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in home_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home_of[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(home_of))

    return __getattr__, __dir__, sorted(home_of)
