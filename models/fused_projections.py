"""Megatron's fused projections, and exact conversions to and from the separate ones.

With ``LlamaConfig.fused_projections`` a layer runs one QKV GEMM and one gate/up GEMM, as
Megatron-LM's ``linear_qkv`` and ``linear_fc1`` do, so that each has one weight and one
input scale in a quantized recipe. Their kernels ([in, out], as nnx.Linear stores them):

- ``attn/qkv`` [D, K * (G + 2) * H]: per KV group g, the G query heads of the group, then
  k_g, then v_g (Megatron's ``SelfAttention.get_query_key_value_tensors`` splits its output
  per query group so; with tensor parallelism over whole groups each rank holds whole groups);
- ``mlp/gate_up`` [D, 2F]: gate, then up (``linear_fc1`` with ``gated_linear_unit``, halved
  by its activation).

The same splits turn the fused GEMM's output into q, k, v and gate, up. Joining and
splitting only move values, so a checkpoint of either layout converts to the other exactly:
``value_at`` reads one layout's array from arrays of either, keyed by parameter path (any
prefix: the Adam moments are converted as the parameters are).
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

QKV, GATE_UP = "qkv", "gate_up"
# (container, fused Linear) -> its separate Linears, in the order they are joined.
FUSED_PARTS: dict[tuple[str, str], tuple[str, ...]] = {
    ("attn", QKV): ("q_proj", "k_proj", "v_proj"),
    ("mlp", GATE_UP): ("gate_proj", "up_proj"),
}
_PART_OF = {(container, part): (fused, i) for (container, fused), parts in FUSED_PARTS.items()
            for i, part in enumerate(parts)}


def _xp(array):
    """numpy for host arrays (checkpoint and Hugging Face conversions), jax.numpy otherwise."""
    return np if isinstance(array, np.ndarray) else jnp


def join_qkv(q, k, v, num_kv_heads: int):
    """[..., K * (G + 2) * H] from q [..., N * H], k and v [..., K * H], grouped per KV head."""
    lead = q.shape[:-1]
    per_group = [a.reshape(*lead, num_kv_heads, a.shape[-1] // num_kv_heads) for a in (q, k, v)]
    return _xp(q).concatenate(per_group, axis=-1).reshape(*lead, -1)


def split_qkv(qkv, num_heads: int, num_kv_heads: int, head_dim: int):
    """(q [..., N * H], k [..., K * H], v [..., K * H]) of join_qkv's layout."""
    lead = qkv.shape[:-1]
    q_width = num_heads // num_kv_heads * head_dim
    per_group = qkv.reshape(*lead, num_kv_heads, q_width + 2 * head_dim)
    q = per_group[..., :q_width]
    k = per_group[..., q_width:q_width + head_dim]
    v = per_group[..., q_width + head_dim:]
    return tuple(a.reshape(*lead, -1) for a in (q, k, v))


def join_gate_up(gate, up):
    """[..., 2F]: gate then up."""
    return _xp(gate).concatenate([gate, up], axis=-1)


def split_gate_up(gate_up):
    """(gate, up) of join_gate_up's layout."""
    half = gate_up.shape[-1] // 2
    return gate_up[..., :half], gate_up[..., half:]


def _join(fused: str, parts: list, cfg):
    return join_qkv(*parts, cfg.num_kv_heads) if fused == QKV else join_gate_up(*parts)


def _split(fused: str, array, cfg):
    if fused == QKV:
        return split_qkv(array, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    return split_gate_up(array)


def _fused_at(path: tuple) -> tuple[int, str] | None:
    """(index, name) of the fused Linear named in ``path``, if any."""
    for i in range(1, len(path)):
        if (path[i - 1], path[i]) in FUSED_PARTS:
            return i, path[i]
    return None


def _part_at(path: tuple) -> tuple[int, str, int] | None:
    """(index, fused Linear, position among its parts) of a separate projection in ``path``."""
    for i in range(1, len(path)):
        hit = _PART_OF.get((path[i - 1], path[i]))
        if hit is not None:
            return i, *hit
    return None


def fused_path(path: tuple) -> tuple:
    """``path`` with a separate projection's name replaced by its fused Linear's."""
    hit = _part_at(path)
    return path if hit is None else path[:hit[0]] + (hit[1],) + path[hit[0] + 1:]


def separate_paths(path: tuple) -> list[tuple]:
    """The paths of a fused Linear's separate projections (``[path]`` for any other path)."""
    hit = _fused_at(path)
    if hit is None:
        return [path]
    i, fused = hit
    return [path[:i] + (part,) + path[i + 1:] for part in FUSED_PARTS[(path[i - 1], fused)]]


def value_at(path: tuple, arrays: Mapping[tuple, Any], cfg):
    """The array at ``path`` of either layout, from ``arrays`` of either layout (joined or
    split from the other's when ``path`` is not among them). KeyError if neither has it."""
    if path in arrays:
        return arrays[path]
    fused = _fused_at(path)
    if fused is not None:
        return _join(fused[1], [arrays[p] for p in separate_paths(path)], cfg)
    part = _part_at(path)
    if part is None:
        raise KeyError(path)
    _, name, position = part
    return _split(name, arrays[fused_path(path)], cfg)[position]


def relayout_flat(arrays: Mapping[tuple, Any], paths, cfg) -> dict[tuple, Any]:
    """{path: value_at(path, arrays, cfg)} for each of ``paths``."""
    return {path: value_at(path, arrays, cfg) for path in paths}


def fuse_flat(arrays: Mapping[tuple, Any], cfg) -> dict[tuple, Any]:
    """Arrays keyed by the separate layout's paths, in the fused layout (order kept)."""
    return relayout_flat(arrays, dict.fromkeys(fused_path(p) for p in arrays), cfg)


def separate_flat(arrays: Mapping[tuple, Any], cfg) -> dict[tuple, Any]:
    """Arrays keyed by the fused layout's paths, in the separate layout."""
    return relayout_flat(arrays, [q for p in arrays for q in separate_paths(p)], cfg)


def _key_name(key) -> Any:
    for attribute in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey
        if hasattr(key, attribute):
            return getattr(key, attribute)
    return str(key)


def _names(key_path) -> tuple:
    return tuple(_key_name(k) for k in key_path)


def relayout(tree, target, cfg):
    """``tree`` (a pytree holding a model's parameters in one layout: its nnx.State, a train
    state with Adam moments) with ``target``'s structure, whose layout may be the other;
    every other leaf is taken as it is, by path."""
    arrays = {_names(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
    paths, treedef = jax.tree_util.tree_flatten_with_path(target)
    return jax.tree_util.tree_unflatten(treedef, [value_at(_names(p), arrays, cfg) for p, _ in paths])


def layout_name(fused: bool) -> str:
    return "fused qkv and gate_up" if fused else "separate q/k/v and gate/up"
