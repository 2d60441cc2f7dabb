"""A training run's checkpoints as a source of weights: what `python -m lp_jax.export`
writes out and what another run's `init.checkpoint` starts from.

A source is named by the run folder (`config.yaml` inside), its checkpoint folder, or one
step folder of it; `RUN_DIR@STEP` picks a step. The model is the one the checkpoint records
in its `meta` item (`model`), so a run that itself started from other weights exports
without them; a checkpoint that records none is rebuilt from its saved config as the
trainer builds it (preset, overrides, the tokenizer's vocabulary).
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys
from typing import Any, Callable

import jax.numpy as jnp
import orbax.checkpoint as ocp
import yaml
from flax import nnx

from lp_jax.config.schema import TrainConfig
from lp_jax.config.yaml_io import from_dict
from lp_jax.errors import UserError, one_line
from lp_jax.model_registry import build_model
from lp_jax.runs.architecture import preset_model_config, run_tokenizer
from lp_jax.runs.checkpoint import newest_that_restores
from lp_jax.runs.model_state import restore_model_state
from models.config import LlamaConfig, architecture, config_from_dict


@dataclasses.dataclass(frozen=True)
class SavedRun:
    source: str  # the path as given
    checkpoint_dir: str
    step: int
    config: TrainConfig  # the run config the checkpoint was saved with
    model_config: LlamaConfig  # of its weights
    recipe: str  # precision recipe in force at that step


def checkpoint_folder(run_dir: str, checkpoint_dir: str | None = None) -> str:
    """Where a run's checkpoints are: ``checkpoint.dir`` when the config sets it (relative
    to where the run ran), else RUN_DIR/checkpoints; resolved as the kernel resolves it
    (symbolic links, then ``..``), the one way the trainer and every reader name it."""
    return os.path.realpath(checkpoint_dir or os.path.join(run_dir, "checkpoints"))


def split_step(spec: str) -> tuple[str, int | None]:
    """`RUN_DIR@STEP` -> (RUN_DIR, STEP); a path without `@<digits>` has no step."""
    m = re.fullmatch(r"(.+)@(\d+)", spec)
    return (m.group(1), int(m.group(2))) if m else (spec, None)


def _is_step_dir(path: str) -> bool:
    return (os.path.basename(os.path.normpath(path)).isdigit()
            and os.path.isdir(os.path.join(path, "state")) and os.path.isdir(os.path.join(path, "meta")))


def is_run_source(path: str) -> bool:
    """A run folder, its checkpoint folder or one of its step folders (not the plain state
    checkpoints of `python -m models.hf import`, which hold llama_config.json)."""
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "llama_config.json")):
        return False
    if os.path.isfile(os.path.join(path, "config.yaml")) or _is_step_dir(path):
        return True
    return any(_is_step_dir(os.path.join(path, d)) for d in os.listdir(path))


def _locate(path: str) -> tuple[str, str | None]:
    """(checkpoint folder, step named by the path or None)."""
    if not os.path.isdir(path):
        raise UserError(f"{path}: no such folder")
    if _is_step_dir(path):
        return os.path.dirname(os.path.realpath(path)), int(os.path.basename(os.path.normpath(path)))
    config_path = os.path.join(path, "config.yaml")
    if os.path.isfile(config_path):
        with open(config_path) as f:
            raw = yaml.safe_load(f) or {}
        # checkpoint.dir, when set, is where the run wrote (relative to where it ran).
        return checkpoint_folder(path, (raw.get("checkpoint") or {}).get("dir")), None
    if any(_is_step_dir(os.path.join(path, d)) for d in os.listdir(path)):
        return path, None
    raise UserError(f"{path}: not a training run folder (no config.yaml) nor a checkpoint "
                    "folder of one")


def open_run(path: str, step: int | None = None) -> SavedRun:
    """The checkpoint at `step` (default: the latest, or the step folder given) of a run."""
    checkpoint_dir, named_step = _locate(path)
    if named_step is not None and step is not None and step != named_step:
        raise UserError(f"{path} is the checkpoint of step {named_step}, not step {step}")
    step = named_step if step is None else step
    if not os.path.isdir(checkpoint_dir):
        raise UserError(f"{path}: no checkpoints ({checkpoint_dir} does not exist)")
    step, meta = read_meta(checkpoint_dir, step)
    if meta is None:  # a bare model-state checkpoint: the run folder's config.yaml describes it
        meta = {"config": _folder_config(path, checkpoint_dir, step)}
    config = _config(meta, path)
    return SavedRun(path, checkpoint_dir, step, config, _model_config(meta, config, path),
                    str(meta.get("recipe", config.precision.recipe)))


def read_meta(checkpoint_dir: str, step: int | None = None) -> tuple[int, dict | None]:
    """(step, its `meta` item or None when it has none) of a checkpoint folder; the latest
    step by default. A meta item that cannot be read is a UserError."""
    options = ocp.CheckpointManagerOptions(create=False)
    with ocp.CheckpointManager(os.path.realpath(checkpoint_dir), options=options) as manager:
        steps = _steps(manager, checkpoint_dir)
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise UserError(f"{checkpoint_dir}: no checkpoint of step {step}; saved steps: "
                            f"{', '.join(map(str, steps))}")
        if not os.path.isdir(os.path.join(checkpoint_dir, str(step), "meta")):
            return step, None
        try:
            return step, manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except (FileNotFoundError, KeyError, ValueError):
            raise UserError(f"{checkpoint_dir} step {step}: no readable item 'meta'") from None


def _folder_config(path: str, checkpoint_dir: str, step: int) -> dict:
    """The run config of a checkpoint with no meta item (a model's state saved beside a
    config.yaml): the folder's config.yaml."""
    config_path = os.path.join(path, "config.yaml")
    if not os.path.isfile(config_path):
        raise UserError(f"{checkpoint_dir} step {step}: no readable item 'meta' (and no config.yaml "
                        f"in {path} to describe it)")
    with open(config_path) as f:
        raw = yaml.safe_load(f)
    if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict) or "preset" not in raw["model"]:
        raise UserError(f"{config_path} has no model.preset")
    return raw


def _config(meta: dict, path: str):
    if not isinstance(meta.get("config"), dict):
        raise UserError(f"{path}: the checkpoint's meta item holds no run config")
    try:
        return from_dict(TrainConfig, meta["config"])
    except UserError as e:
        raise UserError(f"{path}: the checkpoint's run config no longer loads: {e}") from None


def _model_config(meta: dict, config, path: str):
    """The model the checkpoint records; for a checkpoint that records none, the one its
    saved config builds from the preset."""
    try:
        if isinstance(meta.get("model"), dict):
            return config_from_dict(meta["model"])
        if config.init.hf or config.init.checkpoint:
            raise ValueError("the checkpoint records no model, and the run started from other "
                             "weights, whose architecture its config does not hold")
        return preset_model_config(config, run_tokenizer(config))
    except (UserError, TypeError, ValueError) as e:
        raise UserError(f"{path}: cannot rebuild the run's model: {one_line(e)}") from None


def restore_model(saved: SavedRun, compute_dtype=None, architecture_only: bool = False):
    """The model of the checkpoint with its FP32 master weights (the optimizer moments are
    never read); computes in ``compute_dtype`` (default float32). ``architecture_only``
    rebuilds it from ``models.config.ARCHITECTURE_FIELDS`` alone, leaving the run's remat
    policy and attention kernel (choices of the training program) at their defaults."""

    dtype = jnp.dtype(compute_dtype or jnp.float32)
    cfg = (architecture(saved.model_config, dtype=dtype, param_dtype=jnp.float32) if architecture_only
           else saved.model_config.replace(dtype=dtype))
    abstract = nnx.eval_shape(lambda: build_model(saved.config.model.type, cfg, nnx.Rngs(0)))
    try:
        model, _ = restore_model_state(abstract, saved.checkpoint_dir, saved.step)
    except (UserError, ValueError) as e:
        raise UserError(f"{saved.source}: {one_line(e)}") from None
    return model


def open_and_restore(path: str, step: int | None = None, as_trained: bool = False,
                     warn: Callable[[str], Any] | None = None, compute_dtype=None,
                     architecture_only: bool = False) -> tuple[SavedRun, Any]:
    """(``open_run``, ``restore_model``) of the checkpoint at ``step``, or, with no step
    named (by ``step`` or by a step folder as ``path``), of the newest checkpoint that
    restores: newer damaged ones are skipped with a warning, left as they are. The model
    computes in ``compute_dtype`` (default float32), or ``as_trained`` in the run's own
    model.dtype."""
    checkpoint_dir, named_step = _locate(path)

    def attempt(s: int | None):
        saved = open_run(path, s)
        dtype = saved.config.model.dtype if as_trained else compute_dtype
        return saved, restore_model(saved, dtype, architecture_only)

    if step is not None or named_step is not None:
        return attempt(step)
    if not os.path.isdir(checkpoint_dir):
        raise UserError(f"{path}: no checkpoints ({checkpoint_dir} does not exist)")

    return newest_restorable(checkpoint_dir, attempt, warn)


def newest_restorable(checkpoint_dir: str, attempt: Callable[[int], Any],
                      warn: Callable[[str], Any] | None = None) -> Any:
    """``attempt(step)`` for the checkpoint folder's steps, newest first, until one does not
    raise UserError: a read-only tool's fallback over damaged checkpoints (the trainer's
    own, which also sets them aside, is the run checkpointer's restore_newest). Each one
    skipped is a warning (stderr by default); with none left, UserError names every step
    and why.

    A running trainer rotates its checkpoints (``checkpoint.keep``) while this reads: a step
    whose folder vanished during its read was deleted, not damaged, so it is passed over
    without a warning, and once every listed step is tried the folder is listed again, so
    that steps saved meanwhile are read rather than reporting that nothing restores."""
    warn = warn or (lambda line: print(line, file=sys.stderr, flush=True))

    def attempt_or_why(step: int) -> tuple[Any, str | None]:
        try:
            return attempt(step), None
        except (UserError, OSError) as e:
            if not os.path.isdir(os.path.join(checkpoint_dir, str(step))):
                return None, DELETED_WHILE_READ
            if not isinstance(e, UserError):
                raise
            # the reason without the "<folder> step N: " it starts with
            return None, re.sub(rf"^.*?step {step}: ", "", one_line(e), count=1)

    tried, skipped = set(), []
    for _ in range(LISTINGS):
        try:
            steps = [s for s in saved_steps(checkpoint_dir) if s not in tried]
        except UserError:
            if not tried:
                raise
            break  # every step deleted and none saved since
        if not steps:
            break
        tried.update(steps)
        step, result, failed = newest_that_restores(steps, attempt_or_why)
        skipped += failed
        if step is not None:
            for bad, why in skipped:
                if why != DELETED_WHILE_READ:
                    warn(f"warning: checkpoint {bad} in {checkpoint_dir} cannot be restored "
                         f"({why}); skipped (left as it is), using step {step}")
            return result
    raise UserError(f"{checkpoint_dir}: no checkpoint restores: "
                    + "; ".join(f"step {bad}: {why}" for bad, why in sorted(skipped, reverse=True)))


# A step deleted by the trainer's rotation while a reader read it; and how often a reader
# lists the folder again when every step it listed was deleted or damaged meanwhile.
DELETED_WHILE_READ = "deleted while it was read (the trainer's checkpoint.keep rotation)"
LISTINGS = 5


def saved_steps(checkpoint_dir: str) -> list[int]:
    """The checkpoint folder's steps, oldest first (UserError when it has none)."""
    if not os.path.isdir(checkpoint_dir):
        raise UserError(f"{checkpoint_dir}: no checkpoint folder")
    options = ocp.CheckpointManagerOptions(create=False)
    with ocp.CheckpointManager(os.path.realpath(checkpoint_dir), options=options) as manager:
        return _steps(manager, checkpoint_dir)


def _steps(manager, checkpoint_dir: str) -> list[int]:
    steps = sorted(manager.all_steps())
    if not steps:
        raise UserError(f"no checkpoint saved yet in {checkpoint_dir}")
    return steps

