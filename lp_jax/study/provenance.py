"""Which code made a result: the commit of the checkout that ran it and the JAX version.

A recorded run is only worth comparing with today's code if it names the code that
trained it; ``-dirty`` marks a checkout whose tracked files had uncommitted changes (the
commit alone does not say what ran), and a copy outside git has no commit (None).
"""
from __future__ import annotations

import importlib.metadata
import pathlib
import subprocess
import sys

SOURCE_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _git(root: pathlib.Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def source_commit(root: pathlib.Path = SOURCE_ROOT) -> str | None:
    """The short hash of the checkout at ``root`` (the one lp_jax runs from), with ``-dirty``
    when tracked files differ from it; None outside a git checkout."""
    commit = _git(root, "rev-parse", "--short", "HEAD")
    if not commit:
        return None
    changed = _git(root, "status", "--porcelain", "--untracked-files=no")
    return f"{commit}-dirty" if changed else commit


def jax_version() -> str | None:
    """The JAX this process runs, if loaded; else the installed one (None without JAX)."""
    if "jax" in sys.modules:
        return sys.modules["jax"].__version__
    try:
        return importlib.metadata.version("jax")
    except importlib.metadata.PackageNotFoundError:
        return None


def current() -> dict:
    """{"commit": ..., "jax": ...} of this process."""
    return {"commit": source_commit(), "jax": jax_version()}


def describe(made_by: dict | None) -> str:
    """'commit bcee629, JAX 0.12.0.1' (a missing field says so)."""
    made_by = made_by or {}
    commit = made_by.get("commit")
    return (f"commit {commit if commit else '(none recorded)'}, "
            f"JAX {made_by.get('jax') or '(none recorded)'}")
