"""Checks a TrainConfig against the model, the recipes, the devices and the data, and
resolves it into a ValidatedRun, before anything is compiled.

Every problem is a UserError with one line naming the key, the bad value and what is
allowed; train.py prints it and exits with status 2.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

import jax
import yaml

import lp_jax
from lp_jax.config.recipe_options import split_overrides
from lp_jax.config.schema import (
    EP_DISPATCH_DTYPES,
    MOCK_SOURCES,
    TP_REDUCE_DTYPES,
    PrecisionConfig,
    TrainConfig,
)
from lp_jax.config.yaml_io import from_dict
from lp_jax.data import megatron, shards
from lp_jax.data.prepare_data import split_by_file, text_files
from lp_jax.data.tokenizers import Tokenizer
from lp_jax.errors import UserError, one_line
from lp_jax.gemm import backends
from lp_jax.parallel import mesh_checks
from lp_jax.parallel.mesh import mesh_shape
from lp_jax.recipes import Recipe
from lp_jax.runs import init_weights
from lp_jax.runs.architecture import preset_model_config, run_tokenizer
from lp_jax.runs.run_folder import checkpoint_folder
from lp_jax.runs.writable import write_problem
from models.config import SHAPE_FIELDS, LlamaConfig
from models.files import folder_problem

SOURCES = ("text", "tokens", "megatron", *MOCK_SOURCES)
DECAYS = ("cosine", "linear", "constant")
ON_NONFINITE = ("skip", "stop")
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Phase:
    """A precision recipe and the first step it trains."""

    from_step: int
    name: str
    recipe: Recipe


@dataclasses.dataclass
class ValidatedRun:
    """A run's config once checked, with what was derived from it: the model, the recipe
    of each phase, the mesh and the gradient accumulation."""

    config: TrainConfig
    model_config: LlamaConfig
    tokenizer: Tokenizer | None  # None for the mock source
    phases: list[Phase]
    data_parallel: int  # ranks along the mesh's data axis
    fsdp: int
    accum_steps: int  # micro-batches per optimizer step
    tensor: int = 1  # tensor-parallel ranks (they share their batch rows)
    expert: int = 1  # expert-parallel ranks (each its own rows, and 1/expert of the experts)

    def phase_at(self, step: int) -> Phase:
        """The recipe that trains (1-based) ``step``."""
        current = self.phases[0]
        for phase in self.phases:
            if phase.from_step <= step:
                current = phase
        return current


def __getattr__(name: str) -> Any:
    # The class's former name: `python -m lp_jax.plan` is the tool, this is not a plan.
    if name == "Plan":
        warnings.warn("lp_jax.training.validate.Plan is deprecated; use ValidatedRun",
                      DeprecationWarning, stacklevel=2)
        return ValidatedRun
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def resolve(config: TrainConfig, device_count: int | None = None,
            check_files: bool = True) -> ValidatedRun:
    """The run ``config`` describes, checked: UserError (one line) for anything that cannot
    run. ``device_count`` (default: this process's devices) sizes the mesh; without
    ``check_files`` the data files and run folders are not looked at (a plan that compiles
    the step for other machines reads and writes nothing)."""
    _check_scalars(config)
    tokenizer = run_tokenizer(config)
    model_config = _model_config(config, tokenizer)
    phases = _phases(config, model_config.num_layers)
    if config.model.recompute_mlp_product is None:
        # Auto: where the kept copy would be a quantized one and no remat policy decides
        # what is kept (under one, the plan measured no saving: docs/plan.md).
        model_config = model_config.replace(recompute_mlp_product=model_config.remat == "none"
                                            and any(p.recipe.quantized for p in phases))
    data_parallel, fsdp, tensor, expert = mesh_shape(
        config.mesh.data, config.mesh.fsdp, config.mesh.tensor,
        jax.device_count() if device_count is None else device_count, expert=config.mesh.expert)
    per_pass = config.data.micro_batch_size * data_parallel * fsdp * expert
    if config.data.global_batch_size % per_pass:
        ranks = "mesh.data x mesh.fsdp" + (" x mesh.expert" if expert > 1 else "")
        raise UserError(
            f"data.global_batch_size={config.data.global_batch_size} is not divisible by "
            f"data.micro_batch_size x data-parallel ranks ({ranks}) = "
            f"{config.data.micro_batch_size} x {data_parallel * fsdp * expert} = {per_pass}")

    mesh_checks.check_heads(model_config, tensor)
    mesh_checks.check_experts(model_config, expert, config.model.type)
    mesh_checks.check_dispatch(config.mesh.ep_dispatch_dtype, expert)
    mesh_checks.check_blocks(model_config, [p.recipe for p in phases],
                             {"data": data_parallel, "fsdp": fsdp, "expert": expert, "tensor": tensor},
                             config.data.micro_batch_size, config.data.seq_len, config.model.type)
    if check_files:
        _check_data(config)
        _check_run_folders(config)
    return ValidatedRun(config, model_config, tokenizer, phases, data_parallel, fsdp,
                        config.data.global_batch_size // per_pass, tensor, expert)


def model_shape_changes(saved: dict, plan: ValidatedRun) -> list[str]:
    """``model.<field> (checkpoint A, now B)`` for ``model.type`` and each field of
    SHAPE_FIELDS in which the model of a saved config (a checkpoint's) differs from the
    plan's, both resolved the same way, so that a preset's value and the same value written
    out compare equal. [] when the saved config no longer resolves (a removed key or
    preset): the restore then decides."""
    try:
        config = from_dict(TrainConfig, saved)
    except (UserError, TypeError, ValueError):
        return []
    if config.model.type != plan.config.model.type:
        return [f"model.type (checkpoint {config.model.type}, now {plan.config.model.type})"]
    try:
        same_tokens = (config.data.source, config.data.tokenizer) == (
            plan.config.data.source, plan.config.data.tokenizer)
        saved_model = _model_config(config, plan.tokenizer if same_tokens else run_tokenizer(config))
    except (UserError, TypeError, ValueError):
        return []
    return [f"model.{f} (checkpoint {getattr(saved_model, f)}, now {getattr(plan.model_config, f)})"
            for f in SHAPE_FIELDS if getattr(saved_model, f) != getattr(plan.model_config, f)]


def _fail_unless(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise UserError(f"{key}={value!r} is invalid: {allowed}")


def _check_scalars(c: TrainConfig) -> None:
    _fail_unless(c.steps >= 1, "steps", c.steps, "must be at least 1")
    _fail_unless(c.stop_at is None or 1 <= c.stop_at <= c.steps, "stop_at", c.stop_at,
                 f"must be between 1 and steps={c.steps} (or null)")
    _fail_unless(c.seed >= 0, "seed", c.seed, "must be >= 0")
    _fail_unless(bool(c.run_dir), "run_dir", c.run_dir, "must name a folder")
    d = c.data
    _fail_unless(d.source in SOURCES, "data.source", d.source, f"choose one of {', '.join(SOURCES)}")
    _fail_unless(d.seq_len >= 1, "data.seq_len", d.seq_len, "must be at least 1")
    _fail_unless(d.global_batch_size >= 1, "data.global_batch_size", d.global_batch_size, "must be at least 1")
    _fail_unless(d.micro_batch_size >= 1, "data.micro_batch_size", d.micro_batch_size, "must be at least 1")
    _fail_unless(0 <= d.val_fraction < 1, "data.val_fraction", d.val_fraction, "must be in [0, 1)")
    _fail_unless(d.read_threads >= 0, "data.read_threads", d.read_threads, "must be >= 0")
    _fail_unless(d.token_dtype in ("uint16", "uint32", "int32"), "data.token_dtype", d.token_dtype,
                 "choose one of uint16, uint32, int32")
    # Megatron accepts this pair, but RoPE would then read an earlier document's tokens at
    # larger positions than the query's as later tokens.
    _fail_unless(d.reset_attention_mask or not d.reset_position_ids, "data.reset_position_ids",
                 d.reset_position_ids, "positions restart at each document only where attention "
                 "does too: set data.reset_attention_mask=true, or reset_position_ids=false")
    _fail_unless(c.mesh.tp_reduce_dtype in TP_REDUCE_DTYPES, "mesh.tp_reduce_dtype", c.mesh.tp_reduce_dtype,
                 f"choose one of {', '.join(TP_REDUCE_DTYPES)}")
    _fail_unless(c.mesh.ep_dispatch_dtype in EP_DISPATCH_DTYPES, "mesh.ep_dispatch_dtype",
                 c.mesh.ep_dispatch_dtype, f"choose one of {', '.join(EP_DISPATCH_DTYPES)}")
    o = c.optimizer
    _fail_unless(0 <= o.b1 < 1, "optimizer.b1", o.b1, "must be in [0, 1)")
    _fail_unless(0 <= o.b2 < 1, "optimizer.b2", o.b2, "must be in [0, 1)")
    _fail_unless(o.eps > 0, "optimizer.eps", o.eps, "must be > 0")
    _fail_unless(o.weight_decay >= 0, "optimizer.weight_decay", o.weight_decay, "must be >= 0")
    _fail_unless(o.clip_grad_norm >= 0, "optimizer.clip_grad_norm", o.clip_grad_norm, "must be >= 0 (0 disables)")
    _fail_unless(o.on_nonfinite in ON_NONFINITE, "optimizer.on_nonfinite", o.on_nonfinite,
                 f"choose one of {', '.join(ON_NONFINITE)}")
    _fail_unless(o.max_nonfinite_in_a_row >= 0, "optimizer.max_nonfinite_in_a_row",
                 o.max_nonfinite_in_a_row, "must be >= 0 (0: no limit)")
    s = c.schedule
    _fail_unless(s.decay in DECAYS, "schedule.decay", s.decay, f"choose one of {', '.join(DECAYS)}")
    for key in ("peak_lr", "min_lr", "init_lr"):
        _fail_unless(getattr(s, key) >= 0, f"schedule.{key}", getattr(s, key), "must be >= 0")
    _fail_unless(s.warmup_steps >= 0, "schedule.warmup_steps", s.warmup_steps, "must be >= 0")
    # decay_steps below warmup_steps is allowed: a short look at a long config (steps=12)
    # simply stays in the warmup.
    _fail_unless(s.decay_steps is None or s.decay_steps >= 1, "schedule.decay_steps",
                 s.decay_steps, "must be at least 1 (null means steps)")
    _fail_unless(c.checkpoint.every >= 1, "checkpoint.every", c.checkpoint.every, "must be at least 1")
    _fail_unless(c.checkpoint.keep >= 1, "checkpoint.keep", c.checkpoint.keep, "must be at least 1")
    code = c.checkpoint.preempted_exit_code
    # 1, 2 and 130 already say stopped, bad input and interrupted (lp_jax.training.cli).
    _fail_unless(0 <= code <= 255 and code not in (1, 2, 130), "checkpoint.preempted_exit_code",
                 code, "must be 0-255 and not 1, 2 or 130 (stopped, bad input, interrupted)")
    lg = c.logging
    _fail_unless(lg.every >= 1, "logging.every", lg.every, "must be at least 1")
    _fail_unless(lg.val_every >= 0, "logging.val_every", lg.val_every, "must be >= 0 (0: only at the end)")
    _fail_unless(lg.quant_stats_every >= 0, "logging.quant_stats_every", lg.quant_stats_every,
                 "must be >= 0 (0: off)")
    _fail_unless(lg.val_batches >= 0, "logging.val_batches", lg.val_batches, "must be >= 0 (0: no validation)")
    for step in c.debug.inject_nan_at_steps:
        _fail_unless(1 <= step <= c.steps, "debug.inject_nan_at_steps", step, f"steps are 1..{c.steps}")
    for key in ("dtype", "param_dtype"):
        value = getattr(c.model, key)
        _fail_unless(value in FLOAT_DTYPES, f"model.{key}", value, f"choose one of {', '.join(FLOAT_DTYPES)}")


def model_config(c: TrainConfig):
    """The LlamaConfig a run of ``c`` builds, checked as ``resolve`` checks it (without the
    devices or the data): for reading a saved run's model back."""
    return _model_config(c, run_tokenizer(c))


def _model_config(c: TrainConfig, tokenizer):
    if c.init.hf or c.init.checkpoint:
        cfg = init_weights.model_config(c, tokenizer)  # the architecture of those weights
    else:
        cfg = preset_model_config(c, tokenizer)
    _fail_unless(cfg.max_seq_len >= c.data.seq_len, "data.seq_len", c.data.seq_len,
                 f"must be <= model.max_seq_len={cfg.max_seq_len}")
    return cfg


def _phases(c: TrainConfig, num_layers: int) -> list[Phase]:
    entries = [(1, "precision", c.precision)]
    previous = 1
    for i, switch in enumerate(c.precision_schedule):
        key = f"precision_schedule[{i}]"
        _fail_unless(previous < switch.from_step <= c.steps, f"{key}.from_step", switch.from_step,
                     f"must be after the previous switch (step {previous}) and <= steps={c.steps}")
        previous = switch.from_step
        entries.append((switch.from_step, key, switch))
    phases = []
    for from_step, key, p in entries:
        phases.append(Phase(from_step, p.recipe, _recipe(p, key, num_layers)))
    return phases


def _recipe(p: PrecisionConfig, key: str, num_layers: int):
    overrides, options = split_overrides(p, key)
    overrides.pop("from_step", None)
    for where, given in ((key, overrides), (f"{key}.options", options)):
        for name in ("first_bf16_layers", "last_bf16_layers"):
            value = given.get(name)
            _fail_unless(value is None or 0 <= value <= num_layers, f"{where}.{name}", value,
                         f"must be between 0 and the model's {num_layers} layers")
        for layer in given.get("bf16_layers", ()):
            _fail_unless(0 <= layer < num_layers, f"{where}.bf16_layers", layer,
                         f"layers are 0..{num_layers - 1}")
    # The options go on top of the recipe the section's own keys make, so that get_recipe's
    # refusal of a field the recipe lacks is reported against the key that named it.
    where = key
    try:
        recipe = lp_jax.get_recipe(p.recipe, **overrides)
        where = f"{key}.options"
        recipe = lp_jax.get_recipe(recipe, **options)
        where = key
        # A forced GEMM backend must run on this process's devices (the compiled step would
        # fail there anyway; this says so before anything is built).
        if backends.resolved(recipe) != "auto":
            backends.check_platforms(backends.resolved(recipe), (backends.current_platform(),))
    except (ValueError, TypeError) as e:
        raise UserError(f"{where}: {one_line(e)}") from None
    # The recipe's own FiLj defaults (NVFP4 keeps the last 4 layers in BF16) must fit too.
    first, last = recipe.first_bf16_layers, recipe.last_bf16_layers
    if recipe.quantized and first + last > num_layers:
        raise UserError(f"{key}: layer policy {recipe.policy} of recipe {p.recipe!r} keeps "
                        f"{first + last} layers in BF16 but the model has {num_layers}; set "
                        f"{key}.first_bf16_layers / {key}.last_bf16_layers (sum <= {num_layers})")
    return recipe


def _check_data(c: TrainConfig) -> None:
    d = c.data
    if d.source == "text":
        for key, globs in (("data.paths", d.paths), ("data.val_paths", d.val_paths)):
            if globs:
                try:
                    files, root, _ = text_files(globs)
                    if key == "data.paths" and not d.val_paths:
                        split_by_file(files, root, d.val_fraction)  # one file cannot be split
                except ValueError as e:
                    raise UserError(f"{key}: {e}") from None
    elif d.source == "megatron":
        _check_megatron_data(d)
    elif d.source == "tokens":
        if not d.paths:
            raise UserError("data.paths is empty: data.source=tokens needs token shard globs "
                            "(python -m lp_jax.data.prepare_data writes them)")
        for key, globs in (("data.paths", d.paths), ("data.val_paths", d.val_paths)):
            found = shards.expand_globs(globs)
            if globs and not found:
                raise UserError(f"{key}: no file matches {', '.join(map(repr, globs))}")
            bad = [f for f in found if not f.endswith(shards.SHARD_SUFFIXES)]
            if bad:
                raise UserError(f"{key}: {bad[0]!r} is not a .npy or .bin token shard")
            for f in found:
                meta = shards.read_meta(f)
                if meta and meta.get("tokenizer") != d.tokenizer:
                    raise UserError(f"{key}: shards in {os.path.dirname(f)!r} were made with "
                                    f"tokenizer {meta.get('tokenizer')!r}, but data.tokenizer "
                                    f"is {d.tokenizer!r}")


def _check_megatron_data(d) -> None:
    """data.source=megatron: prefixes (or a blend) that open as matching .idx/.bin pairs,
    made with data.tokenizer when prepare_data's meta.json is beside them."""
    if not d.paths:
        raise UserError("data.paths is empty: data.source=megatron needs dataset prefixes "
                        "(path/to/name for name.bin and name.idx) or a blend [w1, prefix1, ...]")
    for key, entries in (("data.paths", d.paths), ("data.val_paths", d.val_paths)):
        if not entries:
            continue
        try:
            prefixes, _ = megatron.parse_blend(entries)
            for prefix in prefixes:
                megatron.open_indexed(prefix)
        except ValueError as e:
            raise UserError(f"{key}: {e}") from None
        for prefix in prefixes:
            meta = shards.read_meta(prefix)
            if meta and meta.get("tokenizer") != d.tokenizer:
                raise UserError(f"{key}: {prefix!r} was made with tokenizer "
                                f"{meta.get('tokenizer')!r}, but data.tokenizer is {d.tokenizer!r}")


def _check_run_folders(c: TrainConfig) -> None:
    """The run folder and the checkpoint folder take files (a probe write, before hours of
    training end in a save that cannot happen), the data cache is a folder, and a fresh run
    finds no checkpoints."""
    directory = checkpoint_dir(c)
    # The data cache must be a folder, but is not probed for writing: a shared read-only
    # cache that already holds the shards is fine.
    problem = folder_problem(c.data.cache_dir) if c.data.cache_dir else None
    if problem:
        raise UserError(f"data.cache_dir: {problem}")
    for key, folder in (("run_dir", c.run_dir), ("checkpoint.dir", directory)):
        problem = write_problem(folder)
        if problem:
            raise UserError(f"{key}: {problem}")
    has_checkpoints = os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))
    if not c.checkpoint.resume and has_checkpoints:
        raise UserError(f"checkpoint.resume=false but {directory!r} already holds checkpoints; "
                        "choose another run_dir or remove them")
    _refuse_links(c.run_dir)
    if not has_checkpoints:
        _refuse_another_runs_files(c, directory)


# The files a run writes in its run folder (the lock in the checkpoint folder too).
RUN_FILES = ("train.lock", "config.yaml", "metrics.jsonl")


def _refuse_links(run_dir: str) -> None:
    """A symbolic link in place of a file the run writes would have the run write into the
    file it points at (a config, another run's metrics): refused, before anything is written."""
    for name in RUN_FILES:
        path = os.path.join(run_dir, name)
        if os.path.islink(path):
            raise UserError(f"run_dir: {path} is a symbolic link (to {os.readlink(path)!r}); a "
                            "run never writes through a link: remove it, or replace it with a copy")


def _refuse_another_runs_files(c: TrainConfig, directory: str) -> None:
    """A fresh run (no checkpoint in its folder) in a run folder that holds another run's
    config.yaml and metrics.jsonl, whose checkpoints are in another folder, would overwrite
    them: refused, saying where that run's checkpoints are."""
    config_path = os.path.join(c.run_dir, "config.yaml")
    metrics_path = os.path.join(c.run_dir, "metrics.jsonl")
    if not os.path.isfile(config_path) and not os.path.isfile(metrics_path):
        return
    theirs = None
    if os.path.isfile(config_path):
        try:
            with open(config_path) as f:
                raw = yaml.safe_load(f)
            saved_dir = ((raw or {}).get("checkpoint") or {}).get("dir")
        except (OSError, ValueError, yaml.YAMLError, AttributeError):
            saved_dir = "?"  # unreadable: whose it is cannot be told, so it is not overwritten
        theirs = saved_dir if saved_dir == "?" else checkpoint_folder(c.run_dir, saved_dir)
        if theirs == directory:  # this run's own files, from before any checkpoint: a restart
            return
    rows = _count_lines(metrics_path)
    if theirs is None and not rows:
        return
    where = (f"whose checkpoints are in {theirs!r}" if theirs not in (None, "?")
             else "whose checkpoints are not in it")
    written = " and ".join(name for name, there in (("config.yaml", os.path.isfile(config_path)),
                                                    (f"metrics.jsonl ({rows} rows)", rows))
                           if there)
    raise UserError(f"run_dir {c.run_dir!r} holds another run's {written}, {where}, and "
                    f"checkpoint.dir {directory!r} holds no checkpoint: a fresh run would "
                    "overwrite them; resume that run with its checkpoint.dir, or use another run_dir")


def _count_lines(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def checkpoint_dir(c: TrainConfig) -> str:
    return checkpoint_folder(c.run_dir, c.checkpoint.dir)

