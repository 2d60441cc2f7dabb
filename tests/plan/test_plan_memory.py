"""What a layer keeps for its backward, and cuDNN attention on every mesh the trainer
builds, compiled for B200 (deviceless; JAX's CUDA plugin, no GPU)."""
import collections
import re

import pytest

from tests.support.plan_targets import TINY, needs_plugin

pytestmark = pytest.mark.gpu_compile
# The 8B's proportions at a small width: FFN 3.5x, 4 query heads per KV head, head_dim 128.
# XLA's quantizers: "auto" picks the Pallas ones for a GPU, Mosaic GPU kernels, which a
# process links for the first SM version it compiles for, and these compile in-process.
NARROW = ["model.hidden_size=512", "model.intermediate_size=1792", "model.num_heads=4", "model.num_kv_heads=1",
          "model.head_dim=128", "model.max_seq_len=8192", "model.scan_layers=true",
          "model.attention_impl=cudnn", "data.source=mock", "data.micro_batch_size=1",
          "data.global_batch_size=1", "precision.quantize_impl=xla"]


def _gpu():
    from lp_jax.plan.gpus import GPUS
    return GPUS["b200"]


@needs_plugin
def test_a_layer_keeps_about_megatrons_bytes_and_a_quantized_one_no_more():
    from lp_jax.plan.layer_bytes import layer_bytes

    per = {r: layer_bytes(TINY, [*NARROW, f"precision.recipe={r}"], _gpu(), 1, seq_len=1024).per_token_hidden
           for r in ("bf16", "mxfp8")}
    # Megatron's BF16 layer keeps 34 bytes per token per hidden unit; float32 residuals
    # (what autodiff kept before models.activation_vjp) would put this near 100.
    assert 25 <= per["bf16"] <= 40, per
    # Its GEMM inputs are kept as FP8 (not also as BF16); what it saves there, its
    # layer's other buffers take back (docs/plan.md, "What a layer keeps").
    assert per["mxfp8"] <= 1.05 * per["bf16"], per


def _compiled(recipe, count, mesh):
    from lp_jax.config.yaml_io import load_config
    from lp_jax.plan.compile_step import compile_step
    from lp_jax.training.validate import resolve

    overrides = ["model.attention_impl=cudnn", "model.num_layers=2", "data.seq_len=256", "data.source=mock",
                 "data.global_batch_size=8", "mesh.shard_optimizer=true", f"precision.recipe={recipe}", *mesh]
    plan = resolve(load_config(TINY, overrides), device_count=count, check_files=False)
    return compile_step(plan, _gpu(), count)


MESHES = {  # the mesh, the devices, the micro-batch per data-parallel rank
    "data=2 (ZeRO-1)": (["mesh.data=2"], 2, 4),
    "fsdp=4": (["mesh.data=1", "mesh.fsdp=4"], 4, 2),
    "tensor=2": (["mesh.data=1", "mesh.tensor=2"], 2, 8),
    "data=2 fsdp=2": (["mesh.data=2", "mesh.fsdp=2"], 4, 2),
    "data=2 tensor=2": (["mesh.data=2", "mesh.tensor=2"], 4, 4),
}


@needs_plugin
@pytest.mark.parametrize("name", sorted(MESHES))
def test_cudnn_attention_compiles_on_every_mesh_without_a_dense_mask(name):
    mesh, count, micro = MESHES[name]
    step = _compiled("bf16", count, [*mesh, f"data.micro_batch_size={micro}"])
    calls = collections.Counter(re.findall(r'custom_call_target="(__cudnn\$fmha[^"]*)"', step.text))
    # Forward and backward per layer (twice per layer: the loss and the gradient), no bias.
    assert calls["__cudnn$fmhaSoftmax"] >= 2 and calls["__cudnn$fmhaSoftmaxBackward"] >= 2, calls
    assert not [c for c in calls if "Bias" in c], calls


@needs_plugin
def test_block_scaled_gemms_compile_on_the_configs_data_parallel_mesh():
    """The 8B configs' layout (mesh.data over all GPUs, ZeRO-1): the data shard_map is fully
    manual, so the cuDNN block-scaled GEMMs need no partitioner there."""
    step = _compiled("mxfp8", 2, ["mesh.data=2", "data.micro_batch_size=4", "precision.last_bf16_layers=0"])
    assert 'custom_call_target="__cudnn$blockScaledDot"' in step.text


@needs_plugin
def test_each_remat_policy_compiles_on_the_configs_mesh_and_recomputing_keeps_less():
    """Scanned layers, cuDNN attention, data=2 with ZeRO-1 (the 8B configs' layout)."""
    temp = {}
    for remat in ("none", "mlp", "megatron", "elementwise", "full"):
        step = _compiled("bf16", 2, ["mesh.data=2", "data.micro_batch_size=4", "model.scan_layers=true",
                                     f"model.remat={remat}"])
        temp[remat] = step.compiled.memory_analysis().temp_size_in_bytes
    # megatron keeps what none keeps in BF16 (docs/models.md), so it is not compared.
    assert temp["full"] < temp["elementwise"] < temp["none"], temp
    assert temp["mlp"] < temp["none"], temp
