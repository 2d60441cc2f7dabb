"""Can a run write where its config says? A probe write, not a permission check.

``os.access`` answers from the mode bits, which root ignores and which say nothing of a
read-only mount or a full disk; creating and removing a file answers for all of them. The
probe lives with the model converters' output folders (``models.files``), which check their
targets with it too and may not import lp_jax.
"""
from __future__ import annotations

from models.files import PROBE_PREFIX, write_problem

__all__ = ["PROBE_PREFIX", "write_problem"]
