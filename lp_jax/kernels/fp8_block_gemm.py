"""FP8 block-scaled GEMM for Hopper as a Pallas Mosaic GPU kernel (DeepSeek DeepGEMM's method).

Hopper's tensor cores multiply FP8 with one scale for the whole product (WGMMA has no block
scales), so a GEMM whose operands carry one FP32 scale per 128 elements of K is computed
K block by K block: per output tile, WGMMA multiplies the FP8 bytes of one 128-wide K block
into a fresh FP32 accumulator, and that partial product, times the row's scale of A and the
column's scale of B for that block, is added to the tile's FP32 sum in registers. Every
product of two FP8 values (E4M3, or E5M2 for HYBRID's gradients: WGMMA takes the two types
mixed) is exact in FP32 and the scales are powers of two, so the result is the reference's
(dequantize, then an FP32 dot) up to FP32 summation order, wherever the results are normal
FP32 numbers. 2^-127, the least scale the recipe makes, is an FP32
subnormal, which XLA:CPU (the interpreter) flushes to zero and a GPU might: the kernel is
given every scale doubled (2^-126 to 2^120, normal numbers, made from the exponent field)
and quarters the sum once at the end, ``(partial x 2 s_a) x 2 s_b / 4``: exact where
partial x 2 s_a and the result are normal (a K block's partial x s_a below 2^-127, which
needs a cancelling block times the least scales, is flushed on CPU).

Operands come with their contraction last, as cuDNN's block-scaled GEMM takes them: a [M, K]
and b [N, K] FP8, scales [M, K/128] and [N, K/128] FP32, one per row and K block (a 128x128
weight tile's scale repeated over its rows). Shapes need not be multiples of the tile: rows
and K are zero-padded (scale 1) and the result sliced.

One warpgroup per CTA, a BM x BN output tile, a TMA pipeline over the K blocks
(``plgpu.emit_pipeline``, STAGES buffers in flight). The tile's SMEM (STAGES x (BM + BN) x 128
bytes of operands plus its FP32 output tile) leaves room for two CTAs per SM, so one CTA's
FP32 scaling overlaps another's WGMMA, the overlap DeepGEMM gets from its two consumer
warpgroups.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lp_jax.kernels.launch import interpret_params
from lp_jax.kernels.tiles import round_up
from lp_jax.numerics import formats as F

K_BLOCK = 128  # FP8 block scaling's block: one scale per row per 128 elements of K
_FP8 = (jnp.dtype(F.E4M3), jnp.dtype(F.E5M2))
TILE_M = 64  # one warpgroup's WGMMA rows
TILE_N = 128
STAGES = 2  # K blocks in flight (TMA loads ahead of the WGMMA)
SCOPE = "lp_jax_fp8_block_gemm"  # the kernel's name scope, in its HLO op_name
# 128-byte swizzle: an E4M3 row of a K block is 128 bytes; the FP32 output tile is stored
# 32 columns (128 bytes) per swizzled row.
_OPERAND_TRANSFORMS = (plgpu.TilingTransform((8, K_BLOCK)), plgpu.SwizzleTransform(128))
_OUT_TRANSFORMS = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))


def _padded(data, scales, rows_multiple: int):
    """data [rows, K] and scales [rows, K/128] padded to whole tiles: zero bytes, scale 1."""
    rows, k = data.shape
    rp, kp = round_up(rows, rows_multiple), round_up(k, K_BLOCK)
    data = jnp.pad(data, ((0, rp - rows), (0, kp - k)))
    scales = jnp.pad(scales, ((0, rp - rows), (0, kp // K_BLOCK - scales.shape[1])), constant_values=1.0)
    return data, scales


def fp8_block_gemm(a, a_scales, b, b_scales, *, interpret: bool | None = None):
    """sum over K blocks of (a_blk @ b_blk^T) x a_scale x b_scale, [M, N] FP32.
    The scales are FP8 block scaling's: powers of two from 2^-127 to 2^120.

    a [M, K], b [N, K]: E4M3 or E5M2; a_scales [M, ceil(K/128)], b_scales [N, ceil(K/128)]: FP32.
    ``interpret``: as ``lp_jax.kernels.launch.interpret_params`` (None: compiled on a GPU or
    inside ``compiled_kernels``, Pallas's GPU interpreter elsewhere)."""
    if a.dtype not in _FP8 or b.dtype not in _FP8:
        raise ValueError(f"the FP8 block GEMM multiplies E4M3 or E5M2 operands, got {a.dtype} and {b.dtype}")
    (m, k), (n, k2) = a.shape, b.shape
    kb = -(-k // K_BLOCK)
    if k2 != k or a_scales.shape != (m, kb) or b_scales.shape != (n, kb):
        raise ValueError(f"FP8 block GEMM operands a {a.shape} (scales {a_scales.shape}) and b {b.shape} "
                         f"(scales {b_scales.shape}) need a common K and one scale per row per {K_BLOCK}")
    a, a_scales = _padded(a, a_scales.astype(jnp.float32), TILE_M)
    b, b_scales = _padded(b, b_scales.astype(jnp.float32), TILE_N)
    with jax.named_scope(SCOPE):  # how the plan finds this GEMM among Mosaic GPU kernels
        out = _kernel(a.shape[0], b.shape[0], a.shape[1], interpret_params(interpret))(
            a, _doubled(a_scales).T, b, _doubled(b_scales).T)
    return out[:m, :n]


def called_by(instruction_text: str) -> bool:
    """Whether an instruction of a compiled module (its HLO text) runs this kernel: a Mosaic
    GPU custom call under SCOPE (the plan and the benches count these as FP8 GEMMs)."""
    return 'custom_call_target="mosaic_gpu' in instruction_text and SCOPE in instruction_text


def _doubled(scales):
    """2 x each power-of-two scale, from its exponent field (2^-127's field is 0: 2^-126),
    with no arithmetic on a subnormal."""
    field = (F.f32_bits(scales) >> 23) & 0xFF
    return lax.bitcast_convert_type((field + 1) << 23, jnp.float32)


def _kernel(m: int, n: int, k: int, interpret):
    """The kernel for padded shapes: a [m, k], scales^T [k/128, m], b [n, k], scales^T [k/128, n]."""

    def k_step(_, a_tile, a_scale, b_tile, b_scale, total):
        def mma(acc):
            plgpu.wgmma(acc, a_tile, b_tile.T)  # b's K-major tile: FP8 WGMMA takes both K-major
            return acc[...]  # waits for the WGMMA

        partial = pl.run_scoped(mma, plgpu.ACC((TILE_M, TILE_N), jnp.float32))
        s_a = plgpu.load(a_scale.at[0], layout=plgpu.Layout.WGMMA.reduce(1))
        s_b = plgpu.load(b_scale.at[0], layout=plgpu.Layout.WGMMA.reduce(0))
        rows, cols = (lax.broadcast_in_dim(s, (TILE_M, TILE_N), (d,)) for s, d in ((s_a, 0), (s_b, 1)))
        return total + partial * rows * cols

    def body(a_g, a_scale_g, b_g, b_scale_g, out_g, out_s):
        rows = pl.ds(lax.axis_index("i") * TILE_M, TILE_M)
        cols = pl.ds(lax.axis_index("j") * TILE_N, TILE_N)
        zeros = plgpu.layout_cast(jnp.zeros((TILE_M, TILE_N), jnp.float32), plgpu.Layout.WGMMA)
        pipeline = plgpu.emit_pipeline(
            k_step, grid=(k // K_BLOCK,), max_concurrent_steps=STAGES, init_carry=zeros,
            in_specs=[plgpu.BlockSpec((TILE_M, K_BLOCK), lambda kk: (0, kk), transforms=_OPERAND_TRANSFORMS),
                      plgpu.BlockSpec((1, TILE_M), lambda kk: (kk, 0)),
                      plgpu.BlockSpec((TILE_N, K_BLOCK), lambda kk: (0, kk), transforms=_OPERAND_TRANSFORMS),
                      plgpu.BlockSpec((1, TILE_N), lambda kk: (kk, 0))])
        total = pipeline(a_g.at[rows], a_scale_g.at[:, rows], b_g.at[cols], b_scale_g.at[:, cols])
        out_s[...] = total * 0.25  # the doubled scales' 2 x 2
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_s, out_g.at[rows, cols])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((m, n), jnp.float32),
                        scratch_types=[plgpu.SMEM((TILE_M, TILE_N), jnp.float32, transforms=_OUT_TRANSFORMS)],
                        grid=(m // TILE_M, n // TILE_N), grid_names=("i", "j"), interpret=interpret)
