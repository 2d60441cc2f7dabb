"""What layer 0 of a Llama keeps for its backward: the leaves of its VJP's closure."""
import jax
import jax.numpy as jnp
from flax import nnx

from models import llama


def layer_vjp_leaves(model: llama.Llama, batch: int, length: int) -> list:
    """The arrays layer 0's VJP holds, for a [batch, length] input of ones."""
    graphdef, params, rest = nnx.split(model.layers[0], nnx.Param, ...)
    body = model._layer_fn(graphdef)
    x = jnp.ones((batch, length, model.config.hidden_size), model.config.dtype)
    rope = llama.rope_tables(jnp.broadcast_to(jnp.arange(length), (batch, length)), model.config)
    mask = llama.causal_document_mask(None, batch, length)
    _, vjp = jax.vjp(lambda p, x: body(p, rest, x, jnp.int32(0), rope, mask, None), params, x)
    return [leaf for leaf in jax.tree.leaves(vjp) if hasattr(leaf, "shape")]
