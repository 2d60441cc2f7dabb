"""The Python API, in the shape Megatron Bridge users know.

    from lp_jax.training.api import llama3_8b_low_precision_pretrain_config, pretrain

    config = llama3_8b_low_precision_pretrain_config(
        mixed_precision_recipe="bf16_with_mxfp8_mixed",
        train_iters=1000, lr_warmup_iters=100, lr_decay_iters=1000, mock=True)
    pretrain(config)

The keywords and their defaults are those of Bridge's ``_llama3_common``
(``megatron.bridge.recipes.llama.llama3``); the result is our frozen TrainConfig
(``override`` changes it), and any other config key is a keyword with ``__`` for the dots
(``model__preset="tiny"``). docs/training.md, "The same from Python", lists the differences.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

from lp_jax.config.schema import TrainConfig
from lp_jax.config.yaml_io import apply_overrides, load_config, set_dotted
from lp_jax.errors import UserError
from lp_jax.parallel.distributed import maybe_initialize
from lp_jax.recipes import BRIDGE_NAMES
from lp_jax.training.loop import run
from lp_jax.training.validate import resolve

BRIDGE_RECIPES = BRIDGE_NAMES  # Megatron Bridge's mixed-precision recipe names -> ours


def llama3_8b_low_precision_pretrain_config(
    mixed_precision_recipe: str = "bf16_with_fp8_current_scaling_mixed",
    *,
    dir: str | None = None,
    name: str = "default",
    data_paths: Sequence[str] | None = None,
    mock: bool = False,
    train_iters: int = 1168251,
    global_batch_size: int = 768,
    micro_batch_size: int = 1,
    seq_length: int = 8192,
    lr: float = 6e-4,
    min_lr: float = 6e-6,
    adam_eps: float = 1e-8,
    lr_warmup_iters: int = 2000,
    lr_decay_iters: int | None = None,
    eval_interval: int = 2000,
    save_interval: int = 500,
    **overrides: Any,
) -> TrainConfig:
    """Llama 3 8B with Megatron Bridge's low-precision pretraining recipe (docs/numerics.md)
    in the given precision.

    With no ``data_paths`` (or ``mock=True``) the data are Bridge's mock data: random
    tokens, for benchmarks. Raises UserError (a ValueError) for an unknown recipe or key.
    """
    if mixed_precision_recipe not in BRIDGE_RECIPES:
        raise UserError(f"mixed_precision_recipe={mixed_precision_recipe!r} is not one of "
                        f"{', '.join(BRIDGE_RECIPES)}")
    use_mock = mock or not data_paths
    run_dir = os.path.join(dir if dir is not None else "runs", name)
    config = load_config(None, [
        f"run_dir={run_dir}",
        "seed=1234",
        f"steps={train_iters}",
        f"precision={mixed_precision_recipe}",
        # Transformer Engine's per-rank amaxes and Bridge's fp8/fp4_param_gather (weights
        # quantized from the FP32 masters, gathered as FP8/FP4 bytes); no effect on BF16.
        "precision.amax_scope=local", "precision.param_gather=true",
        "model.preset=llama3_8b",
        f"data.source={'mock' if use_mock else 'tokens'}",
        "data.tokenizer=llama3",
        f"data.seq_len={seq_length}",
        f"data.global_batch_size={global_batch_size}",
        f"data.micro_batch_size={micro_batch_size}",
        "optimizer.b1=0.9", "optimizer.b2=0.95", f"optimizer.eps={adam_eps}",
        "optimizer.weight_decay=0.033", "optimizer.clip_grad_norm=1.0",
        f"schedule.peak_lr={lr}", f"schedule.min_lr={min_lr}", "schedule.init_lr=0.0",
        f"schedule.warmup_steps={lr_warmup_iters}",
        f"schedule.decay_steps={'null' if lr_decay_iters is None else lr_decay_iters}",
        "schedule.decay=cosine",
        f"checkpoint.every={save_interval}",
        f"logging.val_every={eval_interval}", "logging.val_batches=32",
        # Bridge's 8B layout: data parallelism with the distributed optimizer, ZeRO-1
        # (one gradient reduction and one weight gather per step; docs/scaling.md).
        "mesh.data=-1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.shard_optimizer=true",
    ])
    if not use_mock:
        config = set_dotted(config, "data.paths", list(data_paths))
    for key, value in overrides.items():
        config = set_dotted(config, key.replace("__", "."), value)
    return config


def override(config: TrainConfig, *items: str) -> TrainConfig:
    """A copy with ``key=value`` overrides applied, exactly as on the command line."""
    return apply_overrides(config, items)


def load(path: str, *items: str) -> TrainConfig:
    """A YAML config (``configs/tiny.yaml``) with overrides, as train.py reads it."""
    return load_config(path, items)


def pretrain(config: TrainConfig):
    """Validates and runs ``config`` (resuming from its run folder's latest checkpoint, if
    any) and returns the RunResult. Config problems raise UserError before compiling."""
    maybe_initialize(config.distributed)
    return run(resolve(config))
