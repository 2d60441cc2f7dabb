"""IEEE float32 division in the code XLA compiles for NVIDIA GPUs.

XLA lowers a float32 division for NVIDIA GPUs as ``div.full.f32`` (up to 2 ulp from the
IEEE quotient) and a reciprocal as ``rcp.approx.f32``: it hands LLVM
``-nvptx-prec-divf32=1``. The quantizers' scales are quotients (FP8-CS's ``448 / amax``,
NVFP4's ``2688 / amax`` and ``1 / (s_b * S_dec)``, the reciprocals of the scales), and one
that differs in its last bit moves the codes of elements near a rounding boundary, so the
contract's bits (docs/numerics.md) need the IEEE quotient, which XLA on CPU computes.
``-nvptx-prec-divf32=2`` makes XLA emit ``div.rn.f32`` / ``rcp.rn.f32``; it goes in through
``XLA_FLAGS``, which JAX reads once, when its first backend starts, so importing lp_jax
adds it there (``request``) unless a backend has started already (then ``request`` says
so). Mosaic GPU's kernels (the Pallas quantizers) are compiled by their own pipeline and
are not covered (docs/numerics.md, "Platform notes").
"""
from __future__ import annotations

import os
import sys

OPTION = "-nvptx-prec-divf32"
IEEE = f"{OPTION}=2"
_EXTRA = "--xla_backend_extra_options="


def with_ieee_division(flags: str) -> str:
    """``XLA_FLAGS`` with IEEE division asked for: put first in an existing
    ``--xla_backend_extra_options`` list, or added as a flag of its own; the rest of the
    string is kept as it is. A division precision the flags already name is left alone."""
    if OPTION in flags:
        return flags
    at = flags.find(_EXTRA)
    if at >= 0:
        value = at + len(_EXTRA)
        rest = flags[value:]
        return flags[:value] + IEEE + ("," if rest[:1] not in ("", " ") else "") + rest
    return f"{flags} {_EXTRA}{IEEE}".strip()


def backends_started() -> bool:
    """Whether JAX has started a backend in this process (XLA_FLAGS is read then)."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bridge is not None and bridge.backends_are_initialized()


def request(environ=os.environ) -> bool:
    """Ask for IEEE division in XLA's GPU code; True if it is (or was already) in
    ``XLA_FLAGS`` before any backend started, False if JAX started first."""
    flags = environ.get("XLA_FLAGS", "")
    wanted = with_ieee_division(flags)
    if wanted == flags:
        return True
    if backends_started():
        return False
    environ["XLA_FLAGS"] = wanted
    return True


def request_or_warn() -> None:
    """``request``, with a warning where JAX already runs a GPU without IEEE division."""
    if request():
        return
    import warnings

    import jax

    if any(d.platform == "gpu" for d in jax.devices()):
        warnings.warn(f"JAX started before lp_jax was imported, without {_EXTRA}{IEEE} in XLA_FLAGS: "
                      "XLA divides approximately on this GPU, so quantization scales may differ from "
                      "the contract in their last bit. Import lp_jax first, or set that flag.",
                      stacklevel=3)
