"""What a study trains: one variant per precision (and per NVFP4 ablation), each the same
run config with only the precision section and the run folder changed.

A precision is named as the trainer names recipes (`bf16`, `fp8_cs`, `mxfp8`, `nvfp4`),
optionally with a layer policy: `nvfp4:F0L1` keeps the last layer in BF16 instead of the
recipe's default (useful for models shallower than NVFP4's default F0L4 needs). Each
variant starts from the recipe's defaults, never from the base config's precision section:
the study compares recipes as shipped, and the ablations switch one thing off at a time.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

from lp_jax.config.schema import PrecisionConfig, TrainConfig
from lp_jax.config.yaml_io import apply_overrides
from lp_jax.errors import UserError
from lp_jax.numerics.registry import Format, FormatVariant, format_named
from lp_jax.recipes import RECIPES as RECIPE_CLASSES

RECIPES = ("bf16", "fp8_cs", "fp8_block", "mxfp8", "nvfp4")
DEFAULT_PRECISIONS = "bf16,fp8_cs,mxfp8,nvfp4"  # the four of Megatron Bridge's Llama 3 8B study
REFERENCE = "bf16"  # gaps and speed-ups are relative to it
# Caps on how much worse than BF16 a precision may end (final validation loss, default
# policies), as NVIDIA's NeMo Megatron Bridge Llama 3 8B study found at 1T tokens: FP8
# recipes within about a point, NVFP4 within about three. Ending lower than BF16 meets them.
TARGETS = {"fp8_cs": 0.01, "fp8_block": 0.01, "mxfp8": 0.01, "nvfp4": 0.03}
TWIN = "bf16_twin"  # with --seeds: BF16 again, summed in another order (the noise band)


def recipe_format(recipe: str) -> Format | None:
    """The format a recipe's GEMMs multiply its inputs in (None for BF16): the study names
    and colours a recipe's runs as its format object does."""
    fmt = RECIPE_CLASSES[recipe]().fprop_x.fmt
    return None if fmt is None else format_named(fmt)


LABELS = {r: getattr(recipe_format(r), "label", "BF16") for r in RECIPES}
POLICY = re.compile(r"^F(\d+)L(\d+)$", re.IGNORECASE)

# NVFP4 ablations: (name suffix, label, precision overrides on top of the NVFP4 variant).
ABLATIONS = (
    ("f0l0", "NVFP4 F0L0 (all layers)", {"first_bf16_layers": 0, "last_bf16_layers": 0}),
    ("no_rht", "NVFP4 without RHT", {"disable_rht": True}),
    ("no_sr", "NVFP4 without SR", {"disable_stochastic_rounding": True}),
    ("no_2d", "NVFP4 without 2D weights", {"disable_2d": True}),
)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One training of the study."""

    name: str  # folder name and JSON key: bf16, nvfp4, nvfp4_f0l1, nvfp4_no_rht, ...
    label: str  # for tables and legends
    recipe: str
    precision: dict[str, Any]  # PrecisionConfig overrides besides the recipe
    group: str  # "precisions", "ablations" or "twin"
    overrides: tuple[str, ...] = ()  # dotted key=value for this run only (the twin's micro-batch)

    def precision_config(self) -> PrecisionConfig:
        return PrecisionConfig(recipe=self.recipe, **self.precision)


def parse_precisions(text: str) -> list[Variant]:
    """`bf16,fp8_cs,mxfp8,nvfp4[:FiLj]` -> variants, in the order given; `nvfp4:4over6`
    (`nvfp4:4over6:F0L1`) is NVFP4 with 4/6 block scales on its weights."""
    variants, seen = [], set()
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        recipe, _, policy = item.partition(":")
        recipe = recipe.lower()
        if recipe not in RECIPES:
            raise UserError(f"--precisions: unknown precision {recipe!r}; allowed: "
                            f"{', '.join(RECIPES)} (optionally with a policy, e.g. nvfp4:F0L1)")
        variant = _format_variant(recipe, policy.lower().split(":")[0])
        if variant:
            policy = policy.partition(":")[2]
        overrides, name, label = {}, recipe, LABELS[recipe]
        if policy:
            match = POLICY.match(policy)
            if not match:
                raise UserError(f"--precisions: bad layer policy {policy!r} in {item!r}; "
                                "expected FiLj, e.g. F0L1")
            overrides = {"first_bf16_layers": int(match[1]), "last_bf16_layers": int(match[2])}
            name, label = f"{recipe}_{policy.lower()}", f"{label} {policy.upper()}"
        if variant:
            overrides = {**overrides, "block_scale_search": variant.option}
            name = name.replace(recipe, variant.name, 1)
            label = label.replace(recipe_format(recipe).label, variant.label, 1)
        if name in seen:
            raise UserError(f"--precisions: {item!r} is listed twice")
        seen.add(name)
        variants.append(Variant(name, label, recipe, overrides, "precisions"))
    if not any(v.recipe == REFERENCE and not v.precision for v in variants):
        raise UserError(f"--precisions {text!r} must include {REFERENCE} (the reference for "
                        "gaps and speed-ups)")
    return variants


def _format_variant(recipe: str, option: str) -> FormatVariant | None:
    """The variant of the recipe's format that ``option`` names (nvfp4:4over6), if any."""
    fmt = recipe_format(recipe)
    return next((v for v in fmt.variants if v.option == option), None) if fmt else None


def ablation_variants(variants: list[Variant]) -> list[Variant]:
    """The NVFP4 ablations, each one switch away from the study's NVFP4 variant (the first
    listed; NVFP4 with its default policy if none is). The F0L0 row is left out when that
    variant already quantizes every layer."""
    base = next((v for v in variants if v.recipe == "nvfp4"), None)
    base_overrides = dict(base.precision) if base else {}
    out = []
    for suffix, label, overrides in ABLATIONS:
        merged = {**base_overrides, **overrides}
        if suffix == "f0l0" and base_overrides == overrides:
            continue
        out.append(Variant(f"nvfp4_{suffix}", label, "nvfp4", merged, "ablations"))
    return out


def nvfp4_reference(variants: list[Variant]) -> list[Variant]:
    """The NVFP4 variant the ablations compare with, added if --precisions lacks one."""
    if any(v.recipe == "nvfp4" for v in variants):
        return []
    return [Variant("nvfp4", LABELS["nvfp4"], "nvfp4", {}, "ablations")]


def twin_variant(base: TrainConfig) -> Variant:
    """A second BF16 run that differs from the first only in how each batch's gradient is
    summed: over twice as many micro-batches (or half as many), the same rows, the same
    mean, another FP32 summation order. That changes no expected quality, yet, like any
    rounding change, it sends the run down its own path: the gap between the twins is what
    "no effect" looks like at this scale (the study's noise band). A summation-order change
    was chosen over moving the initial weights by one ulp because the BF16 cast of the FP32
    masters absorbs most one-ulp moves."""
    micro, batch = base.data.micro_batch_size, base.data.global_batch_size
    if micro % 2 == 0:
        twin = micro // 2
    elif batch % (2 * micro) == 0:
        twin = 2 * micro
    else:
        raise UserError(f"no BF16 twin for micro_batch_size={micro}, global_batch_size={batch}: "
                        "it needs an even micro-batch or a global batch divisible by twice it "
                        "(or pass --no-twin)")
    return Variant(TWIN, f"BF16 twin (micro-batch {twin})", REFERENCE, {}, "twin",
                   (f"data.micro_batch_size={twin}",))


def variant_config(base: TrainConfig, variant: Variant, run_dir: str) -> TrainConfig:
    """The base config trained in this variant's precision, in its own folder.

    The progress bar is off (the run's output goes to a log file; the study prints its own
    progress lines) and the checkpoint folder is the run's own.
    """
    if base.precision_schedule:
        raise UserError("precision_schedule is set in the study's config: a study compares "
                        "fixed recipes; remove it (precision_schedule=[])")
    config = dataclasses.replace(
        base, run_dir=run_dir, precision=variant.precision_config(),
        checkpoint=dataclasses.replace(base.checkpoint, dir=None),
        logging=dataclasses.replace(base.logging, progress_bar=False))
    return apply_overrides(config, list(variant.overrides)) if variant.overrides else config
