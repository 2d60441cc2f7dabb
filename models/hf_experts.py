"""Qwen3-MoE's experts in transformers' layout <-> the grouped kernels of lp_jax's MoE.

transformers keeps one SwiGLU MLP per expert, `mlp.experts.<e>.gate_proj/up_proj/down_proj`
([F, D], [F, D], [D, F]); models.moe keeps two grouped kernels per layer, `mlp/gate_up/kernel`
[E, D, 2F] (each expert's gate columns, then its up columns: MoE splits the GEMM's output in
halves, gate first) and `mlp/down/kernel` [E, F, D]. The HF conversion (models.hf) gives each
expert's weight a parameter path of its own, `layers/<i>/mlp/experts/<e>/<part>/kernel`
([in, out], as the dense MLP's Linears): `split_experts` cuts them out of the grouped kernels
and `join_experts` stacks them back. Both only move values: the conversion is exact.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

EXPERTS = "experts"
PARTS = ("gate_proj", "up_proj", "down_proj")
_GATE_UP, _DOWN = ("mlp", "gate_up", "kernel"), ("mlp", "down", "kernel")


def expert_tensors(num_experts: int) -> tuple[tuple[str, tuple, bool], ...]:
    """(HF name under a layer, path under the layer, transpose) of every expert weight."""
    return tuple((f"mlp.{EXPERTS}.{e}.{part}.weight", ("mlp", EXPERTS, e, part, "kernel"), True)
                 for e in range(num_experts) for part in PARTS)


def _expert_path(layer: tuple, e: int, part: str) -> tuple:
    return (*layer, "mlp", EXPERTS, e, part, "kernel")


def is_expert_path(path: tuple) -> bool:
    return len(path) >= 6 and path[-5] == "mlp" and path[-4] == EXPERTS


def expert_shape(path: tuple, cfg) -> tuple[int, int]:
    """The [in, out] shape of an expert weight's path."""
    d, f = cfg.hidden_size, cfg.moe_ffn_hidden_size or cfg.intermediate_size
    return (f, d) if path[-2] == "down_proj" else (d, f)


def split_experts(flat: Mapping[tuple, Any], cfg) -> dict[tuple, np.ndarray]:
    """``flat`` (a MoE model's parameters by path) with each layer's grouped kernels replaced
    by its experts' weights; a model without experts is returned as it is."""
    if not cfg.num_experts:
        return dict(flat)
    out = {}
    for path, array in flat.items():
        layer = path[:-3]
        if path[-3:] == _GATE_UP:
            half = array.shape[-1] // 2
            for e in range(array.shape[0]):
                out[_expert_path(layer, e, "gate_proj")] = array[e, :, :half]
                out[_expert_path(layer, e, "up_proj")] = array[e, :, half:]
        elif path[-3:] == _DOWN:
            for e in range(array.shape[0]):
                out[_expert_path(layer, e, "down_proj")] = array[e]
        else:
            out[path] = array
    return out


def join_experts(flat: Mapping[tuple, Any], cfg) -> dict[tuple, np.ndarray]:
    """The inverse of split_experts: each layer's expert weights stacked into its grouped
    kernels (KeyError for an expert weight missing)."""
    if not cfg.num_experts:
        return dict(flat)
    out = {}
    for path, array in flat.items():
        if not is_expert_path(path):
            out[path] = array
            continue
        layer = path[:-5]
        if (*layer, *_GATE_UP) in out:
            continue  # this layer's experts are joined already
        part = lambda e, name: flat[_expert_path(layer, e, name)]  # noqa: E731
        experts = range(cfg.num_experts)
        out[(*layer, *_GATE_UP)] = np.stack(
            [np.concatenate([part(e, "gate_proj"), part(e, "up_proj")], axis=-1) for e in experts])
        out[(*layer, *_DOWN)] = np.stack([part(e, "down_proj") for e in experts])
    return out
