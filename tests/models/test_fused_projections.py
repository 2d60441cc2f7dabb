"""Fused projections (models.fused_projections): Megatron's qkv and gate/up layouts, exact
conversions, the same BF16 forward as the separate Linears, and in FP8 current scaling one
set of scales for the fused tensor."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.nnx import traversals

import lp_jax as lp
from models import fused_projections as fp
from models import llama

CFG = llama.preset("tiny", num_layers=1)


def _fused_copy(model):
    """A fused model holding ``model``'s weights, joined."""
    cfg = model.config.replace(fused_projections=True)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: llama.Llama(cfg, rngs=nnx.Rngs(1))))
    flat = {p: v[...] for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    nnx.replace_by_pure_dict(state, traversals.unflatten_mapping(fp.fuse_flat(flat, cfg)))
    return nnx.merge(graphdef, state)


def test_layouts_are_megatrons():
    """qkv: per KV group [its G query heads, k_g, v_g] (linear_qkv's view [ng, (np/ng + 2) hn]);
    gate_up: [gate; up] (linear_fc1's two chunks). Values name where they came from."""
    n, k, h = 4, 2, 2
    q = np.arange(n * h).reshape(1, n * h) + 100
    kk = np.arange(k * h).reshape(1, k * h) + 200
    v = np.arange(k * h).reshape(1, k * h) + 300
    qkv = fp.join_qkv(q, kk, v, k)
    group_0 = [100, 101, 102, 103, 200, 201, 300, 301]  # q heads 0 and 1, k_0, v_0
    group_1 = [104, 105, 106, 107, 202, 203, 302, 303]
    assert qkv.tolist() == [group_0 + group_1]
    assert [a.tolist() for a in fp.split_qkv(qkv, n, k, h)] == [q.tolist(), kk.tolist(), v.tolist()]
    gate, up = np.ones((2, 3)), np.zeros((2, 3))
    assert fp.join_gate_up(gate, up).tolist() == [[1, 1, 1, 0, 0, 0]] * 2
    # Any path prefix (the Adam moments'), either direction, and unrelated paths untouched.
    arrays = {("mu", "layers", 0, "attn", "q_proj", "kernel"): q,
              ("mu", "layers", 0, "attn", "k_proj", "kernel"): kk,
              ("mu", "layers", 0, "attn", "v_proj", "kernel"): v, ("mu", "count"): 7}
    cfg = llama.preset("tiny", num_heads=n, num_kv_heads=k, head_dim=h)
    fused = fp.fuse_flat(arrays, cfg)
    assert list(fused) == [("mu", "layers", 0, "attn", "qkv", "kernel"), ("mu", "count")]
    np.testing.assert_array_equal(fused[("mu", "layers", 0, "attn", "qkv", "kernel")], qkv)
    back = fp.separate_flat(fused, cfg)
    assert sorted(back, key=str) == sorted(arrays, key=str)
    assert all(np.array_equal(back[p], arrays[p]) for p in arrays)
    with pytest.raises(KeyError):
        fp.value_at(("mu", "layers", 1, "attn", "qkv", "kernel"), arrays, cfg)


def test_fused_model_gives_the_separate_models_bf16_forward_bit_for_bit():
    """XLA's CPU GEMM computes each output column as the same dot product whichever GEMM
    holds it, so the fused model's BF16 logits are the separate model's, bit for bit (a GPU
    library may pick another split of the contraction for the wider GEMM: equal to rounding)."""
    separate = llama.Llama(CFG, rngs=nnx.Rngs(0))
    fused = _fused_copy(separate)
    assert {"qkv", "o_proj"} == set(vars(fused.layers[0].attn)) & {"qkv", "q_proj", "o_proj"}
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, CFG.vocab_size)
    forward = nnx.jit(lambda m, t: m(t))
    a, b = forward(separate, tokens), forward(fused, tokens)
    assert a.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # The joined weights split back exactly.
    flat = {p: v[...] for p, v in nnx.to_flat_state(nnx.state(fused, nnx.Param))}
    for p, v in nnx.to_flat_state(nnx.state(separate, nnx.Param)):
        np.testing.assert_array_equal(fp.value_at(p, flat, CFG), v[...])


@pytest.mark.slow
def test_fp8_cs_fused_gemm_takes_the_fused_tensors_scale():
    """In FP8 current scaling the fused qkv GEMM is lp.dot_general on the joined weight: one
    weight scale, the fused tensor's. With k holding the largest weight, k's columns equal
    the separate k GEMM's (the same scale) and q's do not (its own amax is smaller); q's
    equal a GEMM of q's weight quantized with the fused amax (an extra column holding it)."""
    cfg = CFG
    separate = llama.Llama(cfg, rngs=nnx.Rngs(0))
    attn = separate.layers[0].attn
    attn.k_proj.kernel[...] = attn.k_proj.kernel[...] * 4.0  # k holds the fused amax
    fused = _fused_copy(separate)
    recipe = lp.get_recipe("fp8_cs", policy="F0L0")
    lp.apply_recipe(separate, recipe)
    report = lp.apply_recipe(fused, recipe)
    assert sorted(report.quantized) == ["layers/0/attn/o_proj", "layers/0/attn/qkv",
                                        "layers/0/mlp/down_proj", "layers/0/mlp/gate_up"]
    x = jax.random.normal(jax.random.key(1), (2, 8, cfg.hidden_size), jnp.bfloat16)
    dims = (((2,), (0,)), ((), ()))
    dot = lp.dot_general(recipe)
    w_qkv = fused.layers[0].attn.qkv.kernel[...]
    out = np.asarray(fused.layers[0].attn.qkv(x), np.float32)
    np.testing.assert_array_equal(out, np.asarray(dot(x, w_qkv, dims), np.float32))
    q, k, v = fp.split_qkv(out, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    np.testing.assert_array_equal(k, np.asarray(attn.k_proj(x), np.float32))
    assert not np.array_equal(q, np.asarray(attn.q_proj(x), np.float32))
    amax = jnp.max(jnp.abs(w_qkv.astype(jnp.bfloat16))).astype(jnp.float32)
    w_q = attn.q_proj.kernel[...]
    widened = jnp.concatenate([w_q, jnp.full((w_q.shape[0], 1), amax)], axis=1)
    np.testing.assert_array_equal(q, np.asarray(dot(x, widened, dims), np.float32)[..., :-1])
