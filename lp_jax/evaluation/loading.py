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
import json
import os
from typing import Any

import jax.numpy as jnp

from lp_jax.evaluation.hf_tokenizer import HFTokenizerFile
from lp_jax.runs.model_state import LoadError, restore_model_state  # noqa: F401  (LoadError: evaluation's error too)

# The harness's fallback when a model states no context length.
DEFAULT_MAX_LENGTH = 2048
# LlamaConfig fields that shape the parameters or the logits; the run config's other model
# keys (remat, attention kernel, dtypes) are training choices evaluation does not inherit.
ARCHITECTURE_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
    "head_dim", "rope_theta", "rope_scaling", "rms_norm_eps", "tie_embeddings", "max_seq_len",
    "scan_layers",
)


@dataclasses.dataclass
class LoadedModel:
    model: Any  # callable: int32 tokens_BxL -> logits_BxLxV (an NNX module)
    tokenizer: Any  # encode(text) -> list[int], bos_id
    max_length: int
    source: str  # what was loaded, for the results file


def _require_file(path: str) -> str:
    if not os.path.isfile(path):
        raise LoadError(f"{path} does not exist")
    return path


def load_from_hf_dir(path: str, dtype=jnp.bfloat16) -> LoadedModel:
    if not os.path.isdir(path):
        raise LoadError(f"--hf {path}: not a folder")
    with open(_require_file(os.path.join(path, "config.json"))) as f:
        config = json.load(f)
    tokenizer = HFTokenizerFile(_require_file(os.path.join(path, "tokenizer.json")))
    from models.hf import load_hf  # the model package: imported only when a model is loaded

    model = load_hf(path, dtype=dtype)
    max_length = int(config.get("max_position_embeddings") or DEFAULT_MAX_LENGTH)
    return LoadedModel(model, tokenizer, max_length, f"hf:{os.path.abspath(path)}")


def _read_run_config(run_dir: str) -> dict:
    import yaml

    with open(_require_file(os.path.join(run_dir, "config.yaml"))) as f:
        config = yaml.safe_load(f)
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict) \
            or "preset" not in config["model"]:
        raise LoadError(f"{run_dir}/config.yaml has no model.preset")
    return config


def build_model_from_run_config(model_section: dict, dtype) -> Any:
    """The run's architecture: `models.config.preset(model.preset, **overrides)`,
    built abstractly (no parameter is allocated before the checkpoint is read)."""
    from flax import nnx
    from models.config import preset
    from models.llama import Llama

    overrides = {k: v for k, v in model_section.items()
                 if k in ARCHITECTURE_FIELDS and v is not None}
    cfg = preset(model_section["preset"], **overrides, dtype=dtype, param_dtype=jnp.float32)
    return nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))), cfg.max_seq_len


def _recorded_model_config(checkpoint_dir: str, step: int):
    from lp_jax.runs.run_folder import RunFolderError, recorded_model_config

    try:
        return recorded_model_config(checkpoint_dir, step)
    except (RunFolderError, ValueError, TypeError):
        return None  # no readable record: the run's config.yaml says


def load_from_run_dir(run_dir: str, dtype=jnp.bfloat16) -> LoadedModel:
    """A training run's latest checkpoint, as the trainer writes it (docs/evaluation.md):

    - `RUN_DIR/config.yaml`: the resolved run config; the model is the one the latest
      checkpoint records in its `meta` item (a run started from HF weights has their
      architecture, whatever its preset), else `model.preset` and its architecture
      overrides; `data.tokenizer` (default "bytes") gives the tokenizer via
      `lp_jax.data.tokenizers.get_tokenizer`;
    - `RUN_DIR/checkpoints` (or `checkpoint.dir` when the config sets it): an Orbax
      CheckpointManager folder whose item `state` holds the FP32 parameters, as the
      trainer's train-state dict or as the model's nnx.State (`restore_model_state`);
      the newest step that restores is read (newer damaged ones are skipped with a
      warning on stderr and left as they are).
    The context length is the architecture's `max_seq_len`.
    """
    from lp_jax.runs.run_folder import RunFolderError, newest_restorable

    if not os.path.isdir(run_dir):
        raise LoadError(f"--checkpoint {run_dir}: not a folder")
    config = _read_run_config(run_dir)
    checkpoint_dir = (config.get("checkpoint") or {}).get("dir") or os.path.join(
        run_dir, "checkpoints")
    if not os.path.isdir(checkpoint_dir):
        raise LoadError(f"{checkpoint_dir}: no checkpoint folder")

    def attempt(step: int):
        recorded = _recorded_model_config(checkpoint_dir, step)
        if recorded is not None:
            from flax import nnx
            from models.llama import Llama, LlamaConfig

            cfg = LlamaConfig(**{k: getattr(recorded, k) for k in ARCHITECTURE_FIELDS},
                              dtype=dtype, param_dtype=jnp.float32)
            abstract_model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
            max_length = cfg.max_seq_len
        else:
            abstract_model, max_length = build_model_from_run_config(config["model"], dtype)
        return (*restore_model_state(abstract_model, checkpoint_dir, step), max_length)

    try:
        model, step, max_length = newest_restorable(checkpoint_dir, attempt)
    except RunFolderError as e:
        raise LoadError(str(e)) from None
    from lp_jax.data.tokenizers import get_tokenizer

    tokenizer = get_tokenizer((config.get("data") or {}).get("tokenizer") or "bytes")
    return LoadedModel(model, tokenizer, int(max_length),
                       f"checkpoint:{os.path.abspath(run_dir)}@{step}")
