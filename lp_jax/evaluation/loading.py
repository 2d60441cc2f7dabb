"""Loads what evaluation scores with: a model, its tokenizer and its context length.

Evaluation runs in BF16 by default whatever precision the model was trained in: the model
is rebuilt plain (no recipe applied) with compute dtype `dtype`, so that a comparison of
runs isolates the training precision.

Two sources:
- a Hugging Face folder (`--hf`): `models.hf.load_hf(path, dtype=...)`, the folder's
  `tokenizer.json`, and `max_position_embeddings` from its `config.json` (the harness's
  `max_length` for a Hugging Face model);
- a training run folder (`--checkpoint`), see `load_from_run_dir`.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
from flax import nnx

from lp_jax.data.tokenizers import HFTokenizerFile, get_tokenizer
from lp_jax.errors import UserError
from lp_jax.evaluation.pair_encoding import ScoringTokenizer
from lp_jax.runs.model_state import restore_model_state  # noqa: F401  (re-exported: the state reader)
from lp_jax.runs.run_folder import open_and_restore
from models.files import read_json_object
from models.hf import load_hf

# The harness's fallback when a model states no context length.
DEFAULT_MAX_LENGTH = 2048


@dataclasses.dataclass
class LoadedModel:
    model: nnx.Module  # int32 tokens_BxL -> logits_BxLxV
    tokenizer: ScoringTokenizer
    max_length: int
    source: str  # what was loaded, for the results file


def _require_file(path: str) -> str:
    if not os.path.isfile(path):
        raise UserError(f"{path} does not exist")
    return path


def _max_length(config: dict, config_path: str) -> int:
    value = config.get("max_position_embeddings") or DEFAULT_MAX_LENGTH
    try:
        length = int(value)
    except (TypeError, ValueError):
        length = 0
    if length < 1:
        raise UserError(f"{config_path}: max_position_embeddings must be a positive "
                        f"integer, got {value!r}")
    return length


def load_from_hf_dir(path: str, dtype=jnp.bfloat16) -> LoadedModel:
    if not os.path.isdir(path):
        raise UserError(f"--hf {path}: not a folder")
    config_path = _require_file(os.path.join(path, "config.json"))
    max_length = _max_length(read_json_object(config_path, UserError), config_path)
    tokenizer = HFTokenizerFile(_require_file(os.path.join(path, "tokenizer.json")))

    model = load_hf(path, dtype=dtype)
    return LoadedModel(model, tokenizer, max_length, f"hf:{os.path.abspath(path)}")


def load_from_run_dir(run_dir: str, dtype=jnp.bfloat16) -> LoadedModel:
    """A training run's newest checkpoint that restores (``lp_jax.runs.run_folder``; newer
    damaged ones are skipped with a warning on stderr and left as they are): the model the
    checkpoint records, rebuilt from its architecture alone (the run's remat policy and
    attention kernel are training choices evaluation does not inherit), the tokenizer of the
    run's data, and the architecture's ``max_seq_len`` as the context length."""
    if not os.path.isdir(run_dir):
        raise UserError(f"--checkpoint {run_dir}: not a folder")
    saved, model = open_and_restore(run_dir, compute_dtype=dtype, architecture_only=True)
    tokenizer = get_tokenizer(saved.config.data.tokenizer)
    return LoadedModel(model, tokenizer, int(saved.model_config.max_seq_len),
                       f"checkpoint:{os.path.abspath(run_dir)}@{saved.step}")
