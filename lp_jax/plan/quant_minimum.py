"""The fewest HBM bytes a transformer layer's quantization can move: each BF16 tensor a
quantized GEMM reads is read once, and each FP8/FP4 copy the recipe makes of it is written
once with its scales. Fused with its producer, the BF16 read of an activation could go too;
this is the floor of a quantization pass of its own, what a quantized recipe's extra bytes
over BF16 are held against (``python -m lp_jax.plan --layer-cost``).

A Linear's three tensors (input x [T, K], weight W [K, N], output gradient dy [T, N]) feed
two GEMMs each, so a recipe's six operand specs (``lp_jax.recipes.OPERAND_FIELDS``) name up
to two copies per tensor; a weight in 2-D tiles (``block_2d``) has one copy for both. The
inputs q, k and v share (the attention norm's output) and gate and up share (the MLP norm's
output) are read and quantized once.
"""
from __future__ import annotations

from lp_jax.numerics.registry import format_named
from lp_jax.recipes import Recipe

BF16_BYTES = 2


def copy_bytes_per_element(spec) -> float:
    """Bytes per element of the copy ``spec`` makes: its values, then its scales (one per
    block or tile) spread over it (``Format.copy_bytes``)."""
    if spec.fmt is None:
        return 0.0
    return format_named(spec.fmt).copy_bytes(tiles=spec.block_2d)


def tensor_bytes_per_element(recipe: Recipe, first: str, second: str) -> float:
    """Read once in BF16 plus each copy two operand specs ask for (one if they share it)."""
    a, b = getattr(recipe, first), getattr(recipe, second)
    if a.fmt is None and b.fmt is None:
        return 0.0
    shared = a == b and a.block_2d
    copies = copy_bytes_per_element(a) + (0.0 if shared else copy_bytes_per_element(b))
    return BF16_BYTES + copies


def layer_linears(hidden: int, ffn: int, q_width: int, kv_width: int) -> list[tuple[str, int, int, str]]:
    """(name, K, N, the input it shares) of a Llama layer's seven Linears."""
    return [("q", hidden, q_width, "attn_norm"), ("k", hidden, kv_width, "attn_norm"),
            ("v", hidden, kv_width, "attn_norm"), ("o", q_width, hidden, "o"),
            ("gate", hidden, ffn, "mlp_norm"), ("up", hidden, ffn, "mlp_norm"),
            ("down", ffn, hidden, "down")]


def minimum_layer_bytes(model_config, recipe: Recipe, tokens: int, weight_passes: int = 1) -> float:
    """HBM bytes per step of one layer's quantization at its floor, for ``tokens`` tokens
    per device (micro-batches together) and the weights quantized ``weight_passes`` times.
    0 for a recipe that quantizes nothing."""
    c = model_config
    linears = layer_linears(c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim,
                            c.num_kv_heads * c.head_dim)
    x = tensor_bytes_per_element(recipe, "fprop_x", "wgrad_x")
    w = tensor_bytes_per_element(recipe, "fprop_w", "dgrad_w")
    dy = tensor_bytes_per_element(recipe, "dgrad_dy", "wgrad_dy")
    inputs = {shared: k for _, k, _, shared in linears}  # one read and one set of copies each
    total = tokens * x * sum(inputs.values())
    total += sum(tokens * dy * n + weight_passes * w * k * n for _, k, n, _ in linears)
    return total
