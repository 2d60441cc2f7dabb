"""Config tree: YAML loading, dotted overrides, and the one-line errors of train.py."""
import copy
import dataclasses
import pathlib
import subprocess
import sys

import pytest
import yaml

from lp_jax.config.schema import PrecisionConfig, TrainConfig
from lp_jax.config.yaml_io import all_keys, dump_yaml, from_dict, load_config
from lp_jax.errors import UserError
from lp_jax.recipes import BRIDGE_NAMES, get_recipe
from lp_jax.training import api, cli
from lp_jax.training.validate import resolve

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_shipped_configs_load_and_round_trip():
    names = {p.stem for p in CONFIGS}
    assert {"tiny", "tiny_bf16", "tiny_fp8_cs", "tiny_fp8_block", "tiny_mxfp8", "tiny_nvfp4",
            "llama3_8b_bf16", "llama3_8b_fp8_cs", "llama3_8b_fp8_block", "llama3_8b_mxfp8",
            "llama3_8b_nvfp4"} <= names
    for path in CONFIGS:
        config = load_config(path)
        assert from_dict(TrainConfig, yaml.safe_load(dump_yaml(config))) == config, path


@pytest.mark.parametrize("recipe", ["bf16", "fp8_cs", "fp8_block", "mxfp8", "nvfp4"])
def test_llama3_8b_configs_carry_the_bridge_recipe(recipe):
    c = load_config(ROOT / f"configs/llama3_8b_{recipe}.yaml")
    assert c.precision.recipe == recipe and c.model.preset == "llama3_8b"
    assert (c.data.seq_len, c.data.global_batch_size) == (8192, 768)
    assert (c.optimizer.b1, c.optimizer.b2, c.optimizer.eps) == (0.9, 0.95, 1e-8)
    assert (c.optimizer.weight_decay, c.optimizer.clip_grad_norm) == (0.033, 1.0)
    s = c.schedule
    assert (s.init_lr, s.peak_lr, s.min_lr, s.warmup_steps, s.decay) == (0.0, 6e-4, 6e-6, 2000, "cosine")
    assert s.decay_steps is None  # cosine to min_lr at the last step
    assert c.model.param_dtype == "float32"
    assert c.model.fused_projections is True  # Megatron's linear_qkv and linear_fc1
    # Transformer Engine's per-rank amaxes and Bridge's presets' fp8/fp4_param_gather: on for
    # FP8-CS and MXFP8, off for FP8 block and NVFP4 (no effect on BF16)
    expected = {"bf16": (None, None), "fp8_cs": ("local", True), "mxfp8": ("local", True),
                "fp8_block": ("local", False), "nvfp4": ("local", False)}[recipe]
    assert (c.precision.amax_scope, c.precision.param_gather) == expected
    # Bridge's 8B layout: data parallelism with the distributed optimizer (docs/scaling.md).
    m = c.mesh
    assert (m.data, m.fsdp, m.tensor, m.shard_optimizer) == (-1, 1, 1, True)
    # The plan's fastest setting that fits 8 GB200s with 10% free (docs/plan.md): the MLP
    # block rebuilt in the backward, BF16 at micro-batch 2 and the quantized recipes at 4;
    # FP8 block (not measured again) keeps MXFP8's former layout.
    assert (c.model.scan_layers, c.model.attention_impl) == (True, "cudnn")
    expected = {"bf16": (2, "mlp"), "fp8_block": (2, "elementwise")}.get(recipe, (4, "mlp"))
    assert (c.data.micro_batch_size, c.model.remat) == expected


@pytest.mark.parametrize("path", [p for p in CONFIGS if p.stem.startswith("tiny")], ids=lambda p: p.stem)
def test_tiny_configs_keep_global_amaxes_and_weights_quantized_from_their_bf16_cast(path):
    """The recipes' defaults: results independent of the data layout, TE's default rounding."""
    c = load_config(path)
    assert (c.precision.amax_scope, c.precision.param_gather) == (None, None)
    assert all(p.amax_scope is None and p.param_gather is None for p in c.precision_schedule)


@pytest.mark.parametrize("bridge_name, short", list(BRIDGE_NAMES.items()))
def test_llama3_8b_configs_and_the_api_quantize_each_operand_as_bridge(bridge_name, short):
    """The shipped 8B config and the Bridge API's config resolve to the recipe of Bridge's
    name: the same format for every GEMM operand (the subchannel recipe's E5M2 gradients
    included) and the same FiLj policy."""
    bridge = get_recipe(bridge_name)
    configs = (load_config(ROOT / f"configs/llama3_8b_{short}.yaml"),
               api.llama3_8b_low_precision_pretrain_config(bridge_name, mock=True))
    for config in configs:
        recipe = resolve(config, check_files=False).phases[0].recipe
        assert (recipe.operand_specs(), recipe.policy) == (bridge.operand_specs(), bridge.policy)


def test_overrides_are_typed_and_nested():
    c = load_config(ROOT / "configs/tiny.yaml", [
        "steps=20", "stop_at=10", "precision=nvfp4", "precision.last_bf16_layers=1",
        "schedule.peak_lr=6e-4", "data.paths=a/*.txt", "model.scan_layers=true",
        "precision_schedule=[{from_step: 15, recipe: bf16}]", "debug.inject_nan_at_steps=[3]"])
    assert (c.steps, c.stop_at) == (20, 10)
    assert c.precision == PrecisionConfig(recipe="nvfp4", last_bf16_layers=1)
    assert c.schedule.peak_lr == 6e-4 and isinstance(c.schedule.peak_lr, float)
    assert c.data.paths == ("a/*.txt",)
    assert c.model.scan_layers is True
    assert c.precision_schedule[0].from_step == 15 and c.precision_schedule[0].recipe == "bf16"
    assert c.debug.inject_nan_at_steps == (3,)
    # `precision=<name>` keeps the FiLj override given before it.
    c2 = load_config(None, ["precision.last_bf16_layers=2", "precision=mxfp8"])
    assert c2.precision == PrecisionConfig(recipe="mxfp8", last_bf16_layers=2)
    assert dataclasses.is_dataclass(c2) and hash(c2) == hash(c2)  # frozen, hashable


@pytest.mark.parametrize("override, message", [
    ("stepz=3", "unknown config key 'stepz'; did you mean 'steps'?"),
    ("optimizer.lr=1", "did you mean 'schedule.peak_lr'?"),
    ("checkpoint.evry=3", "did you mean 'checkpoint.every'"),
    ("steps=abc", "config key 'steps' must be an integer, got 'abc'"),
    ("steps=2.5", "config key 'steps' must be an integer"),
    ("steps=true", "config key 'steps' must be an integer"),
    ("model.scan_layers=1", "config key 'model.scan_layers' must be true or false"),
    ("data.paths=[1]", "config key 'data.paths[0]' must be a string"),
    ("steps.x=1", "config key 'steps' has no sub-keys"),
    ("model=3", "config key 'model' must be a mapping"),
    ("novalue", "override 'novalue' must look like key=value"),
])
def test_bad_overrides_raise_one_line(override, message):
    with pytest.raises(UserError) as info:
        load_config(None, [override])
    assert message in str(info.value) and "\n" not in str(info.value)


def test_bad_yaml_files(tmp_path):
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "broken.yaml").write_text("steps: [1,\n")
    (tmp_path / "typo.yaml").write_text("data:\n  seq_lenn: 5\n")
    for name, message in (("list", "must hold a mapping"), ("broken", "is not valid YAML"),
                          ("typo", "unknown config key 'data.seq_lenn'; did you mean 'data.seq_len'"),
                          ("missing", "does not exist")):
        with pytest.raises(UserError, match=message):
            load_config(tmp_path / f"{name}.yaml")


@pytest.mark.parametrize("override, message", [
    ("stepz=3", "unknown config key 'stepz'"),
    ("steps=abc", "must be an integer"),
    ("steps=0", "steps=0 is invalid"),
    ("stop_at=99999", "stop_at=99999 is invalid"),
    ("data.source=web", "data.source='web' is invalid: choose one of text, tokens, megatron, mock"),
    ("optimizer.on_nonfinite=ignore", "choose one of skip, stop"),
    ("schedule.decay=step", "choose one of cosine, linear, constant"),
    ("schedule.decay_steps=0", "schedule.decay_steps=0 is invalid"),
    ("model.dtype=float8", "model.dtype='float8' is invalid"),
    ("checkpoint.every=0", "checkpoint.every=0 is invalid"),
    ("mesh.tp_reduce_dtype=fp16", "mesh.tp_reduce_dtype='fp16' is invalid: choose one of bf16, fp32"),
])
def test_cli_config_errors_exit_2_without_traceback(override, message, capsys):
    assert cli.main(["--config", str(ROOT / "configs/tiny.yaml"), override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("train.py: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_train_py_subprocess_exit_code_2():
    # The real entry point: status 2 and one line on stderr, before JAX is even imported.
    proc = subprocess.run([sys.executable, "train.py", "--config", "configs/tiny.yaml", "optimizer.lerning_rate=1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "train.py: error: unknown config key 'optimizer.lerning_rate'; did you mean 'schedule.peak_lr'?"]


def test_docs_list_every_config_key():
    doc = (ROOT / "docs/training.md").read_text()
    keys = all_keys()
    leaves = [k for k in keys if not any(other.startswith(k + ".") for other in keys)]
    missing = [k for k in leaves + ["precision", "precision_schedule"] if f"`{k}`" not in doc]
    assert not missing, f"docs/training.md does not document {missing}"


def test_a_saved_config_without_a_newer_key_counts_it_at_its_default():
    from lp_jax.config.yaml_io import to_dict, with_defaults
    current = to_dict(load_config("configs/tiny.yaml"))
    older = copy.deepcopy(current)
    del older["mesh"]["tensor"]  # written before the key existed
    assert older != current and with_defaults(older) == current
    older["mesh"]["fsdp"] = 2  # a real difference still shows
    assert with_defaults(older)["mesh"]["fsdp"] == 2 and with_defaults(older) != current
    removed = dict(current, retired_key=1)  # a key since removed: compared as saved
    assert with_defaults(removed) is removed


@pytest.mark.parametrize("overrides, message", [
    (["precision=fp8_cs", "precision.backend=cudnn"], "backend='cudnn' cannot run recipe 'fp8_cs'"),
    (["precision=nvfp4", "precision.last_bf16_layers=1", "precision.backend=xla_fp8"],
     "backend='xla_fp8' cannot run recipe 'nvfp4'"),
    (["precision=mxfp8", "precision.backend=cublas"], "backend='cublas' is not valid"),
    (["precision=mxfp8", "precision.backend=cudnn", "platform=tpu"], "backend 'cudnn' cannot run on 'tpu'"),
])
def test_precision_backend_is_checked_against_the_recipe_and_the_devices(overrides, message, tmp_path,
                                                                          monkeypatch):
    from lp_jax.gemm import backends
    from lp_jax.training.validate import resolve

    if "platform=tpu" in overrides:  # as if this process's devices were TPUs
        overrides.remove("platform=tpu")
        monkeypatch.setattr(backends, "current_platform", lambda: "tpu")
    config = load_config(None, [f"run_dir={tmp_path}", "data.source=mock", *overrides])
    with pytest.raises(UserError) as info:
        resolve(config)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_precision_backend_reaches_the_recipe(tmp_path):
    from lp_jax.training.validate import resolve

    plan = resolve(load_config(None, [f"run_dir={tmp_path}", "data.source=mock", "precision=mxfp8",
                                      "precision.backend=cudnn"]))
    assert plan.phases[0].recipe.backend == "cudnn"
    assert resolve(load_config(None, [f"run_dir={tmp_path}", "data.source=mock"])).phases[0].recipe.backend == "auto"
