"""Which quantizer implementation runs: "xla" (lp_jax/numerics/quantize.py), "pallas"
(lp_jax/kernels, Pallas Mosaic GPU; interpreted on CPU) or "auto".

"auto" is "xla" on every platform for now: it is to pick Pallas on a GPU only where
bench/gpu_check.sh has measured the kernels faster than XLA's fusions, and no GPU has
measured them yet (docs/backends.md). Choosing by platform without a measurement would be
a guess, so "auto" does not.
"""
from __future__ import annotations

IMPLS = ("xla", "pallas", "auto")
# Platforms where the kernels were measured faster than XLA (bench/bench_kernels.py on a
# GPU): empty until a GPU run says otherwise.
MEASURED_FASTER: tuple[str, ...] = ()


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not valid; expected one of {IMPLS}")


def resolve(impl: str) -> str:
    """"xla" or "pallas" for ``impl``; "auto" is "xla" until a GPU measurement says otherwise."""
    check_impl(impl)
    if impl != "auto":
        return impl
    return "pallas" if MEASURED_FASTER else "xla"
