"""The Llama 3 decoder in Flax NNX.

    from models import llama
    cfg = llama.preset("tiny")
    model = llama.Llama(cfg, rngs=nnx.Rngs(0))
    logits_BxLxV = model(tokens_BxL, positions=None, segment_ids=None)

Module paths are a contract with lp_jax's precision swapper, which picks Linears by path and
reads the layer index right after `layers`: `embed`, `layers/<i>/{attn_norm, attn/{q,k,v,o}_proj,
mlp_norm, mlp/{gate,up,down}_proj}`, `final_norm`, `lm_head` (absent when tied); with
`fused_projections`, `attn/qkv` and `mlp/gate_up` stand for q/k/v and gate/up. Layers are
stored unrolled whatever `scan_layers` says; with it, runs of equal layers are scanned
(docs/models.md, "Scanned layers and remat").
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import (  # noqa: F401  (re-exported: `llama.LlamaConfig`, `llama.preset`, ...)
    ATTENTION_IMPLS,
    LAYER_BODY_REMATS,
    MEGATRON_SAVED,
    PRESETS,
    RECOMPUTED_ELEMENTWISE,
    REMAT_POLICIES,
    Llama3RopeScaling,
    LlamaConfig,
    config_from_dict,
    config_to_dict,
    count_params,
    flops_per_token,
    matmul_params,
    output_init_std,
    preset,
)
from models.embedding_lookup import embedding_lookup
from models.layer_scope import layer_scope
from models.layers import BLD, Block, RMSNorm, rope_tables
from models.sharding import constrain

__all__ = ["ATTENTION_IMPLS", "PRESETS", "REMAT_POLICIES", "Llama", "Llama3RopeScaling",
           "LlamaConfig", "causal_document_mask", "config_from_dict", "config_to_dict",
           "count_params", "flops_per_token", "layer_groups", "matmul_params", "output_init_std",
           "preset", "rope_tables"]


def _remat_policy(name: str):
    policies = jax.checkpoint_policies
    return {"full": None, "dots_saveable": policies.dots_saveable,
            "dots_with_no_batch_dims_saveable": policies.dots_with_no_batch_dims_saveable,
            "megatron": policies.save_only_these_names(*MEGATRON_SAVED),
            "elementwise": policies.save_only_these_names(
                *(n for n in MEGATRON_SAVED if n not in RECOMPUTED_ELEMENTWISE)),
            }[name]


def causal_document_mask(segment_ids_BxL, batch: int, length: int):
    """[B, T, S] bool: key s is visible to query t iff s <= t (by index in the row, not by
    position) and both belong to the same document."""
    idx = jnp.arange(length)
    mask_TxS = idx[:, None] >= idx[None, :]
    if segment_ids_BxL is None:
        return jnp.broadcast_to(mask_TxS, (batch, length, length))
    same_doc_BxTxS = segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :]
    return mask_TxS[None] & same_doc_BxTxS


def layer_groups(graphdefs) -> list[tuple[int, int]]:
    """[start, end) runs of consecutive equal graphdefs: each run is scanned as one stack."""
    groups, start = [], 0
    for i in range(1, len(graphdefs) + 1):
        if i == len(graphdefs) or graphdefs[i] != graphdefs[start]:
            groups.append((start, i))
            start = i
    return groups


def _stacked(states):
    """Equal-structured states stacked leaf by leaf on a new leading axis."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *states)


class Llama(nnx.Module):
    # The layer class: a family that changes only the layer (models.moe) sets its own.
    block = Block

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype,
                               param_dtype=cfg.param_dtype,
                               embedding_init=nnx.initializers.normal(cfg.init_std), rngs=rngs)
        self.layers = nnx.List([self.block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg)
        if not cfg.tie_embeddings:
            self.lm_head = nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False,
                                      dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                                      kernel_init=nnx.initializers.normal(cfg.init_std), rngs=rngs)

    def __call__(self, tokens_BxL, positions=None, segment_ids=None, layer_stacks=None):
        """Logits [B, L, V] in cfg.dtype. `positions` [B, L] default to 0..L-1 per row (pass
        per-document positions for packed rows); `segment_ids` [B, L] are document ids: a
        token attends only to earlier tokens of its own document. None: one document per row.
        `layer_stacks` ({start: stacked Params} of ``scanned_runs``, as ``layer_param_stacks``
        builds them): the scanned runs read their parameters from these instead of stacking
        the layers' own (a trainer stacks once per step and differentiates the stacks)."""
        b, length = tokens_BxL.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
        rope = rope_tables(positions, self.config)
        # The cuDNN kernel builds its own causal mask; do not materialize ours for it.
        mask = None if self.config.attention_impl == "cudnn" else causal_document_mask(segment_ids, b, length)
        x = constrain(self._embed(tokens_BxL), BLD)
        x = self._run_layers(x, rope, mask, segment_ids, layer_stacks or {})
        x, extras = x if isinstance(x, tuple) else (x, None)  # (x, extras): models.moe
        logits = constrain(self._logits(x), ("batch", "sequence", "vocab"))
        return logits if extras is None else (logits, extras)

    def _embed(self, tokens):
        """The embedding rows in cfg.dtype. Looked up in the parameter dtype and then cast
        (the same values as nnx.Embed's cast-then-take), so the backward scatter-adds the
        rows' gradients in FP32: a BF16 scatter-add rounds at every repeated token, and
        under data parallelism its cross-device sum would be a BF16 sum too."""
        # jnp.take, or vocabulary-parallel where a trainer's rules ask for it (lp_jax's
        # data-parallel shard_map does: XLA's SPMD partitioner aborts on the plain gather
        # there; ``models.embedding_lookup``).
        return embedding_lookup(self.embed.embedding[...], tokens).astype(self.config.dtype)

    def _logits(self, x_BxLxD):
        x = self.final_norm(x_BxLxD)
        if self.config.tie_embeddings:
            # nnx.Embed.attend with FP32 accumulation made explicit: the same BF16 logits,
            # and a sharded contraction (the tied weight's gradient over a data-parallel
            # batch) sums its partial results in FP32 before rounding.
            table = self.embed.embedding[...].astype(self.config.dtype)
            logits = jnp.einsum("bld,vd->blv", x.astype(self.config.dtype), table,
                                preferred_element_type=jnp.float32)
            return logits.astype(self.config.dtype)
        return self.lm_head(x)

    def _layer_fn(self, graphdef):
        """The per-layer body (params, rest, x, layer index) -> x, with the remat policy applied."""
        def body(params, rest, x, i, rope, mask, segment_ids):
            with layer_scope(i):  # which layer runs, for precision code that reads it
                return nnx.merge(graphdef, params, rest)(x, rope, mask, segment_ids)
        if self.config.remat not in LAYER_BODY_REMATS:
            return body
        return jax.checkpoint(body, policy=_remat_policy(self.config.remat))

    def scanned_runs(self) -> list[tuple[int, int]]:
        """[start, end) of each run of two or more equal layers that is scanned (none unless
        scan_layers)."""
        if not self.config.scan_layers:
            return []
        runs = layer_groups([nnx.split(layer, nnx.Param, ...)[0] for layer in self.layers])
        return [(start, end) for start, end in runs if end - start > 1]

    def layer_param_stacks(self) -> dict:
        """{start: the run's layer Params stacked on a new leading axis} per scanned run: a
        copy of those parameters, what each call makes unless given ``layer_stacks``."""
        return {start: _stacked([nnx.split(layer, nnx.Param, ...)[1] for layer in self.layers[start:end]])
                for start, end in self.scanned_runs()}

    def _run_layers(self, x, rope, mask, segment_ids, layer_stacks):
        if not self.config.scan_layers and self.config.remat not in LAYER_BODY_REMATS:
            for i, layer in enumerate(self.layers):
                with layer_scope(i):
                    x = layer(x, rope, mask, segment_ids)
            return x
        return self._layer_runs(x, rope, mask, segment_ids, layer_stacks, lambda x: (x, None))[0]

    def _layer_runs(self, x, rope, mask, segment_ids, layer_stacks, split_output):
        """Every layer through ``_layer_fn``, each run of equal layers one ``lax.scan`` (with
        scan_layers; a layer at a time otherwise): (x, per run its layers' other outputs
        stacked on a leading axis). ``split_output`` splits what a layer returns into (x,
        its other outputs): a family whose blocks return more than x (models.moe) reads them."""
        split = [nnx.split(layer, nnx.Param, ...) for layer in self.layers]
        runs = (layer_groups([g for g, _, _ in split]) if self.config.scan_layers
                else [(i, i + 1) for i in range(len(split))])
        outputs = []
        for start, end in runs:
            fn = self._layer_fn(split[start][0])

            def step(carry, xs, fn=fn):
                i, params, rest = xs
                return split_output(fn(params, rest, carry, i, rope, mask, segment_ids))

            if end - start == 1:
                # jnp.int32 so the index reaches layer_scope as it would from a scan.
                x, out = step(x, (jnp.int32(start), split[start][1], split[start][2]))
                outputs.append(jax.tree.map(lambda a: a[None], out))
                continue
            params = layer_stacks.get(start)
            if params is None:
                params = _stacked([p for _, p, _ in split[start:end]])
            rest = _stacked([r for _, _, r in split[start:end]])
            x, out = jax.lax.scan(step, x, (jnp.arange(start, end, dtype=jnp.int32), params, rest))
            outputs.append(out)
        return x, outputs

    # ---- KV-cache inference (``models.generate``) ----

    def init_cache(self, batch: int, max_len: int):
        """Per-layer (k, v) buffers, each [B, max_len, K, H] in cfg.dtype, zero-filled."""
        cfg = self.config
        shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        return tuple((jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))
                     for _ in range(cfg.num_layers))

    def decode(self, tokens_BxT, cache, cache_index):
        """Runs T new tokens at positions cache_index.. (the same for every row), attending to
        the cache plus themselves; returns (logits [B, T, V], updated cache). Layers run
        unrolled here whatever scan_layers says: inference needs no gradient memory."""
        b, t = tokens_BxT.shape
        max_len = cache[0][0].shape[1]
        query_pos_T = cache_index + jnp.arange(t, dtype=jnp.int32)
        positions = jnp.broadcast_to(query_pos_T, (b, t))
        mask_BxTxS = jnp.broadcast_to(jnp.arange(max_len)[None, :] <= query_pos_T[:, None], (b, t, max_len))
        rope = rope_tables(positions, self.config)
        x = self._embed(tokens_BxT)
        new_cache = []
        for i, layer in enumerate(self.layers):
            with layer_scope(i):
                x, layer_cache = layer(x, rope, mask_BxTxS, None, cache[i], cache_index)
            new_cache.append(layer_cache)
        return self._logits(x), tuple(new_cache)
