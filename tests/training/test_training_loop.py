"""The run end to end on the tiny Llama: every recipe trains and resumes bit-exactly,
non-finite steps are skipped or stop the run, precision switches, the Python API."""
import math
import os
import sysconfig

import numpy as np
import pytest

from lp_jax.config.yaml_io import load_config
from lp_jax.runs.checkpoint import Checkpointer
from lp_jax.training import api
from lp_jax.training.loop import NonFiniteLossError, run
from lp_jax.training.metrics import read_metrics
from lp_jax.training.validate import resolve

# A few stdlib packages as text: real code, tokenized in a second.
TEXT = [os.path.join(sysconfig.get_paths()["stdlib"], p) for p in ("json/*.py", "email/*.py")]
# NVFP4's default F0L4 would leave a 4-layer model all BF16: quantize all but the last layer.
# run name: its precision overrides
RECIPES = {r: [f"precision={r}"] for r in ("bf16", "fp8_cs", "fp8_block", "mxfp8")}
RECIPES["nvfp4"] = ["precision=nvfp4", "precision.last_bf16_layers=1"]
RECIPES["nvfp4_4over6"] = [*RECIPES["nvfp4"], "precision.block_scale_search=4over6",
                           "precision.block_scale_search_on=all"]


def tiny(run_dir, cache, *overrides):
    return load_config(None, [
        f"run_dir={run_dir}", "steps=20", "seed=3", "model.preset=tiny",
        f"data.paths={TEXT}", "data.val_fraction=0.2", f"data.cache_dir={cache}",
        "data.seq_len=64", "data.global_batch_size=4", "data.micro_batch_size=2",
        "schedule.peak_lr=3e-3", "schedule.min_lr=3e-4", "schedule.warmup_steps=3",
        "checkpoint.every=5", "checkpoint.keep=2", "logging.val_every=10", "logging.val_batches=1",
        "logging.progress_bar=false", "logging.tensorboard=false", *overrides])


def losses(run_dir):
    return [m["loss"] for m in read_metrics(run_dir)]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_each_recipe_trains_and_resumes_bit_exactly(recipe, tmp_path, token_cache):
    extra = RECIPES[recipe]
    straight = run(resolve(tiny(tmp_path / "a", token_cache, *extra)))
    first = run(resolve(tiny(tmp_path / "b", token_cache, *extra, "stop_at=10")))
    assert first.step == 10 and first.stopped_early
    assert Checkpointer(tmp_path / "b" / "checkpoints", 2).latest_step() == 10
    second = run(resolve(tiny(tmp_path / "b", token_cache, *extra)))  # same command, no stop_at
    assert straight.step == second.step == 20
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert len(a) == 20 and a == b  # bit for bit, stochastic rounding included
    assert np.mean(a[-3:]) < a[0] - 1.0  # and it learns
    val_a = [m.get("val_loss") for m in read_metrics(tmp_path / "a")]
    assert val_a == [m.get("val_loss") for m in read_metrics(tmp_path / "b")]
    assert val_a[9] is not None and val_a[19] is not None and val_a[19] < val_a[9]


# The tests below stop runs of the same 20-step config with stop_at (which changes nothing
# else), so in one process they share the compiled step of the bf16 resume test.

def test_nonfinite_step_is_skipped_and_never_saved(tmp_path, token_cache):
    config = tiny(tmp_path, token_cache, "stop_at=6", "checkpoint.every=3",
                  "debug.inject_nan_at_steps=[3]")
    result = run(resolve(config))
    assert result.nonfinite_steps == 1 and result.step == 6
    m = read_metrics(tmp_path)
    assert m[2]["loss"] == "nan" and m[2]["nonfinite_steps"] == 1
    assert all(math.isfinite(x["loss"]) for i, x in enumerate(m) if i != 2)
    assert m[3]["lr"] == m[2]["lr"]  # the skipped step did not advance the schedule
    # The periodic save at 3, the skipped step, is not written (a non-finite streak is open
    # there); 6 is, and holds a finite state: Checkpointer.save refuses anything else
    # (test_training_checkpoint).
    ckpt = Checkpointer(tmp_path / "checkpoints", 2)
    assert ckpt.all_steps() == [6]
    ckpt.close()


def test_validation_standard_error_over_batches(tmp_path, token_cache):
    """Two validation batches: the loss is their mean and the standard error half their
    difference, so the one-batch run's loss (the first batch alone) is one of mean +- se."""
    vals = {}
    for n in (1, 2):
        run(resolve(tiny(tmp_path / str(n), token_cache, "stop_at=2", "logging.val_every=2",
                         f"logging.val_batches={n}")))
        vals[n] = read_metrics(tmp_path / str(n))[-1]
    assert "val_loss_stderr" not in vals[1]
    mean, se = vals[2]["val_loss"], vals[2]["val_loss_stderr"]
    assert se > 0
    assert min(abs(vals[1]["val_loss"] - (mean - se)), abs(vals[1]["val_loss"] - (mean + se))) \
        <= 1e-5 * mean


def test_nonfinite_step_can_stop_the_run(tmp_path, token_cache):
    config = tiny(tmp_path, token_cache, "stop_at=6", "checkpoint.every=2",
                  "debug.inject_nan_at_steps=[3]", "optimizer.on_nonfinite=stop")
    with pytest.raises(NonFiniteLossError, match="step 3: loss nan"):
        run(resolve(config))
    ckpt = Checkpointer(tmp_path / "checkpoints", 2)
    assert ckpt.all_steps() == [2]  # nothing written at or after the bad step
    ckpt.close()


@pytest.mark.slow
def test_precision_schedule_switches_recipe_across_a_resume(tmp_path, token_cache):
    extra = ["precision=mxfp8", "precision_schedule=[{from_step: 5, recipe: bf16}]"]
    plan = resolve(tiny(tmp_path, token_cache, *extra))
    assert [(p.from_step, p.name) for p in plan.phases] == [(1, "mxfp8"), (5, "bf16")]
    assert plan.phase_at(4).name == "mxfp8" and plan.phase_at(5).name == "bf16"
    run(resolve(tiny(tmp_path, token_cache, *extra, "stop_at=4")))  # an MXFP8 checkpoint ...
    result = run(resolve(tiny(tmp_path, token_cache, *extra, "stop_at=7")))  # ... resumed in BF16
    assert result.step == 7 and [m["step"] for m in read_metrics(tmp_path)] == list(range(1, 8))
    assert all(math.isfinite(m["loss"]) for m in read_metrics(tmp_path))


@pytest.mark.parametrize("override, message", [
    ("precision.last_bf16_layers=9", "precision.last_bf16_layers=9 is invalid: must be between 0 and the model's 4 layers"),
    ("precision=fp9", "unknown recipe 'fp9'"),
    ("precision.disable_rht=true", "has no field 'disable_rht'"),
    ("data.micro_batch_size=3", "not divisible by data.micro_batch_size"),
    ("data.paths=[/nonexistent/*.txt]", "data.paths: no file matches"),
    ("data.source=tokens", "data.paths: "),
    ("model.preset=huge", "unknown preset 'huge'"),
    ("model.remat=sometimes", "model: remat='sometimes'"),
    ("data.seq_len=4096", "must be <= model.max_seq_len=256"),
    ("data.tokenizer=hf:/no/tokenizer.json", "data.tokenizer: tokenizer file"),
    ("precision_schedule=[{from_step: 99, recipe: bf16}]", "from_step=99 is invalid"),
])
def test_config_errors_found_before_compiling(override, message, tmp_path, token_cache):
    from lp_jax.errors import UserError

    with pytest.raises(UserError) as info:
        resolve(tiny(tmp_path, token_cache, override))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_filj_must_fit_the_model(tmp_path, token_cache):
    from lp_jax.errors import UserError

    resolve(tiny(tmp_path, token_cache, "precision=nvfp4"))  # F0L4 on 4 layers: legal (all BF16)
    with pytest.raises(UserError, match="layer policy F1L4 of recipe 'nvfp4' keeps 5 layers in "
                                          "BF16 but the model has 4"):
        resolve(tiny(tmp_path, token_cache, "precision=nvfp4", "precision.first_bf16_layers=1"))


def test_bridge_api_builds_the_recipe_and_runs(tmp_path):
    c = api.llama3_8b_low_precision_pretrain_config(
        mixed_precision_recipe="bf16_with_nvfp4_mixed", train_iters=1000, lr_warmup_iters=100,
        lr_decay_iters=900, mock=True, dir=str(tmp_path), name="bridge")
    assert (c.precision.recipe, c.model.preset, c.data.source) == ("bf16_with_nvfp4_mixed", "llama3_8b", "mock")
    assert (c.steps, c.schedule.warmup_steps, c.schedule.decay_steps) == (1000, 100, 900)
    assert (c.data.seq_len, c.data.global_batch_size, c.seed) == (8192, 768, 1234)
    assert c.run_dir == os.path.join(str(tmp_path), "bridge")
    assert (c.mesh.data, c.mesh.fsdp, c.mesh.shard_optimizer) == (-1, 1, True)  # Bridge's DP + ZeRO-1
    plan = resolve(c)  # the 8B plan validates on CPU without building anything
    assert plan.phases[0].recipe.policy == "F0L4" and plan.accum_steps == 768
    assert plan.model_config.fused_projections  # Megatron's linear_qkv and linear_fc1
    # Transformer Engine's per-rank amaxes; Bridge's NVFP4 preset leaves fp4_param_gather off
    assert (plan.phases[0].recipe.amax_scope, plan.phases[0].recipe.param_gather) == ("local", False)
    with pytest.raises(ValueError, match="mixed_precision_recipe='fp8' is not one of"):
        api.llama3_8b_low_precision_pretrain_config("fp8")
    small = api.override(c, "model.preset=tiny", "steps=3", "data.seq_len=32",
                         "data.global_batch_size=2", "data.micro_batch_size=2",
                         "precision=bf16_mixed", "logging.progress_bar=false",
                         "logging.val_batches=1")
    result = api.pretrain(small)
    assert result.step == 3 and math.isfinite(result.loss)
    # Bridge raises on a non-finite gradient (check_for_nan_in_grad): so does its recipe
    # here, at the first one, with the last good checkpoint as it was (same compiled step).
    nan_dir = os.path.join(str(tmp_path), "nan")
    with pytest.raises(NonFiniteLossError) as info:
        api.pretrain(api.override(small, f"run_dir={nan_dir}", "checkpoint.every=2",
                                  "debug.inject_nan_at_steps=[3]"))
    assert str(info.value).startswith("step 3: loss nan") and "\n" not in str(info.value)
    assert "the last checkpoint (step 2) is untouched" in str(info.value)
    ckpt = Checkpointer(os.path.join(nan_dir, "checkpoints"), 2)
    assert ckpt.all_steps() == [2]
    ckpt.close()
    kw = api.llama3_8b_low_precision_pretrain_config(mock=True, model__preset="tiny",
                                                     **{"optimizer.b2": 0.99})
    assert kw.model.preset == "tiny" and kw.optimizer.b2 == 0.99
    assert kw.precision.recipe == "bf16_with_fp8_current_scaling_mixed"


@pytest.mark.parametrize("recipe, bridge_name", [
    ("bf16", "bf16_mixed"), ("fp8_cs", "bf16_with_fp8_current_scaling_mixed"),
    ("fp8_block", "bf16_with_fp8_subchannel_scaling_mixed"), ("mxfp8", "bf16_with_mxfp8_mixed"),
    ("nvfp4", "bf16_with_nvfp4_mixed")])
def test_bridge_configs_pack_and_stop_as_bridge(recipe, bridge_name):
    """The Bridge-named configs and the API: Megatron's packing switches at Bridge's values
    (plain causal attention, running positions, every target scored) and a stop at the
    first non-finite step; the tiny configs keep per-document packing."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for c in (load_config(os.path.join(root, "configs", f"llama3_8b_{recipe}.yaml"), []),
              api.llama3_8b_low_precision_pretrain_config(bridge_name)):
        d = c.data
        assert (d.reset_attention_mask, d.reset_position_ids, d.eod_mask_loss) == (False, False, False)
        assert c.optimizer.on_nonfinite == "stop"
    tiny = load_config(os.path.join(root, "configs", f"tiny_{recipe}.yaml"), [])
    assert (tiny.data.reset_attention_mask, tiny.data.reset_position_ids, tiny.data.eod_mask_loss,
            tiny.optimizer.on_nonfinite) == (True, True, True, "skip")


def test_resume_warns_about_changed_config_keys():
    from lp_jax.config.yaml_io import changed_keys as _changed_keys

    saved = {"steps": 20, "stop_at": 10, "run_dir": "a", "precision": {"recipe": "nvfp4"}}
    same = {"steps": 20, "stop_at": None, "run_dir": "b", "precision": {"recipe": "nvfp4"}}
    assert _changed_keys(saved, same) == []
    changed = dict(same, steps=40, precision={"recipe": "bf16"})
    assert _changed_keys(saved, changed) == ["precision.recipe", "steps"]


@pytest.mark.parametrize("name", ["tiny", "tiny_bf16", "tiny_fp8_cs", "tiny_fp8_block", "tiny_mxfp8",
                                  "tiny_nvfp4", "llama3_8b_bf16", "llama3_8b_fp8_cs", "llama3_8b_fp8_block",
                                  "llama3_8b_mxfp8", "llama3_8b_nvfp4"])
def test_shipped_configs_validate(name, capsys):
    from lp_jax.training import cli

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert cli.main(["--config", os.path.join(root, "configs", f"{name}.yaml"), "--check"]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    layers = 32 if name.startswith("llama3_8b") else 4
    assert summary.startswith(f"# ok: {layers} layers")
    if name == "tiny_nvfp4":
        assert "nvfp4 F0L1" in summary  # some layers quantized on the 4-layer model
    if name == "llama3_8b_nvfp4":
        # micro-batch 4 (the plan's fastest on 8 GB200s): 768 sequences in 192 passes on one device
        assert "nvfp4 F0L4" in summary and "192 micro-batch(es)" in summary
