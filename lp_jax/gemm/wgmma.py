"""The "wgmma" backend: FP8 block scaling's GEMMs on Hopper, through the Pallas Mosaic GPU
kernel ``lp_jax.kernels.fp8_block_gemm`` (WGMMA per 128-wide K block, scaled and summed in
FP32: DeepGEMM's method). The operands are laid out as for cuDNN's block-scaled GEMM
(``lp_jax.gemm.cudnn.block_operand``: contraction last, one FP32 scale per row per K block);
the result is FP32, cast once to out_dtype, as the reference's. Off the GPU the kernel runs in
Pallas's GPU interpreter, which is how it is tested against the reference.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from lp_jax.kernels.cuda_target import cuda_major
from lp_jax.gemm.cudnn import block_operand
from lp_jax.gemm.wgmma_partitioning import partitioned
from lp_jax.kernels.fp8_block_gemm import SCOPE, fp8_block_gemm
from lp_jax.kernels.launch import interpret_params

# The compiled kernel, split over a mesh by XLA (``wgmma_partitioning``). Pallas's GPU
# interpreter cannot run inside a custom partitioning (its callbacks are ordered effects),
# so interpreted (off the GPU, for tests) the kernel is called as it is.
_COMPILED_GEMM = partitioned(lambda a, sa, b, sb: fp8_block_gemm(a, sa, b, sb, interpret=False))


def scaled_dot(a, b, contracting, compute_dtype, out_dtype):
    """a x b over ``contracting`` (FP8 block-scaled operands), FP32 accumulation, in out_dtype."""
    if cuda_major() not in (None, 9):
        raise ValueError(f"backend 'wgmma' is Hopper's (sm_90) FP8 GEMM; this program is for "
                         f"sm_{cuda_major()}x, where backend 'cudnn' (or 'auto') runs FP8 block scaling")
    (ca,), (cb,) = contracting
    ad, a_scales, _ = block_operand(a, ca)
    bd, b_scales, _ = block_operand(b, cb)
    if a_scales.dtype != jnp.float32 or b_scales.dtype != jnp.float32:
        raise ValueError("the wgmma backend multiplies FP8 block scaling's operands (FP8, FP32 "
                         f"scales), got scales {a_scales.dtype} and {b_scales.dtype}")
    # The bytes stay as quantized: nothing may fold their convert into a wider GEMM.
    ad, bd, a_scales, b_scales = lax.optimization_barrier((ad, bd, a_scales, b_scales))
    gemm = fp8_block_gemm if interpret_params(None) is not None else _COMPILED_GEMM
    with jax.named_scope(SCOPE):  # in the partitioned op's HLO op_name (the plan finds it by it)
        out = gemm(ad, a_scales, bd, b_scales)
    return out.astype(out_dtype)
