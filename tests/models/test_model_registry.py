"""The model registry (lp_jax.model_registry): model.type=llama builds the same Llama as
before, an unknown type is one line, and a family registered here (a small NNX model that is
not Llama) trains through the trainer in BF16 and in NVFP4 with its last layer in BF16; the
same family in a module of its own trains by import path (model.type=module:attribute), in
this process and through train.py."""
import inspect
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lp_jax
from lp_jax import model_registry
from lp_jax.config.schema import TrainConfig
from lp_jax.config.yaml_io import from_dict, to_dict
from lp_jax.errors import UserError
from lp_jax.parallel.mesh import make_mesh
from lp_jax.model_registry import ModelFamily, register_model_family, unregister_model_family
from lp_jax.training.loop import run
from lp_jax.training.metrics import read_metrics
from lp_jax.training.optimizer import make_optimizer
from lp_jax.training.state import abstract_state, init_state, place_batch, split_model
from lp_jax.training.step import StepSpec, train_step
from lp_jax.training.validate import model_shape_changes, resolve
from models import llama
from tests.training.test_training_loop import TEXT
from tests.training.test_training_loop import tiny as tiny_run

ROOT = pathlib.Path(__file__).resolve().parents[2]


# The family docs/your_model.md registers ("Registering a model family"): keep the two the same.
class Block(nnx.Module):
    """A residual MLP over the causal running mean of the sequence (the mean is the block's
    only mixing along the sequence, so it needs no attention)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        kw = dict(use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.norm = nnx.LayerNorm(2 * cfg.hidden_size, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                                  rngs=rngs)
        self.up = nnx.Linear(2 * cfg.hidden_size, cfg.intermediate_size, **kw)
        self.down = nnx.Linear(cfg.intermediate_size, cfg.hidden_size, **kw)

    def __call__(self, x_BxLxD):
        count = jnp.arange(1, x_BxLxD.shape[1] + 1, dtype=x_BxLxD.dtype)[None, :, None]
        mean_BxLxD = jnp.cumsum(x_BxLxD, axis=1) / count
        h = self.norm(jnp.concatenate([x_BxLxD, mean_BxLxD], axis=-1))
        return x_BxLxD + self.down(jax.nn.gelu(self.up(h)))


class MeanMixer(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype,
                               param_dtype=cfg.param_dtype, rngs=rngs)
        # The blocks under `layers`: apply_recipe quantizes the Linears there and the layer
        # policy (FiLj, precision.bf16_layers) counts them; the head, outside, stays BF16.
        self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.head = nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, dtype=cfg.dtype,
                               param_dtype=cfg.param_dtype, rngs=rngs)

    def __call__(self, tokens_BxL, positions=None, segment_ids=None):
        x = self.embed(tokens_BxL)  # positions and segment ids: not used by this model
        for block in self.layers:
            x = block(x)
        return self.head(x)


class MeanMixerFamily(ModelFamily):
    def build(self, config, rngs):
        return MeanMixer(config, rngs=rngs)


@pytest.fixture
def mean_mixer():
    register_model_family("mean_mixer", MeanMixerFamily())
    yield "mean_mixer"
    unregister_model_family("mean_mixer")


def tiny(run_dir, cache, *overrides):
    """test_training_loop's tiny run, shortened to 8 steps of one micro-batch, one checkpoint."""
    return tiny_run(run_dir, cache, "steps=8", "data.micro_batch_size=4", "schedule.warmup_steps=2",
                    "checkpoint.every=8", "checkpoint.keep=1", "logging.val_every=100",
                    "logging.val_batches=0", *overrides)


def test_default_type_is_llama_and_old_configs_load_as_it():
    assert TrainConfig().model.type == "llama" and model_registry.registered()[0] == "llama"
    saved = to_dict(TrainConfig())
    del saved["model"]["type"]  # a config (or checkpoint) written before model.type existed
    assert from_dict(TrainConfig, saved).model.type == "llama"


@pytest.mark.slow  # two compiles of the tiny Llama's train step: 16 s on 2 cores
def test_llama_type_builds_the_same_model_and_loss(tmp_path, token_cache):
    plan = resolve(tiny(tmp_path, token_cache, "precision=fp8_cs"), check_files=False)
    mesh = make_mesh(1, 1)
    spec = StepSpec.from_plan(plan, mesh)
    tx = make_optimizer(spec.optimizer)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (4, 33)).astype(np.int32)
    host = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": np.ones((4, 32), bool),
            "segment_ids": np.ones((4, 32), np.int32), "positions": np.tile(np.arange(32, dtype=np.int32), (4, 1))}

    def first_step(build):
        model = nnx.eval_shape(build)
        shardings = spec.state_shardings(abstract_state(split_model(model), tx, 3))
        state = init_state(build, tx, 3, shardings)
        lp_jax.apply_recipe(model, plan.phases[0].recipe)
        params = jax.tree.map(np.asarray, state["params"])
        _, metrics = train_step(split_model(model)[0], spec, state, place_batch(host, spec.accum_steps, mesh))
        return type(model), params, float(metrics["loss"])

    # Through the registry, and as the trainer built the model before the registry.
    kind, a, loss_a = first_step(lambda: model_registry.build_model("llama", plan.model_config, nnx.Rngs(3)))
    _, b, loss_b = first_step(lambda: llama.Llama(plan.model_config, rngs=nnx.Rngs(3)))
    assert kind is llama.Llama
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert loss_a == loss_b and np.isfinite(loss_a)


def test_unknown_type_is_one_line_naming_the_registered(tmp_path, token_cache, mean_mixer):
    with pytest.raises(UserError) as info:
        resolve(tiny(tmp_path, token_cache, "model.type=lama"), check_files=False)
    message = str(info.value)
    assert "\n" not in message
    assert message == ("model.type='lama' is not a registered model family; registered: llama, moe, "
                       "mean_mixer; did you mean 'llama'?")


def test_registering_refuses_bad_families(mean_mixer):
    with pytest.raises(ValueError, match="'mean_mixer' is already registered"):
        register_model_family("mean_mixer", MeanMixerFamily())
    register_model_family("mean_mixer", MeanMixerFamily(), replace=True)
    with pytest.raises(ValueError, match="'llama' is lp_jax's Llama and cannot be replaced"):
        register_model_family("llama", MeanMixerFamily(), replace=True)
    with pytest.raises(ValueError, match="has no build"):
        register_model_family("other", object())
    with pytest.raises(ValueError, match="name 'Other Model' is invalid"):
        register_model_family("Other Model", MeanMixerFamily())


def test_family_without_hf_refuses_init_hf_and_a_type_change_on_resume(tmp_path, token_cache, mean_mixer):
    with pytest.raises(UserError, match=r"^init.hf=/no/hf: model.type='mean_mixer' has no Hugging "
                                        r"Face conversion \(only llama, moe\)$"):
        resolve(tiny(tmp_path, token_cache, "model.type=mean_mixer", "init.hf=/no/hf"), check_files=False)
    plan = resolve(tiny(tmp_path, token_cache, "model.type=mean_mixer"), check_files=False)
    saved = to_dict(tiny(tmp_path, token_cache))  # a llama run's checkpoint in the same folder
    assert model_shape_changes(saved, plan) == ["model.type (checkpoint llama, now mean_mixer)"]


@pytest.mark.parametrize("recipe", [["precision=bf16"],
                                    ["precision=nvfp4", "precision.last_bf16_layers=1"]])
def test_registered_family_trains_through_the_trainer(recipe, tmp_path, token_cache, mean_mixer):
    plan = resolve(tiny(tmp_path, token_cache, "model.type=mean_mixer", *recipe))
    result = run(plan)
    losses = [m["loss"] for m in read_metrics(tmp_path)]
    assert result.step == 8 and len(losses) == 8
    assert np.mean(losses[-3:]) < losses[0] - 0.5, losses
    report = lp_jax.apply_recipe(
        model_registry.build_model("mean_mixer", plan.model_config, nnx.Rngs(0)), plan.phases[0].recipe)
    if "precision=nvfp4" in recipe:  # layers 0-2 quantized, layer 3 and the head in BF16
        assert report.num_layers == 4 and plan.phases[0].recipe.policy == "F0L1"
        assert set(report.quantized) == {f"layers/{i}/{n}" for i in range(3) for n in ("up", "down")}
        assert "BF16 (layer policy): layers/{3}/{down, up}" in str(report), str(report)


def test_docs_example_is_this_family():
    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "your_model.md").read_text()
    section = doc[doc.index("## Registering a model family"):]
    for part in (Block, MeanMixer, MeanMixerFamily):
        assert inspect.getsource(part) in section, f"docs/your_model.md differs from {part.__name__}"


# The family above as a module of its own, written outside lp_jax, plus attributes that are
# not families.
IMPORTED_MODULE = "lp_jax_test_mean_mixer"
MODULE_TEXT = "\n\n".join([
    "import jax\nimport jax.numpy as jnp\nfrom flax import nnx\n\n"
    "from lp_jax.model_registry import ModelFamily",
    *(inspect.getsource(part) for part in (Block, MeanMixer, MeanMixerFamily)),
    "FAMILY = MeanMixerFamily()\nNOT_A_FAMILY = 3\n",
    "class NeedsArguments(MeanMixerFamily):\n    def __init__(self, width):\n        self.width = width\n",
])


@pytest.fixture
def family_module(tmp_path, monkeypatch):
    """The module file in tmp_path, importable; forgotten again afterwards."""
    folder = tmp_path / "user_code"
    folder.mkdir()
    (folder / f"{IMPORTED_MODULE}.py").write_text(MODULE_TEXT)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setattr(model_registry, "_IMPORTED", {})
    yield folder
    sys.modules.pop(IMPORTED_MODULE, None)


def test_import_path_gives_the_family_once_and_it_builds(family_module):
    path = f"{IMPORTED_MODULE}:MeanMixerFamily"
    family = model_registry.model_family(path)
    assert type(family).__name__ == "MeanMixerFamily" and model_registry.model_family(path) is family
    assert model_registry.model_family(f"{IMPORTED_MODULE}:FAMILY") is sys.modules[IMPORTED_MODULE].FAMILY
    config = model_registry.preset(path, "tiny", num_layers=2)
    model = model_registry.build_model(path, config, nnx.Rngs(0))
    assert type(model).__name__ == "MeanMixer" and len(model.layers) == 2
    logits = model(jnp.zeros((2, 8), jnp.int32))
    assert logits.shape == (2, 8, config.vocab_size)
    assert "llama" in model_registry.registered() and path not in model_registry.registered()


@pytest.mark.parametrize("model_type,message", [
    ("lp_jax_test_no_such_module:Family",
     "model.type='lp_jax_test_no_such_module:Family': no module named 'lp_jax_test_no_such_module'; "
     "it must be importable from the working directory ({cwd}) or installed"),
    (f"{IMPORTED_MODULE}.sub:Family",
     f"model.type='{IMPORTED_MODULE}.sub:Family': no module named '{IMPORTED_MODULE}.sub'; "
     "it must be importable from the working directory ({cwd}) or installed"),
    (f"{IMPORTED_MODULE}:MeanMixerFamliy",
     f"model.type='{IMPORTED_MODULE}:MeanMixerFamliy': '{IMPORTED_MODULE}' has no attribute "
     "'MeanMixerFamliy'; did you mean 'MeanMixerFamily' or 'MeanMixer'?"),
    (f"{IMPORTED_MODULE}:Nothing",
     f"model.type='{IMPORTED_MODULE}:Nothing': '{IMPORTED_MODULE}' has no attribute 'Nothing'"),
    (f"{IMPORTED_MODULE}:NOT_A_FAMILY",
     f"model.type='{IMPORTED_MODULE}:NOT_A_FAMILY' is not a model family: 3 has no build(config, rngs) "
     "method"),
    (f"{IMPORTED_MODULE}:MeanMixer",
     f"model.type='{IMPORTED_MODULE}:MeanMixer': the class MeanMixer cannot be made with no arguments "
     "(missing a required argument: 'cfg')"),
    (f"{IMPORTED_MODULE}:NeedsArguments",
     f"model.type='{IMPORTED_MODULE}:NeedsArguments': the class NeedsArguments cannot be made with no "
     "arguments (missing a required argument: 'width')"),
    (f"{IMPORTED_MODULE}:",
     f"model.type='{IMPORTED_MODULE}:' is not an import path package.module:attribute"),
    (f"{IMPORTED_MODULE}.MeanMixerFamily",
     f"model.type='{IMPORTED_MODULE}.MeanMixerFamily' is not a registered model family; registered: llama, moe; "
     "an import path is written package.module:attribute"),
])
def test_bad_import_paths_are_one_line(model_type, message, family_module):
    with pytest.raises(UserError) as info:
        model_registry.model_family(model_type)
    assert str(info.value) == message.format(cwd=os.getcwd())


def test_a_family_module_whose_import_fails_is_one_line(family_module):
    (family_module / "lp_jax_test_broken_family.py").write_text("import lp_jax_test_missing_dependency\n")
    with pytest.raises(UserError, match=r"^model.type='lp_jax_test_broken_family:F': importing "
                                        r"'lp_jax_test_broken_family' failed: No module named "
                                        r"'lp_jax_test_missing_dependency'$"):
        model_registry.model_family("lp_jax_test_broken_family:F")


def test_imported_family_trains_resumes_and_refuses_another_type(tmp_path, token_cache, family_module):
    path = f"{IMPORTED_MODULE}:MeanMixerFamily"
    result = run(resolve(tiny(tmp_path, token_cache, f"model.type={path}", "steps=3", "checkpoint.every=3")))
    losses = [m["loss"] for m in read_metrics(tmp_path)]
    assert result.step == 3 and len(losses) == 3 and np.all(np.isfinite(losses))
    result = run(resolve(tiny(tmp_path, token_cache, f"model.type={path}", "steps=4")))  # resumes at 3
    assert result.step == 4 and np.isfinite(result.loss)
    register_model_family("mean_mixer", MeanMixerFamily())  # the same model, by another type
    try:
        with pytest.raises(UserError, match=rf"^checkpoint 4 in .* is of another model: model.type "
                                            rf"\(checkpoint {path}, now mean_mixer\); "):
            run(resolve(tiny(tmp_path, token_cache, "model.type=mean_mixer", "steps=4")))
    finally:
        unregister_model_family("mean_mixer")


def test_train_py_takes_a_family_by_import_path_from_the_working_directory(tmp_path, token_cache):
    # The module beside the user's working directory only: train.py's own folder is not it.
    (tmp_path / f"{IMPORTED_MODULE}.py").write_text(MODULE_TEXT)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--config", "configs/tiny.yaml",
         f"model.type={IMPORTED_MODULE}:MeanMixerFamily", "steps=2", f"run_dir={tmp_path / 'run'}",
         f"data.paths={TEXT}", f"data.cache_dir={token_cache}", "data.val_fraction=0.2", "data.seq_len=64",
         "data.global_batch_size=4", "data.micro_batch_size=4", "schedule.warmup_steps=1",
         "logging.val_batches=0", "logging.progress_bar=false", "logging.tensorboard=false"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1].startswith("step 2/2: loss "), proc.stdout
    losses = [m["loss"] for m in read_metrics(tmp_path / "run")]
    assert len(losses) == 2 and np.all(np.isfinite(losses))
