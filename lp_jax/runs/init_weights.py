"""A new run that starts from existing weights: `init.hf=HF_DIR` (a Hugging Face Llama folder,
or a Qwen3-MoE one for model.type=moe) or `init.checkpoint=RUN_DIR[@STEP]` (another run's FP32
masters).

Only the weights are taken: optimizer moments, step counters, schedule and data order
start fresh. The architecture is the weights'; set `model.*` keys override it where the
weights allow. `model_config` checks everything while the config is validated (UserError,
one line); `load` runs once, when the loop builds a fresh run (docs/training.md, "Starting
from other weights").
"""
from __future__ import annotations

import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import traversals

from lp_jax.config.schema import MOCK_SOURCES, TrainConfig
from lp_jax.data.tokenizers import get_tokenizer
from lp_jax import model_registry
from lp_jax.errors import UserError
from lp_jax.runs.run_folder import checkpoint_folder, open_and_restore, open_run, split_step
from models.config import SHAPE_FIELDS
from models.fused_projections import layout_name, value_at
from models.hf import HFError, check_tensors, read_hf_config, read_params
from models.hf_config import ARCHITECTURES, config_from_hf

# Encoded by both tokenizers to tell whether they are the same vocabulary: ASCII code,
# whitespace runs, accented, CJK and emoji text, so byte-level and BPE tokenizers differ.
PROBE = "def main(argv):\n    return 0  # Größe, naïve café; 日本語のテキスト 🙂 \t\r\n  end."


def requested(c: TrainConfig) -> bool:
    return bool(c.init.hf or c.init.checkpoint)


def _source_key(c: TrainConfig) -> str:
    return f"init.hf={c.init.hf}" if c.init.hf else f"init.checkpoint={c.init.checkpoint}"


def model_config(c: TrainConfig, tokenizer):
    """The LlamaConfig of the run: the source's architecture, the set model keys applied,
    checked against the weights and the run's tokenizer (UserError, one line)."""
    if c.init.hf and c.init.checkpoint:
        raise UserError("init.hf and init.checkpoint are both set; choose one source of weights")
    model_registry.model_family(c.model.type)  # UserError for a type not registered
    if c.init.hf:
        model_registry.check_hf_checkpoints(c.model.type, f"init.hf={c.init.hf}")
    resumed = _own_checkpoint(c)
    if resumed is not None:  # the source was read when the run started and may be gone since
        return _with_overrides(resumed.model_config, c, f"the run's checkpoint {resumed.step}")
    key = _source_key(c)
    if c.init.hf:
        source, source_tokenizer = _hf_source(c.init.hf, key)
        _check_family(source, c.model.type, key)
    else:
        source, source_tokenizer = _run_source(c.init.checkpoint, key, c.model.type)
    cfg = _with_overrides(source, c, key)
    if tokenizer is not None:
        _check_vocabulary(cfg, tokenizer, source_tokenizer, key)
    if c.init.hf:
        try:
            check_tensors(c.init.hf, cfg)
        except HFError as e:
            raise UserError(f"{key}: {e}") from None
    return cfg


def _own_checkpoint(c: TrainConfig):
    """The run's latest checkpoint when the loop will resume from it, else None."""
    directory = checkpoint_folder(c.run_dir, c.checkpoint.dir)
    if not c.checkpoint.resume or not os.path.isdir(directory) or not any(
            name.isdigit() for name in os.listdir(directory)):
        return None
    try:
        return open_run(directory)
    except UserError as e:
        raise UserError(f"resuming {c.run_dir}: {e}") from None


def _hf_source(path: str, key: str):

    if not os.path.isdir(path):
        raise UserError(f"{key}: no such folder")
    try:
        cfg = config_from_hf(read_hf_config(path), dtype=jnp.bfloat16, param_dtype=jnp.float32)
    except HFError as e:
        raise UserError(f"{key}: {e}") from None
    tokenizer_file = os.path.join(path, "tokenizer.json")
    return cfg, (f"hf:{tokenizer_file}" if os.path.isfile(tokenizer_file) else None)


def _check_family(source, model_type: str, key: str) -> None:
    """A Qwen3-MoE folder starts model.type=moe, a Llama folder any other family that takes
    Hugging Face checkpoints."""
    moe_weights = bool(source.num_experts)
    if moe_weights != (model_type == "moe"):
        arch = ARCHITECTURES["qwen3_moe" if moe_weights else "llama"]
        raise UserError(f"{key}: the folder holds a {arch}, which model.type="
                        f"{'moe' if moe_weights else 'llama'} builds, not model.type={model_type!r}")


def _run_source(spec: str, key: str, model_type: str):
    try:
        saved = open_run(*split_step(spec))
    except UserError as e:
        raise UserError(f"{key}: {e}") from None
    if saved.config.model.type != model_type:
        raise UserError(f"{key}: its weights are model.type={saved.config.model.type!r}, "
                        f"the run's is {model_type!r}")
    source_tokenizer = None if saved.config.data.source in MOCK_SOURCES else saved.config.data.tokenizer
    return saved.model_config, source_tokenizer


def _with_overrides(source, c: TrainConfig, key: str):
    overrides = c.model.overrides()
    for name in SHAPE_FIELDS:
        if name in overrides and overrides[name] != getattr(source, name):
            raise UserError(f"model.{name}={overrides[name]!r} does not fit the weights of {key} "
                            f"({name} {getattr(source, name)!r}); leave it unset")
    overrides.update(dtype=jnp.dtype(c.model.dtype), param_dtype=jnp.dtype(c.model.param_dtype))
    try:
        return source.replace(**overrides)
    except (TypeError, ValueError) as e:
        raise UserError(f"model: {' '.join(str(e).split())}") from None


def _check_vocabulary(cfg, tokenizer, source_tokenizer: str | None, key: str) -> None:
    """The run's tokenizer must index the weights' embedding rows as their own did."""
    if tokenizer.vocab_size > cfg.vocab_size:
        raise UserError(f"{key}: the weights have a vocabulary of {cfg.vocab_size} ids, fewer "
                        f"than the {tokenizer.vocab_size} of data.tokenizer {tokenizer.name!r}")
    if source_tokenizer is None or source_tokenizer == tokenizer.name:
        return  # nothing to compare with (no tokenizer.json, mock data), or the same one
    try:
        size, ids = _encode_probe(source_tokenizer)
    except Exception as e:  # noqa: BLE001 (the tokenizers library raises plain Exceptions)
        raise UserError(f"{key}: cannot read the weights' tokenizer {source_tokenizer!r}: "
                        f"{' '.join(str(e).split())}") from None
    if (size, ids) != (tokenizer.vocab_size, list(tokenizer.encode(PROBE))):
        raise UserError(f"{key}: the weights were trained with tokenizer {source_tokenizer!r} "
                        f"({size} ids), which encodes text differently from data.tokenizer "
                        f"{tokenizer.name!r} ({tokenizer.vocab_size} ids); set "
                        f"data.tokenizer={source_tokenizer}")


def _encode_probe(name: str) -> tuple[int, list[int]]:
    """(vocabulary size, ids of PROBE) of a data.tokenizer value."""
    if name.startswith("hf:"):  # read directly: a folder's tokenizer may lack a BOS name
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(name[3:])
        return tok.get_vocab_size(with_added_tokens=True), tok.encode(
            PROBE, add_special_tokens=False).ids
    tok = get_tokenizer(name)
    return tok.vocab_size, list(tok.encode(PROBE))


def load(plan, state: dict, say: Callable[[str], Any] = print) -> dict:
    """A fresh train state with its parameters replaced by the source's (cast to the masters'
    dtype, placed with the state's shardings); everything else, the optimizer moments
    included, stays as freshly initialized. Returns `state` unchanged without a source."""
    c = plan.config
    if not requested(c):
        return state
    if c.init.hf:
        arrays, where = _hf_params(c.init.hf, plan.model_config), f"init.hf={c.init.hf}"
    else:
        arrays, where = _run_params(c.init.checkpoint, plan.model_config)
    say(f"weights from {where}; optimizer moments and learning-rate schedule start fresh")
    return {**state, "params": _placed(state["params"], arrays, plan.model_config)}


def _hf_params(path: str, cfg):
    """The folder's weights; checked when the config was, but read only now (it may have
    changed since)."""
    try:
        return read_params(path, cfg)
    except HFError as e:
        raise UserError(f"init.hf={path}: {e}") from None


def _run_params(spec: str, model_config):
    """The source run's parameters as host arrays (restored through the first device), in
    the source's projection layout (``_placed`` converts them)."""

    saved, model = open_and_restore(*split_step(spec))
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    where = f"init.checkpoint={spec} (step {saved.step}, trained in {saved.recipe})"
    fused = getattr(saved.model_config, "fused_projections", False)
    if fused != model_config.fused_projections:
        where += (f", its {layout_name(fused)} projections converted exactly to "
                  f"{layout_name(model_config.fused_projections)}")
    return {path: np.asarray(var[...]) for path, var in flat}, where


def _placed(params, arrays: dict[tuple, Any], model_config):
    """`params` (an nnx.State of sharded arrays) with every leaf replaced by the host array
    of the same path (q/k/v and gate/up joined or split where the layouts differ), each
    device receiving only its own slice of it (an FSDP-sharded 8B run never gathers the
    whole model on one device)."""
    flat = {}
    for path, var in nnx.to_flat_state(params):
        old, new = var[...], value_at(path, arrays, model_config)
        if tuple(new.shape) != tuple(old.shape):  # validation should have caught it
            raise ValueError(f"initial weight {'/'.join(map(str, path))} has shape {new.shape}, "
                             f"the model needs {old.shape}")
        new = new.astype(old.dtype)
        flat[path] = jax.make_array_from_callback(old.shape, old.sharding, lambda i, a=new: a[i])
    nnx.replace_by_pure_dict(params, traversals.unflatten_mapping(flat))  # keeps the Param types
    return params
