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
# Bridge's presets' fp8_param_gather (fp4_param_gather for NVFP4, left at its default False).
BRIDGE_PARAM_GATHER = {"bf16_mixed": False, "bf16_with_fp8_current_scaling_mixed": True,
                       "bf16_with_fp8_subchannel_scaling_mixed": False, "bf16_with_mxfp8_mixed": True,
                       "bf16_with_nvfp4_mixed": False}


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

    With no ``data_paths`` (or ``mock=True``) the data are Megatron's mock documents, as
    Bridge's mock data are (``data.source=mock``: ascending ids, random lengths, EOD).
    Documents are packed as Bridge packs them (plain causal attention over a sequence,
    positions running on, every target scored) and a non-finite gradient stops the run,
    as Bridge's ``check_for_nan_in_grad`` does. Raises UserError (a ValueError) for an
    unknown recipe or key.
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
        # Transformer Engine's per-rank amaxes and Bridge's fp8/fp4_param_gather (on: weights
        # quantized from the FP32 masters, gathered as FP8/FP4 bytes); no effect on BF16.
        "precision.amax_scope=local",
        f"precision.param_gather={str(BRIDGE_PARAM_GATHER[mixed_precision_recipe]).lower()}",
        "model.preset=llama3_8b", "model.fused_projections=true",  # linear_qkv, linear_fc1
        f"data.source={'mock' if use_mock else 'tokens'}",
        "data.tokenizer=llama3",
        f"data.seq_len={seq_length}",
        f"data.global_batch_size={global_batch_size}",
        f"data.micro_batch_size={micro_batch_size}",
        # Bridge's GPTDatasetConfig: reset_attention_mask, reset_position_ids, eod_mask_loss.
        "data.reset_attention_mask=false", "data.reset_position_ids=false",
        "data.eod_mask_loss=false",
        "optimizer.b1=0.9", "optimizer.b2=0.95", f"optimizer.eps={adam_eps}",
        "optimizer.weight_decay=0.033", "optimizer.clip_grad_norm=1.0",
        "optimizer.on_nonfinite=stop",  # Bridge's ddp.check_for_nan_in_grad raises
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
