"""Every field of every recipe and of LlamaConfig can be set from a config: walked off the
dataclasses, so a field added to either fails here until the config reaches it."""
import dataclasses

import jax.numpy as jnp
import pytest
import yaml

from lp_jax.config.schema import FrozenMapping, PrecisionConfig, TrainConfig
from lp_jax.config.yaml_io import dump_yaml, from_dict, load_config
from lp_jax.errors import UserError
from lp_jax.recipes import OPERAND_FIELDS, RECIPES
from lp_jax.training import cli
from lp_jax.training.validate import model_config, resolve
from models.config import Llama3RopeScaling, LlamaConfig, preset

RECIPE_CLASSES = sorted(set(RECIPES.values()), key=lambda cls: cls.name)
# A value for each recipe field, unlike every recipe's default, valid on a CPU and
# together with the others on an 8-layer model.
RECIPE_SAMPLES = {
    "first_bf16_layers": 2, "last_bf16_layers": 2, "bf16_layers": (3, 5),
    "backend": "reference", "quantize_impl": "xla", "param_gather": True, "amax_scope": "local",
    "fp8_format": "E4M3", "scale_rule": "floor",
    "disable_rht": True, "disable_stochastic_rounding": True, "disable_2d": True,
    "block_scale_search": "4over6", "block_scale_search_on": "all", "block_scale_search_metric": "mse",
}
# Where a field's default differs by recipe: (recipe, field) -> a sample unlike that default.
RECIPE_SAMPLES_OF = {("fp8_block", "fp8_format"): "HYBRID"}
# Recipe fields no config sets, and why.
NOT_FROM_CONFIG = {name: "an operand spec, derived from the recipe's other fields in __post_init__ "
                         "(init=False): get_recipe takes no such keyword" for name in OPERAND_FIELDS}
SMALL_RUN = ("data.source=mock", "model.num_layers=8")


def _text(value) -> str:
    """``value`` as it is written on the command line."""
    return yaml.safe_dump(list(value) if isinstance(value, tuple) else value,
                          default_flow_style=True).removesuffix("\n...\n").strip()


def _sample(cls, name):
    return RECIPE_SAMPLES_OF.get((cls.name, name), RECIPE_SAMPLES.get(name))


def _recipes(*overrides):
    return [p.recipe for p in resolve(load_config(None, [*SMALL_RUN, *overrides]), check_files=False).phases]


@pytest.mark.parametrize("cls, field", [(cls, f) for cls in RECIPE_CLASSES for f in dataclasses.fields(cls)],
                         ids=lambda x: getattr(x, "name", x))
def test_every_recipe_field_is_set_from_the_command_line(cls, field):
    if not field.init:
        assert field.name in NOT_FROM_CONFIG, f"{cls.__name__}.{field.name}: say why no config sets it"
        return
    assert field.name in RECIPE_SAMPLES, (f"{cls.__name__}.{field.name} has no sample value here: add "
                                          "one, and make sure precision.options reaches it")
    value = _sample(cls, field.name)
    assert value != field.default
    (recipe,) = _recipes(f"precision={cls.name}", f"precision.options.{field.name}={_text(value)}")
    assert type(recipe) is cls and getattr(recipe, field.name) == value


@pytest.mark.parametrize("cls", RECIPE_CLASSES, ids=lambda cls: cls.name)
def test_all_of_a_recipes_fields_from_yaml_and_in_a_precision_schedule(cls, tmp_path):
    options = {f.name: _sample(cls, f.name) for f in dataclasses.fields(cls) if f.init}
    entry = {"recipe": cls.name, "options": {k: list(v) if isinstance(v, tuple) else v
                                             for k, v in options.items()}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"steps": 10, "precision": entry,
                                    "precision_schedule": [{"from_step": 5, **entry}]}))
    config = load_config(path, SMALL_RUN)
    assert config.precision.options == options and config.precision_schedule[0].options == options
    assert from_dict(TrainConfig, yaml.safe_load(dump_yaml(config))) == config
    for phase in resolve(config, check_files=False).phases:
        recipe = phase.recipe
        assert {k: getattr(recipe, k) for k in options} == options


def test_options_go_with_the_section_own_keys():
    recipe, = _recipes("precision=nvfp4", "precision.disable_rht=true", "precision.options.disable_2d=true")
    assert (recipe.disable_rht, recipe.disable_2d) == (True, True)
    # `precision=<name>` keeps the options, as it keeps the other keys.
    config = load_config(None, ["precision.options.scale_rule=floor", "precision=mxfp8"])
    assert config.precision == PrecisionConfig(recipe="mxfp8", options=FrozenMapping({"scale_rule": "floor"}))
    assert hash(config) == hash(config)
    # The same value both ways is fine; two values are refused.
    recipe, = _recipes("precision=nvfp4", "precision.last_bf16_layers=1",
                       "precision.options.last_bf16_layers=1")
    assert recipe.last_bf16_layers == 1
    # get_recipe's policy shorthand is one of its keywords too.
    recipe, = _recipes("precision=fp8_cs", "precision.options.policy=F0L2")
    assert recipe.policy == "F0L2"
    assert PrecisionConfig(recipe="mxfp8", first_bf16_layers=1,
                           options=FrozenMapping({"scale_rule": "floor"})).overrides() == {
        "first_bf16_layers": 1, "bf16_layers": (), "backend": "auto", "quantize_impl": "auto",
        "scale_rule": "floor"}


@pytest.mark.parametrize("overrides, message", [
    (["precision=mxfp8", "precision.options.scale_rul=floor"],
     "precision.options: recipe MXFP8BlockScaling has no field 'scale_rul'; valid fields: "),
    (["precision=mxfp8", "precision.options.fp8_format=E4M3"],
     "precision.options: recipe MXFP8BlockScaling has no field 'fp8_format'"),
    (["precision=nvfp4", "precision.options.fprop_x={fmt: nvfp4}"],
     "precision.options: recipe NVFP4BlockScaling has no field 'fprop_x'"),
    (["precision=mxfp8", "precision.options.scale_rule=round"],
     "precision.options: scale_rule='round' is not valid; expected 'rceil' or 'floor'"),
    (["precision=fp8_cs", "precision.options.fp8_format=E5M2"], "fp8_format='E5M2' is not valid"),
    (["precision=fp8_block", "precision.options.fp8_format=hybrid"],
     "precision.options: fp8_format='hybrid' is not valid; expected one of ('E4M3', 'HYBRID')"),
    (["precision=nvfp4", "precision.options.disable_rht=maybe"],
     "config key 'precision.options.disable_rht' must be true or false, got 'maybe'"),
    (["precision=nvfp4", "precision.options.bf16_layers=[a]"],
     "config key 'precision.options.bf16_layers[0]' must be an integer"),
    (["precision=nvfp4", "precision.options.last_bf16_layers=99"],
     "precision.options.last_bf16_layers=99 is invalid: must be between 0 and the model's 8 layers"),
    (["precision=nvfp4", "precision.disable_rht=true", "precision.options.disable_rht=false"],
     "precision.options.disable_rht=False and precision.disable_rht=True disagree; set one of them"),
    (["precision_schedule=[{from_step: 2, recipe: mxfp8, options: {scale_rule: x}}]"],
     "precision_schedule[0].options: scale_rule='x' is not valid"),
    (["precision.options=3"], "config key 'precision.options' must be a mapping, got 3"),
    (["precision=mxfp9", "precision.options.last_bf16_layers=abc"], "precision: unknown recipe 'mxfp9'"),
    (["model.rope_scaling.factor=abc"], "model: rope_scaling factor must be a number, got 'abc'"),
    (["model.rope_scaling.scale=2"], "model: unknown llama3 rope_scaling keys ['scale']"),
])
def test_options_errors_are_one_line_naming_the_key(overrides, message):
    with pytest.raises(UserError) as info:
        _recipes(*overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_train_py_check_reaches_an_option(capsys):
    assert cli.main(["--config", "configs/tiny.yaml", "--check", "data.source=mock", "precision=mxfp8",
                     "precision.options.scale_rule=floor"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["precision"]["options"] == {"scale_rule": "floor"}
    assert cli.main(["--config", "configs/tiny.yaml", "--check", "precision=mxfp8",
                     "precision.options.scale=floor"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("train.py: error: precision.options: recipe MXFP8BlockScaling has no field 'scale'")
    assert err.count("\n") == 1


# A value for each LlamaConfig field as written in a config, and what the model gets,
# unlike the tiny preset's.
MODEL_SAMPLES = {
    "vocab_size": ("512", 512), "hidden_size": ("256", 256), "intermediate_size": ("512", 512),
    "num_layers": ("6", 6), "num_heads": ("8", 8), "num_kv_heads": ("4", 4), "head_dim": ("64", 64),
    "rope_theta": ("20000", 20000.0),
    "rope_scaling": ("{factor: 16.0, low_freq_factor: 2.0}",
                     Llama3RopeScaling(factor=16.0, low_freq_factor=2.0)),
    "rms_norm_eps": ("1e-6", 1e-6), "tie_embeddings": ("true", True), "max_seq_len": ("512", 512),
    "init_std": ("0.01", 0.01), "scan_layers": ("true", True), "remat": ("full", "full"),
    "attention_impl": ("cudnn", "cudnn"), "max_documents": ("8", 8),
    "recompute_mlp_product": ("true", True), "fused_projections": ("true", True),
    "num_experts": ("4", 4), "moe_router_topk": ("1", 1), "moe_ffn_hidden_size": ("64", 64),
    "norm_topk_prob": ("false", False), "moe_aux_loss_coeff": ("0.01", 0.01), "moe_z_loss_coeff": ("0.001", 0.001),
    "qk_norm": ("true", True),
    "dtype": ("float32", jnp.dtype("float32")), "param_dtype": ("bfloat16", jnp.dtype("bfloat16")),
}


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(LlamaConfig)])
def test_every_model_field_is_set_from_the_command_line(field):
    assert field in MODEL_SAMPLES, (f"LlamaConfig.{field} has no sample value here: add one, and "
                                    "a model.* key that reaches it")
    text, expected = MODEL_SAMPLES[field]
    assert getattr(preset("tiny"), field) != expected
    cfg = model_config(load_config(None, ["data.source=mock", f"model.{field}={text}"]))
    assert getattr(cfg, field) == expected


def test_rope_scaling_by_key_and_turned_off():
    cfg = model_config(load_config(None, ["data.source=mock", "model.rope_scaling.factor=16"]))
    assert cfg.rope_scaling == Llama3RopeScaling(factor=16)
    one_b = ["data.source=mock", "model.preset=llama3_1b", "data.seq_len=256"]
    assert model_config(load_config(None, one_b)).rope_scaling == Llama3RopeScaling(factor=32.0)
    turned_off = load_config(None, [*one_b, "model.rope_scaling={rope_type: default}"])
    assert model_config(turned_off).rope_scaling is None
    config = load_config(None, ["model.rope_scaling.factor=16"])
    assert from_dict(TrainConfig, yaml.safe_load(dump_yaml(config))) == config
