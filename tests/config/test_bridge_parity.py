"""docs/bridge_parity.md's table stays true: every row naming an lp_jax key is checked against
the shipped configs/llama3_8b_{recipe}.yaml and llama3_8b_low_precision_pretrain_config's
result for the recipes the row covers. A key is a dotted config field (`optimizer.b1`),
`arch.<field>` (the model architecture the config builds, models.config.LlamaConfig) or
`recipe.<field>` (the resolved precision recipe, e.g. `recipe.dgrad_dy.fmt`); a value is YAML
in backticks, and `-` means the row is not checked there (the note says why)."""
import functools
import pathlib
import re

import pytest
import yaml

from lp_jax import model_registry
from lp_jax.config.yaml_io import load_config
from lp_jax.recipes import BRIDGE_NAMES
from lp_jax.training.api import llama3_8b_low_precision_pretrain_config
from lp_jax.training.validate import _recipe

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECIPES = ("bf16", "fp8_cs", "fp8_block", "mxfp8", "nvfp4")
BRIDGE_OF = {short: bridge for bridge, short in BRIDGE_NAMES.items()}
COLUMNS = ("Bridge", "Bridge's value", "lp_jax key", "recipes", "configs", "API", "note")


def _rows():
    text = (ROOT / "docs" / "bridge_parity.md").read_text()
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != len(COLUMNS) or cells[0] in ("Bridge", "") or set(cells[0]) <= {"-", ":"}:
            continue
        rows.append(dict(zip(COLUMNS, cells)))
    return rows


ROWS = _rows()


def _value(cell: str):
    m = re.fullmatch(r"`([^`]*)`", cell)
    return yaml.safe_load(m.group(1)) if m else None


@functools.cache
def _config(source: str, recipe: str):
    if source == "configs":
        return load_config(str(ROOT / "configs" / f"llama3_8b_{recipe}.yaml"), [])
    return llama3_8b_low_precision_pretrain_config(BRIDGE_OF[recipe])


def _lookup(config, key: str):
    head, _, rest = key.partition(".")
    if head == "arch":
        node = model_registry.preset(config.model.type, config.model.preset, **config.model.overrides())
    elif head == "recipe":
        arch = model_registry.preset(config.model.type, config.model.preset, **config.model.overrides())
        node = _recipe(config.precision, "precision", arch.num_layers)
    else:
        node, rest = config, key
    for part in rest.split("."):
        node = getattr(node, part)
    return node


def test_the_table_has_rows_for_every_part_of_the_recipe():
    keys = {r["lp_jax key"].strip("`") for r in ROWS}
    assert len(ROWS) >= 40, len(ROWS)
    for needed in ("data.reset_attention_mask", "optimizer.on_nonfinite", "arch.fused_projections",
                   "recipe.first_bf16_layers", "schedule.peak_lr", "mesh.shard_optimizer"):
        assert needed in keys, needed


@pytest.mark.parametrize("row", [r for r in ROWS if r["lp_jax key"].startswith("`")],
                         ids=lambda r: f"{r['lp_jax key'].strip('`')}[{r['recipes']}]")
def test_the_configs_and_the_api_say_what_the_table_says(row):
    key = row["lp_jax key"].strip("`")
    recipes = RECIPES if row["recipes"] == "all" else tuple(r.strip() for r in row["recipes"].split(","))
    assert set(recipes) <= set(RECIPES), row
    for source in ("configs", "API"):
        if row[source] == "-":
            continue
        want = _value(row[source])
        assert want is not None or row[source] == "`null`", f"{source} cell {row[source]!r} is not `yaml`"
        for recipe in recipes:
            got = _lookup(_config(source, recipe), key)
            got = list(got) if isinstance(got, tuple) else got
            assert got == want, f"{key} in {source} for {recipe}: {got!r}, the table says {want!r}"
