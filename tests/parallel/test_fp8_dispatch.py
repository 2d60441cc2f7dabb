"""The expert-parallel dispatch in FP8 (mesh.ep_dispatch_dtype=fp8,
lp_jax/parallel/expert_dispatch.py, models/moe_dispatch.py's send_rows).

The encoding alone (in this process): MXFP8 and FP8 block rows decode to values the expert
GEMM's own quantizer gives back unchanged, DeepSeek-V3's 1x128 E4M3 rows stay within the
documented bound, the packed bytes are about half of BF16's, and the backward is
straight-through in the activation dtype. On 8 forced CPU devices (slow): one MoE layer
with expert=4 per recipe, the dispatch's bytes in the lowered and compiled programs, the
forward bit for bit (MXFP8, FP8 block) or within the bound, and the trainer's step.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import lp_jax
from lp_jax import model_registry
from lp_jax.parallel.expert_dispatch import FP8Dispatch, fp8_dispatch, set_expert_dispatch
from models.moe_dispatch import send_rows
from tests.support.forced_devices import run_python

# E4M3: 3 mantissa bits (a normal value rounds within 2^-4 of itself, relative), smallest
# subnormal 2^-9 (a value below the normals rounds within 2^-10 of the block's 1 / scale,
# which is under 2 amax / 448).
E4M3_RELATIVE = 2.0**-4
E4M3_SUBNORMAL_STEP = 2.0**-9


def _rows(shape=(64, 256), seed=0):
    """BF16 rows whose magnitudes span 2^-20 .. 2^4, so that some blocks hold values in
    E4M3's subnormal range beside their amax."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    sign = jnp.sign(jax.random.normal(k1, shape))
    return (sign * 2.0 ** jax.random.uniform(k2, shape, minval=-20, maxval=4)).astype(jnp.bfloat16)


def _round_trip(codec, x):
    return codec.decode(codec.encode(x), x.shape[-1], x.dtype)


@pytest.mark.parametrize("recipe, fmt", [("mxfp8", "mxfp8"), ("fp8_block", "fp8_block")])
def test_rows_decode_to_values_the_expert_gemm_quantizes_to_themselves(recipe, fmt):
    """Where the recipe's expert GEMM quantizes its input as the dispatch does, the rows it
    receives quantize (by that GEMM's own quantizer) to what the BF16 rows quantize to:
    the forward GEMM sees the same operand bytes either way."""
    spec = lp_jax.get_recipe(recipe).fprop_x
    codec = fp8_dispatch(lp_jax.get_recipe(recipe))
    assert codec.fmt == fmt == spec.fmt
    x = _rows()
    received = _round_trip(codec, x)
    assert received.dtype == jnp.bfloat16
    assert not np.array_equal(np.asarray(received), np.asarray(x))  # FP8 did round them
    gemm_operand = lambda t: lp_jax.quantize(t, spec.fmt, axis=-1, scale_rule=spec.scale_rule)  # noqa: E731
    sent, got = gemm_operand(x), gemm_operand(received)
    np.testing.assert_array_equal(np.asarray(lp_jax.dequantize(got)), np.asarray(lp_jax.dequantize(sent)))
    # The received rows are the values the GEMM would have used, exactly.
    np.testing.assert_array_equal(np.asarray(received, np.float32), np.asarray(lp_jax.dequantize(sent)))


def test_mxfp8_dispatch_follows_the_recipes_scale_rule():
    floor = lp_jax.get_recipe("mxfp8", scale_rule="floor")
    assert fp8_dispatch(floor) == FP8Dispatch("mxfp8", "floor", "auto")


@pytest.mark.parametrize("recipe", ["bf16", "fp8_cs", "nvfp4"])
def test_other_recipes_dispatch_deepseeks_1x128_e4m3_within_the_bound(recipe):
    """E4M3 in 1x128 blocks with FP32 power-of-two scales: each element within 2^-4 of
    itself (relative) or, below E4M3's normal range, 2^-9 amax / 448 of its block."""
    codec = fp8_dispatch(lp_jax.get_recipe(recipe))
    assert codec == FP8Dispatch("fp8_block")
    x = _rows()
    received = np.asarray(_round_trip(codec, x), np.float64)
    xf = np.asarray(x, np.float64)
    amax = np.repeat(np.abs(xf).reshape(64, 2, 128).max(-1), 128, axis=-1)
    bound = np.maximum(E4M3_RELATIVE * np.abs(xf), E4M3_SUBNORMAL_STEP * amax / 448)
    err = np.abs(received - xf)
    assert np.all(err <= bound)
    # Both parts of the bound are reached by some element (the bound is not loose).
    assert np.max(err / np.abs(xf)) > 0.9 * E4M3_RELATIVE
    assert np.any(err > E4M3_RELATIVE * np.abs(xf))


@pytest.mark.parametrize("fmt, d, packed", [("mxfp8", 128, 132), ("fp8_block", 128, 132),
                                            ("mxfp8", 2048, 2112), ("fp8_block", 2048, 2112),
                                            ("fp8_block", 200, 208)])
def test_a_row_packs_values_and_scales_in_about_half_its_bf16_bytes(fmt, d, packed):
    codec = FP8Dispatch(fmt)
    x = _rows((3, 5, d))
    encoded = codec.encode(x)
    assert encoded.dtype == jnp.uint8 and encoded.shape == (3, 5, packed) == (3, 5, codec.row_bytes(d))
    assert packed / (2 * d) <= 0.52
    np.testing.assert_array_equal(np.asarray(_round_trip(codec, x)),
                                  np.asarray(lp_jax.dequantize(lp_jax.quantize(x, fmt, axis=-1))
                                             .astype(jnp.bfloat16)))


def test_the_backward_moves_the_cotangent_as_it_comes():
    """Straight-through: the rows' cotangent passes the dispatch unchanged, in the activation
    dtype (a 1-device expert axis, where the all-to-all moves nothing)."""
    mesh = jax.make_mesh((1,), ("expert",))
    codec = FP8Dispatch("fp8_block")

    def dispatch(x):
        return jax.shard_map(lambda x: send_rows(x, "expert", codec), mesh=mesh, in_specs=P(), out_specs=P(),
                             check_vma=False)(x)

    x = _rows((1, 16, 256))
    cotangent = jax.random.normal(jax.random.key(1), x.shape, jnp.bfloat16)
    y, (dx,) = jax.jit(lambda x, ct: (lambda y, vjp: (y, vjp(ct)))(*jax.vjp(dispatch, x)))(x, cotangent)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(_round_trip(codec, x)))
    assert dx.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(cotangent))


def test_the_trainer_sets_every_moe_layer_and_back():
    cfg = model_registry.preset("moe", "tiny", num_layers=2)
    model = nnx.eval_shape(lambda: model_registry.build_model("moe", cfg, nnx.Rngs(0)))
    mxfp8 = lp_jax.get_recipe("mxfp8")
    assert set_expert_dispatch(model, mxfp8, "fp8") == ["layers/0/mlp", "layers/1/mlp"]
    moes = [n for _, n in nnx.iter_graph(model) if isinstance(n, nnx.Module) and "dispatch_codec" in vars(n)]
    assert all(m.dispatch_codec == FP8Dispatch("mxfp8", "rceil", "auto") for m in moes)
    set_expert_dispatch(model, mxfp8, "bf16")
    assert all(m.dispatch_codec is None for m in moes)
    with pytest.raises(ValueError, match=r"^ep_dispatch_dtype='e5m2' is invalid: choose one of bf16, fp8$"):
        set_expert_dispatch(model, mxfp8, "e5m2")


# ----------------------------------------------------------------- on 8 forced devices

RECIPES = ("bf16", "fp8_cs", "fp8_block", "mxfp8", "nvfp4")


@pytest.mark.slow
def test_fp8_dispatch_halves_the_bytes_and_keeps_the_forward():
    """One MoE layer with expert=4 (tests/support/fp8_dispatch_layer.py), per recipe."""
    proc = run_python(["tests/support/fp8_dispatch_layer.py", *RECIPES], timeout=1800)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    rows = {r["recipe"]: r for r in lines}
    assert set(rows) == set(RECIPES)
    for recipe, r in rows.items():
        n, d = r["dispatch_rows"], r["hidden"]
        bf16_buffer, fp8_buffer = n * d * 2, n * r["row_bytes"]
        assert fp8_buffer / bf16_buffer <= 0.52, r
        fwd, grad = r["lowered_forward"], r["lowered_grad"]
        # Forward: the dispatch's BF16 buffer becomes one packed uint8 buffer (values and
        # scales); the combine's stays BF16.
        assert fwd["fp8"]["ui8"] == fp8_buffer and "ui8" not in fwd["bf16"], r
        assert fwd["bf16"]["bf16"] - fwd["fp8"]["bf16"] == bf16_buffer, r
        # Gradient: the FP8 forward dispatch only; the dispatch's and the combine's
        # cotangents go back in BF16.
        assert grad["fp8"]["ui8"] == fp8_buffer, r
        assert grad["bf16"]["bf16"] - grad["fp8"]["bf16"] == bf16_buffer == grad["bf16"]["bf16"] / 4, r
        # XLA:CPU keeps the uint8 buffer (it moves the BF16 ones in FP32).
        assert r["compiled_forward"]["fp8"]["u8"] == r["compiled_grad"]["fp8"]["u8"] == fp8_buffer, r
        assert r["grads_finite"], r
        if recipe in ("mxfp8", "fp8_block"):
            assert r["dispatch_format"] == recipe and r["output_equal"], r
        else:
            assert r["dispatch_format"] == "fp8_block" and not r["output_equal"], r
            err = r["error_vs_bf16_gemms"]
            # The dispatch's rounding (each element within 2^-4 of itself) adds to the
            # recipe's own error as an independent one would, at most.
            assert err["fp8"] <= np.hypot(err["bf16"], E4M3_RELATIVE), r
            assert err["fp8"] > err["bf16"], r


def _losses(tmp_path, dispatch: str) -> tuple[list[float], str]:
    run_dir = tmp_path / dispatch
    proc = run_python(["train.py", "--config", "configs/tiny_moe.yaml", "steps=2", "mesh.data=2",
                       "mesh.expert=4", "model.scan_layers=true",
                       "data.micro_batch_size=1", "data.global_batch_size=8", "data.seq_len=64",
                       "data.source=mock", "logging.val_every=0", "logging.val_batches=0",
                       f"run_dir={run_dir}", f"mesh.ep_dispatch_dtype={dispatch}"], timeout=1200)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r and "step" in r], proc.stdout + proc.stderr


@pytest.mark.slow
def test_training_steps_with_the_fp8_dispatch_match_the_bf16_dispatch(tmp_path):
    """train.py, BF16 GEMMs (where the FP8 dispatch is not exact), data=2 x expert=4, the
    layers scanned (as the 30B-A3B configs run them)."""
    bf16, _ = _losses(tmp_path, "bf16")
    fp8, said = _losses(tmp_path, "fp8")
    assert "mesh.ep_dispatch_dtype=fp8: the MoE layers dispatch their rows in fp8_block" in said
    assert len(fp8) == len(bf16) == 2
    assert bf16 != fp8 and np.allclose(fp8, bf16, rtol=1e-4, atol=0), (fp8, bf16)
