"""Per-slice FiLj for Linears stacked over layers (nnx.vmap + nnx.scan models).

One stacked Linear serves every layer, so its static dot_general cannot differ per layer.
This one reads the layer index the model gives through ``models.layer_scope``: a Python int
picks the recipe statically; a traced scan index selects between the recipe and BF16 with
``lax.cond``, so only the chosen GEMMs run (under ``jax.grad`` the cond keeps residual
buffers for both branches).
"""
from __future__ import annotations

import dataclasses

from jax import lax

from lp_jax import context
from lp_jax.gemm.dot_general import LowPrecisionDotGeneral
from lp_jax.recipes import BF16, Recipe


@dataclasses.dataclass(frozen=True)
class LayerPolicyDotGeneral:
    recipe: Recipe
    num_layers: int
    # As LowPrecisionDotGeneral.partly_manual.
    partly_manual: bool = False

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                 out_sharding=None):
        quantized = LowPrecisionDotGeneral(self.recipe, partly_manual=self.partly_manual)
        bf16 = LowPrecisionDotGeneral(BF16(backend=self.recipe.backend), partly_manual=self.partly_manual)
        layer = context.current_layer()
        if layer is None:
            if self.recipe.first_bf16_layers == 0 and self.recipe.last_bf16_layers == 0 \
                    and not self.recipe.bf16_layers:
                layer = 0  # the policy is the same for every layer: no index needed
            else:
                raise ValueError(
                    f"a stacked Linear under layer policy {self.recipe.policy} needs the layer index: "
                    "wrap each scanned layer's call in models.layer_scope.layer_scope(i)")
        kwargs = dict(precision=precision, preferred_element_type=preferred_element_type,
                      out_sharding=out_sharding)
        if isinstance(layer, int):
            chosen = bf16 if self.recipe.layer_is_bf16(layer, self.num_layers) else quantized
            return chosen(lhs, rhs, dimension_numbers, **kwargs)
        is_bf16 = (layer < self.recipe.first_bf16_layers) | \
            (layer >= self.num_layers - self.recipe.last_bf16_layers)
        for listed in self.recipe.bf16_layers:  # precision.bf16_layers
            is_bf16 = is_bf16 | (layer == listed)
        return lax.cond(is_bf16,
                        lambda a, b: bf16(a, b, dimension_numbers, **kwargs),
                        lambda a, b: quantized(a, b, dimension_numbers, **kwargs),
                        lhs, rhs)
