"""Which GPU generation a program is traced for: the process's GPU, or, in a deviceless
compile (``python -m lp_jax.plan``), the GPU it describes. Backends that exist for one
generation only (Hopper's WGMMA) choose and check by it while tracing."""
from __future__ import annotations

import contextlib
import contextvars

import jax

_CUDA_TARGET = contextvars.ContextVar("lp_jax_cuda_target", default=None)


@contextlib.contextmanager
def cuda_target(compute_capability: tuple[int, int]):
    """Programs traced inside are for GPUs of this compute capability: what "auto" chooses
    by when the process has no GPU to ask (a deviceless compile for a described GPU)."""
    token = _CUDA_TARGET.set(tuple(compute_capability))
    try:
        yield
    finally:
        _CUDA_TARGET.reset(token)


def cuda_major() -> int | None:
    """The major compute capability programs are traced for: ``cuda_target``'s, else the
    process's first GPU's, else None (no GPU: the native backends' Blackwell-or-later form)."""
    target = _CUDA_TARGET.get()
    if target is not None:
        return target[0]
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None) if device.platform == "gpu" else None
    return int(str(capability).split(".")[0]) if capability else None
