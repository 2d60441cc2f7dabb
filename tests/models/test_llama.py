"""The NNX Llama: causality, the document mask, scan == unrolled, graphdef grouping, remat."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lp_jax.context import rng_scope, site_key
from models import llama

CFG = llama.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                        num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10_000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 4.0,
                                      "original_max_position_embeddings": 16},
                        dtype=jnp.float32, max_seq_len=64)


@dataclasses.dataclass(frozen=True)
class TaggedDot:
    """A hashable dot_general that computes what lax.dot_general does; only its tag differs."""
    tag: str

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                 out_sharding=None):
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type)


@dataclasses.dataclass(frozen=True)
class NoisyDot:
    """Adds noise drawn from lp_jax's per-layer site key, as stochastic rounding would."""

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                 out_sharding=None):
        y = jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                preferred_element_type=preferred_element_type)
        # One scalar per call site keeps the compiled graph small; it still shows which bits
        # each layer drew.
        return y + jax.random.normal(site_key(), (), y.dtype)


def _swap(model, rule, make_dot):
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Linear) and rule("/".join(map(str, path))):
            node.dot_general = make_dot()


def _tokens(shape, seed=0, vocab=CFG.vocab_size):
    return jax.random.randint(jax.random.key(seed), shape, 0, vocab, dtype=jnp.int32)


@nnx.jit
def _forward(m, tokens, positions=None, segment_ids=None):
    return m(tokens, positions, segment_ids)


def _run(model, *args):
    return np.asarray(_forward(model, *args), np.float32)


def _with(model, **overrides):
    """The same parameters under another config (scan/remat/...), sharing the Params."""
    graphdef, state = nnx.split(model)
    clone = nnx.merge(graphdef, state)
    clone.config = model.config.replace(**overrides)
    return clone


@pytest.fixture(scope="module")
def model():
    return llama.Llama(CFG, rngs=nnx.Rngs(0))


def test_logits_shape_dtype_and_default_positions():
    cfg = llama.preset("tiny", num_layers=2)
    m = llama.Llama(cfg, rngs=nnx.Rngs(1))
    tokens = _tokens((2, 8), vocab=cfg.vocab_size)
    out = _forward(m, tokens)
    assert out.shape == (2, 8, cfg.vocab_size) and out.dtype == jnp.bfloat16
    out = np.asarray(out, np.float32)
    np.testing.assert_array_equal(out, _run(m, tokens, jnp.broadcast_to(jnp.arange(8), (2, 8))))
    assert not np.allclose(out, _run(m, tokens, jnp.broadcast_to(jnp.arange(8) + 5, (2, 8))))


def test_causality(model):
    """Changing token t changes no logit before t, and does change logits at t."""
    tokens = _tokens((1, 12))
    base = _run(model, tokens)
    for t in (0, 5, 11):
        changed = _run(model, tokens.at[0, t].set((tokens[0, t] + 1) % CFG.vocab_size))
        np.testing.assert_allclose(changed[:, :t], base[:, :t], atol=1e-6)
        assert np.abs(changed[:, t] - base[:, t]).max() > 1e-3


def test_document_mask_equals_separate_documents(model):
    doc_a, doc_b = _tokens((1, 5), seed=1), _tokens((1, 7), seed=2)
    packed = jnp.concatenate([doc_a, doc_b], axis=1)
    segment_ids = jnp.array([[0] * 5 + [1] * 7])
    positions = jnp.array([list(range(5)) + list(range(7))])
    out = _run(model, packed, positions, segment_ids)
    np.testing.assert_allclose(out[:, :5], _run(model, doc_a), atol=2e-5)
    np.testing.assert_allclose(out[:, 5:], _run(model, doc_b), atol=2e-5)
    # Control: with positions reset but no document mask, doc b sees doc a.
    leaky = _run(model, packed, positions)
    assert np.abs(leaky[:, 5:] - out[:, 5:]).max() > 1e-3


def test_tied_embeddings_use_the_table_as_head():
    cfg = CFG.replace(tie_embeddings=True, num_layers=1)
    m = llama.Llama(cfg, rngs=nnx.Rngs(0))
    assert not hasattr(m, "lm_head")
    tokens = _tokens((1, 4))
    x = m.final_norm(m.layers[0](m.embed(tokens), llama.rope_tables(jnp.arange(4)[None], cfg),
                                 llama.causal_document_mask(None, 1, 4)))
    np.testing.assert_allclose(np.asarray(m(tokens)), np.asarray(x @ m.embed.embedding[...].T), atol=1e-5)


@pytest.mark.slow
def test_scan_and_remat_equal_unrolled_forward_and_grad(model):
    tokens = _tokens((2, 10), seed=3)
    segment_ids = jnp.array([[0] * 4 + [1] * 6, [0] * 10])

    def loss(m):
        return jnp.mean(m(tokens, segment_ids=segment_ids) ** 2)

    # Each setting compiles once (a few seconds each on 2 cores): the reference, scan alone,
    # and each remat policy once, in the mode that makes it least like the reference.
    settings = [(False, "none"), (True, "none"), (True, "dots_saveable"), (False, "full"),
                (True, "dots_with_no_batch_dims_saveable"), (True, "megatron"), (False, "elementwise")]
    results = []
    for scan, remat in settings:
        value, grads = nnx.jit(nnx.value_and_grad(loss))(_with(model, scan_layers=scan, remat=remat))
        results.append((value, jax.tree.leaves(grads)))
    ref_value, ref_grads = results[0]
    assert len(ref_grads) == 1 + 4 * 9 + 1 + 1  # every parameter got a gradient
    for (scan, remat), (value, grads) in zip(settings[1:], results[1:]):
        np.testing.assert_allclose(value, ref_value, rtol=1e-6, err_msg=f"{scan} {remat}")
        for g, ref in zip(grads, ref_grads):
            np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-7, err_msg=f"{scan} {remat}")


def test_graphdef_equality_follows_dot_general():
    m = llama.Llama(CFG, rngs=nnx.Rngs(0))
    graphdefs = [nnx.split(layer)[0] for layer in m.layers]
    assert all(g == graphdefs[0] for g in graphdefs) and hash(graphdefs[0]) == hash(graphdefs[3])
    assert llama.layer_groups(graphdefs) == [(0, 4)]
    # Layer 2 gets one dot_general, layer 3 an equal-valued new instance, then layer 3 another tag.
    _swap(m, lambda p: p.startswith(("layers/2/", "layers/3/")), lambda: TaggedDot("a"))
    graphdefs = [nnx.split(layer)[0] for layer in m.layers]
    assert graphdefs[2] == graphdefs[3]  # equal frozen dataclasses -> equal graphdefs
    assert graphdefs[1] != graphdefs[2]
    assert llama.layer_groups(graphdefs) == [(0, 2), (2, 4)]
    _swap(m, lambda p: p.startswith("layers/3/attn/q_proj"), lambda: TaggedDot("b"))
    graphdefs = [nnx.split(layer)[0] for layer in m.layers]
    assert graphdefs[2] != graphdefs[3]
    assert llama.layer_groups(graphdefs) == [(0, 2), (2, 3), (3, 4)]


def test_scan_splits_at_precision_changes_and_layer_bits_agree():
    """Per-layer random bits (lp_jax.context.site_key) are the same scanned and unrolled, and
    the scan splits where the dot_general changes (here: last layer kept plain, as FiLj does)."""
    base = llama.Llama(CFG, rngs=nnx.Rngs(0))
    tokens = _tokens((1, 8), seed=4)
    _swap(base, lambda p: not p.startswith("layers/3/") and "lm_head" not in p, NoisyDot)

    @nnx.jit
    def run(m, key):
        with rng_scope(key):
            return m(tokens)

    unrolled = np.asarray(run(_with(base, scan_layers=False), jax.random.key(7)))
    other_key = np.asarray(run(_with(base, scan_layers=False), jax.random.key(8)))
    # remat re-runs the layer body in the backward; the forward must still draw the same bits
    scanned = np.asarray(run(_with(base, scan_layers=True, remat="full"), jax.random.key(7)))
    assert np.abs(unrolled - other_key).max() > 1e-3  # the noise is really there
    np.testing.assert_allclose(scanned, unrolled, atol=1e-5)
    groups = llama.layer_groups([nnx.split(layer)[0] for layer in base.layers])
    assert groups == [(0, 3), (3, 4)]
    # If every layer drew the same bits the result would differ: check the layers differ.
    with rng_scope(jax.random.key(7)):
        from models.layer_scope import layer_scope
        with layer_scope(jnp.int32(0)):
            k0 = jax.random.key_data(site_key())
        with layer_scope(1):
            k1 = jax.random.key_data(site_key())
    assert not np.array_equal(k0, k1)


def test_dot_product_attention_path_matches_einsum_core():
    """attention_impl="cudnn" goes through jax.nn.dot_product_attention; its layout, GQA and
    document mask are checked here with that function's XLA implementation (no GPU on CI)."""
    from models.layers import attention_core, attention_dpa
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 9, 4, 8))
    k, v = (jax.random.normal(kk, (2, 9, 2, 8)) for kk in keys[1:])
    segment_ids = jnp.array([[0] * 4 + [1] * 5, [3] * 9])

    @jax.jit
    def both(segment_ids):
        core = attention_core(q, k, v, llama.causal_document_mask(segment_ids, 2, 9))
        return attention_dpa(q, k, v, segment_ids, "xla"), core

    for seg in (segment_ids, None):
        dpa, core = both(seg)
        np.testing.assert_allclose(dpa, core, atol=1e-5)
