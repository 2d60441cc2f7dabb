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
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp

from lp_jax.evaluation.hf_tokenizer import HFTokenizerFile

# The harness's fallback when a model states no context length.
DEFAULT_MAX_LENGTH = 2048
# LlamaConfig fields that shape the parameters or the logits; the run config's other model
# keys (remat, attention kernel, dtypes) are training choices evaluation does not inherit.
ARCHITECTURE_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
    "head_dim", "rope_theta", "rope_scaling", "rms_norm_eps", "tie_embeddings", "max_seq_len",
    "scan_layers",
)


class LoadError(ValueError):
    """A model folder that cannot be evaluated (missing file, bad config)."""


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


def _on_device(abstract_tree):
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract_tree)


def restore_model_state(abstract_model: Any, checkpoint_dir: str, step: int | None = None):
    """Restores the model from item `state` of an Orbax CheckpointManager folder (latest
    step by default); returns the concrete model and the step read.

    Two layouts of that item are read:
    - the trainer's train-state dict {"params": nnx.State of the nnx.Params, "rest": the
      other variables, "opt_state", "step", ...}: only params (and a non-empty rest) are
      restored, a partial restore that never reads the optimizer moments (twice the
      parameters' size);
    - the model's whole nnx.State.
    """
    import orbax.checkpoint as ocp
    from flax import nnx

    from lp_jax.training.quiet_reads import abandoned_reads_hushed, orbax_logs

    if not os.path.isdir(checkpoint_dir):
        raise LoadError(f"{checkpoint_dir}: no checkpoint folder")
    # Orbax warns about every item it is not asked for (the trainer's `data`, `meta`);
    # skipping them is the point here, so its warnings are held back while reading. A
    # failed read's abandoned array reads would each print a traceback (quiet_reads.py).
    with orbax_logs(logging.ERROR), abandoned_reads_hushed():
        # A PyTree handler reads the item whether it was written with StandardSave or
        # PyTreeSave, and knows its saved structure before anything is restored.
        manager = ocp.CheckpointManager(os.path.abspath(checkpoint_dir),
                                        item_handlers={"state": ocp.PyTreeCheckpointHandler()})
        try:
            step = manager.latest_step() if step is None else step
            if step is None:
                raise LoadError(f"{checkpoint_dir}: no checkpoint saved yet")
            try:
                saved = manager.item_metadata(step)["state"]
            except (FileNotFoundError, KeyError, ValueError) as e:
                raise LoadError(f"{checkpoint_dir} step {step}: no readable item 'state' ({e})") from None
            if saved is None:
                raise LoadError(f"{checkpoint_dir} step {step}: no readable item 'state'")
            tree = getattr(saved, "tree", saved)
            if isinstance(tree, dict) and "params" in tree:
                graphdef, params, rest = nnx.split(abstract_model, nnx.Param, ...)
                target = {"params": _on_device(params)}
                if jax.tree.leaves(rest):
                    target["rest"] = _on_device(rest)
                partial = True
            else:
                graphdef, target = nnx.split(abstract_model)
                target = _on_device(target)
                partial = False
            args = ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=partial)
            try:
                restored = manager.restore(step, args=ocp.args.Composite(state=args))["state"]
            except Exception as e:  # TensorStore, Orbax and OS errors alike: the item cannot be read
                # One line; TensorStore appends a "See full ... details" of no use to anyone.
                text = " ".join(str(e).split()).split(" See full TensorStore details")[0] or type(e).__name__
                raise LoadError(f"{checkpoint_dir} step {step}: cannot read item 'state' "
                                f"({text[:200]})") from None
        finally:
            manager.close()
    if partial:
        model = nnx.merge(graphdef, restored["params"], restored.get("rest", rest))
    else:
        model = nnx.merge(graphdef, restored)
    return model, step


def _recorded_model_config(checkpoint_dir: str, step: int):
    from lp_jax.training.saved_run import RunFolderError, recorded_model_config

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
      `lp_jax.training.tokenizers.get_tokenizer`;
    - `RUN_DIR/checkpoints` (or `checkpoint.dir` when the config sets it): an Orbax
      CheckpointManager folder whose item `state` holds the FP32 parameters, as the
      trainer's train-state dict or as the model's nnx.State (`restore_model_state`);
      the newest step that restores is read (newer damaged ones are skipped with a
      warning on stderr and left as they are).
    The context length is the architecture's `max_seq_len`.
    """
    from lp_jax.training.saved_run import RunFolderError, newest_restorable

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
    from lp_jax.training.tokenizers import get_tokenizer

    tokenizer = get_tokenizer((config.get("data") or {}).get("tokenizer") or "bytes")
    return LoadedModel(model, tokenizer, int(max_length),
                       f"checkpoint:{os.path.abspath(run_dir)}@{step}")
