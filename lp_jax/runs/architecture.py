"""The model a run config builds from its preset: the preset of its family (``model.type``,
lp_jax.model_registry), the set ``model.*`` keys and the tokenizer's vocabulary (rounded up
to ``VOCAB_MULTIPLE`` rows). A run that starts from
other weights takes their architecture instead (``init_weights.model_config``)."""
from __future__ import annotations

import jax.numpy as jnp

from lp_jax.config.schema import MOCK_SOURCES, TrainConfig
from lp_jax.data.tokenizers import Tokenizer, get_tokenizer
from lp_jax import model_registry
from lp_jax.errors import UserError, one_line
from models.config import LlamaConfig

VOCAB_MULTIPLE = 128  # embedding rows rounded up for tensor-core friendly shapes


def run_tokenizer(c: TrainConfig) -> Tokenizer | None:
    """The tokenizer of the run's data (None for mock tokens); UserError if it cannot load."""
    if c.data.source in MOCK_SOURCES:
        return None
    try:
        return get_tokenizer(c.data.tokenizer)
    except (ValueError, ImportError) as e:
        raise UserError(f"data.tokenizer: {e}") from None


def preset_model_config(c: TrainConfig, tokenizer: Tokenizer | None) -> LlamaConfig:
    """``model.preset`` of the ``model.type`` family with the config's model keys and the
    tokenizer's vocabulary; UserError for a type not registered."""
    model_registry.model_family(c.model.type)  # an unknown type: its own line, not "model: ..."
    overrides = c.model.overrides()
    if tokenizer is not None:
        if c.model.vocab_size is None:
            overrides["vocab_size"] = -(-tokenizer.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        elif c.model.vocab_size < tokenizer.vocab_size:
            raise UserError(f"model.vocab_size={c.model.vocab_size} is smaller than tokenizer "
                            f"{tokenizer.name!r}'s {tokenizer.vocab_size} ids")
    overrides["dtype"] = jnp.dtype(c.model.dtype)
    overrides["param_dtype"] = jnp.dtype(c.model.param_dtype)
    try:
        return model_registry.preset(c.model.type, c.model.preset, **overrides)
    except (ValueError, TypeError, KeyError) as e:
        raise UserError(f"model: {one_line(e)}") from None
