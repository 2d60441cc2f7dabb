"""JAX's cuDNN attention asks the process's first GPU for its compute capability while it
traces (packed documents need Hopper or newer). A deviceless compile has no GPU to ask, so
while the plan traces, the answer is the described GPU's."""
from __future__ import annotations

import contextlib

from lp_jax.plan.gpus import GPU

_CHECKS = ("check_compute_capability", "is_cuda_compute_capability_equal")


@contextlib.contextmanager
def cudnn_sees(gpu: GPU):
    from jax._src.cudnn import fused_attention_stablehlo as fused

    current = tuple(gpu.compute_capability)
    parse = lambda capability: tuple(int(x) for x in capability.split("."))  # noqa: E731
    answers = {"check_compute_capability": lambda c: current >= parse(c),
               "is_cuda_compute_capability_equal": lambda c: current == parse(c)}
    saved = {name: getattr(fused, name) for name in _CHECKS}
    try:
        for name in _CHECKS:
            setattr(fused, name, answers[name])
        yield
    finally:
        for name, f in saved.items():
            setattr(fused, name, f)
