"""Which GEMM implementation runs a recipe's quantized GEMMs, chosen when the program is lowered.

"reference" (any platform: the definition, ``lp_jax.gemm.operands``), "xla_fp8" (per-tensor
FP8), "cudnn" (block formats), "xla_scaled_dot" (block formats, XLA's scaled dot: forced
only), "wgmma" (FP8 block scaling on Hopper), or "auto" (the
default): per GEMM, ``lax.platform_dependent`` picks the recipe's native backend when the
program is lowered for CUDA and "reference" for anything else; on Hopper (the process's GPU,
or the GPU a deviceless compile targets, ``cuda_target``) a recipe's own Hopper GEMM is its
native one (docs/backends.md). Every backend multiplies the same quantized values; only
the GEMM differs. A forced backend that does not fit the recipe raises when the recipe is
made (``Recipe.native_backend``); one that cannot run on the platform a program is lowered
for raises one line while lowering (``_platform_guard``). Neither ever falls back silently.
"""
from __future__ import annotations

import jax
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from lp_jax.gemm import cudnn, operands, wgmma, xla_fp8, xla_scaled_dot
from lp_jax.kernels.cuda_target import cuda_major, cuda_target  # noqa: F401  (cuda_target re-exported)
from lp_jax.recipes import BACKENDS, Recipe  # noqa: F401  (BACKENDS: the names, re-exported)

# Each backend's GEMM; the module named says what it computes.
_IMPLS = {"reference": operands.scaled_dot, "xla_fp8": xla_fp8.scaled_dot, "cudnn": cudnn.scaled_dot,
          "xla_scaled_dot": xla_scaled_dot.scaled_dot, "wgmma": wgmma.scaled_dot}
# Platforms a forced backend lowers on. cpu is where JAX executes both natively-typed paths
# (tests compare them with reference there); CUDA is what they are for. Others (ROCm, TPU)
# would need their own checks first, so they are refused rather than silently emulated.
# "wgmma" on cpu is Pallas's GPU interpreter (for tests: seconds per GEMM).
PLATFORMS = {"reference": None, "xla_fp8": ("cpu", "cuda"), "cudnn": ("cpu", "cuda"),
             "xla_scaled_dot": ("cpu", "cuda"), "wgmma": ("cpu", "cuda")}
AUTO_PLATFORM = "cuda"  # where "auto" picks the native backend; reference everywhere else
# Forced backends XLA cannot compile for CUDA on more than one device under the Shardy
# partitioner (JAX 0.12's XLA fails converting the partitioned module, "Unable to convert
# MHLO to StableHLO"); GSPMD compiles them.
SHARDY_FAILS_ON_CUDA = ("xla_scaled_dot",)


def resolved(recipe: Recipe) -> str:
    """The recipe's backend with nothing left to decide but the platform: a forced name, or
    "auto"; "reference" for recipes that quantize nothing (their GEMM is the same everywhere)."""
    return recipe.backend if recipe.native_backend else "reference"


def cuda_native(recipe: Recipe, partly_manual: bool = False) -> str | None:
    """The backend "auto" runs ``recipe``'s GEMMs on when lowered for CUDA: its Hopper GEMM on
    sm_90 (except inside a partly manual data shard_map, where its custom partitioning does
    not compile), its native backend anywhere else."""
    if recipe.hopper_backend and cuda_major() == 9 and not partly_manual:
        return recipe.hopper_backend
    return recipe.native_backend


def backend_on(recipe: Recipe, platform: str, partly_manual: bool = False) -> str:
    """The backend ``recipe``'s quantized GEMMs use in a program lowered for ``platform``
    ("cpu", "cuda", "rocm", "tpu"), inside a partly manual data shard_map if
    ``partly_manual``: what the run log and SwapReport print."""
    backend = resolved(recipe)
    if backend == "auto":
        return cuda_native(recipe, partly_manual) if platform == AUTO_PLATFORM else "reference"
    return backend


def current_platform() -> str:
    """The lowering platform name of this process's default devices: cpu, cuda, rocm, tpu."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return device.platform
    return "rocm" if "rocm" in str(getattr(device.client, "platform_version", "")).lower() else "cuda"


def gemm(backend: str, native: str | None, a, b, contracting, compute_dtype, out_dtype):
    """``a`` x ``b`` contracted over ``contracting`` by ``backend`` (a name from ``resolved``;
    ``native`` the recipe's native backend for "auto"). Operands: arrays, QuantizedTensor,
    Transposed or Pending (``lp_jax.gemm.operands``); the result is cast to out_dtype."""
    run = lambda name: lambda a, b: _IMPLS[name](a, b, contracting, compute_dtype, out_dtype)  # noqa: E731
    if backend == "auto":
        # Both branches are traced; only the one for the lowering platform is lowered.
        return lax.platform_dependent(a, b, default=run("reference"), **{AUTO_PLATFORM: run(native)})
    out = run(backend)(a, b)
    return out if PLATFORMS[backend] is None else _platform_guard(out, backend)


# --------------------------------------------------------------------- platform guard
# An identity on the GEMM's result whose lowering checks the platform: a forced backend
# lowered for a platform it does not run on fails there with one line, whether the program
# is jitted here, lowered ahead of time or for another platform. (At trace time the
# platform is not known yet: the same trace may be lowered for several.)

_guard_p = Primitive("lp_jax_backend_guard")


def _platform_guard(x, backend):
    return _guard_p.bind(x, backend=backend)


def check_platforms(backend: str, platforms) -> None:
    """Raises one line if the forced ``backend`` cannot run on one of ``platforms``."""
    bad = [p for p in platforms if PLATFORMS[backend] is not None and p not in PLATFORMS[backend]]
    if bad:
        raise ValueError(f"lp_jax GEMM backend {backend!r} cannot run on {bad[0]!r} (it runs on "
                         f"{', '.join(PLATFORMS[backend])}); use backend 'auto' or 'reference'")


def _guard_impl(x, *, backend):
    check_platforms(backend, (current_platform(),))  # eager (un-jitted) call on this process's devices
    return x


_guard_p.def_impl(_guard_impl)
_guard_p.def_abstract_eval(lambda aval, **_: aval)


def check_partitioner(backend: str, platforms, devices: int, shardy: bool) -> None:
    """Raises one line where XLA cannot compile ``backend`` (``SHARDY_FAILS_ON_CUDA``)."""
    if backend in SHARDY_FAILS_ON_CUDA and "cuda" in platforms and devices > 1 and shardy:
        raise ValueError(f"lp_jax GEMM backend {backend!r} does not compile for CUDA on more than one "
                         "device under the Shardy partitioner (an XLA limitation); set "
                         "JAX_USE_SHARDY_PARTITIONER=false to partition with GSPMD, or use backend 'auto'")


def _module_devices(module_context) -> int:
    """How many devices the module being lowered is partitioned over (1 if unknown)."""
    axis_context = module_context.axis_context
    if hasattr(axis_context, "num_devices"):
        return axis_context.num_devices
    mesh = getattr(axis_context, "mesh", None)
    return mesh.size if mesh is not None else 1


def _guard_lowering(ctx, x, *, backend):
    platforms = ctx.platforms or ctx.module_context.platforms
    check_platforms(backend, platforms)
    check_partitioner(backend, platforms, _module_devices(ctx.module_context),
                      jax.config.jax_use_shardy_partitioner)
    return [x]


mlir.register_lowering(_guard_p, _guard_lowering)
batching.primitive_batchers[_guard_p] = lambda args, dims, **kw: (_guard_p.bind(*args, **kw), dims[0])
