"""What one transformer layer keeps for its backward, per token, in units of the hidden size
(Megatron's way of counting activation memory: 34 for a BF16 layer, Korthikanti et al. 2022).

Measured from XLA's buffer assignment as a double difference of the step's temporaries: one
layer more, at two token counts. The layer count alone would also count the layer's
gradient and gathered-weight buffers; the token count alone would also count the logits;
what changes with both is the layer's saved activations. Every layer is quantized for this
(FiLj off), so a recipe's figure is its quantized layer's.
"""
from __future__ import annotations

import dataclasses

from lp_jax.plan.compile_step import compile_step
from lp_jax.plan.gpus import GPU

LAYERS = (2, 3)  # both scanned (a single layer is not), so the stacking is the same
ALL_QUANTIZED = ("precision.first_bf16_layers=0", "precision.last_bf16_layers=0", "precision.bf16_layers=[]")


@dataclasses.dataclass(frozen=True)
class LayerBytes:
    per_token_hidden: float  # bytes per token per hidden unit, per device
    seq_lens: tuple[int, int]
    temp_bytes: dict  # (layers, seq_len) -> temporaries per device, as compiled


def compile_layers(config_path: str, overrides: list[str], gpu: GPU, count: int, layers: int,
                   seq_len: int, cache: dict | None = None):
    """(the step compiled with ``layers`` layers, all quantized, at ``seq_len``, its plan);
    ``cache`` keeps compiles that a second measure of the same recipe reuses."""
    from lp_jax.config.yaml_io import load_config
    from lp_jax.training.validate import resolve

    key = (layers, seq_len)
    if cache is not None and key in cache:
        return cache[key]
    full = [*overrides, *ALL_QUANTIZED, f"model.num_layers={layers}", f"data.seq_len={seq_len}"]
    plan = resolve(load_config(config_path, full), device_count=count, check_files=False)
    out = compile_step(plan, gpu, count), plan
    if cache is not None:
        cache[key] = out
    return out


def layer_bytes(config_path: str, overrides: list[str], gpu: GPU, count: int,
                seq_len: int | None = None, cache: dict | None = None) -> LayerBytes:
    """Four compiles: layers 2 and 3 at ``seq_len`` (default the config's) and at half of it."""
    from lp_jax.config.yaml_io import load_config

    full = seq_len or load_config(config_path, overrides).data.seq_len
    if full % 2 or full < 16:
        raise ValueError(f"seq_len {full}: needs an even length of at least 16 to halve")
    seqs = (full // 2, full)
    temps, plan = {}, None
    for seq in seqs:
        for layers in LAYERS:
            step, plan = compile_layers(config_path, overrides, gpu, count, layers, seq, cache)
            temps[(layers, seq)] = int(step.compiled.memory_analysis().temp_size_in_bytes)
    one_layer = {seq: temps[(LAYERS[1], seq)] - temps[(LAYERS[0], seq)] for seq in seqs}
    tokens = plan.config.data.micro_batch_size * (seqs[1] - seqs[0])
    per = (one_layer[seqs[1]] - one_layer[seqs[0]]) / tokens / plan.model_config.hidden_size
    return LayerBytes(per, seqs, {f"{k[0]}x{k[1]}": v for k, v in temps.items()})
