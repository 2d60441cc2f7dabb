"""lp_jax.numerics.registry: one object per format, and no branch on a format's name elsewhere.

The registry's facts are checked format by format, against the vocabularies other layers
keep (recipes, the Pallas dispatch, the study), and lp_jax's source is read with ``ast``:
a comparison of a format name (a string literal among the registry's names) outside the
registry modules fails, so a per-format choice keeps asking the format object.
"""
from __future__ import annotations

import ast
import pathlib
import typing

import jax.numpy as jnp
import numpy as np
import pytest

import lp_jax as lp
from lp_jax import recipes
from lp_jax.numerics import formats as F
from lp_jax.numerics.registry import NAMES, REGISTRY, format_named, names_where

ROOT = pathlib.Path(__file__).resolve().parents[2]

# name: (element, block, scale, tensor scale, tiles, stochastic rounding, Pallas kernel,
#        "auto" picks it on Blackwell, GEMM backend, Hopper GEMM, label, colour)
FACTS = {
    "fp8_e4m3": (F.E4M3, None, None, True, False, False, True, False, "xla_fp8", None, "FP8-CS", "tab:blue"),
    "fp8_e5m2": (F.E5M2, None, None, True, False, False, True, False, "xla_fp8", None, "FP8-CS", "tab:blue"),
    "mxfp8": (F.E4M3, 32, F.E8M0, False, False, False, True, True, "cudnn", None, "MXFP8", "tab:green"),
    "nvfp4": (F.E2M1, 16, F.E4M3, True, True, True, True, True, "cudnn", None, "NVFP4", "tab:red"),
    "fp8_block": (F.E4M3, 128, np.float32, False, True, False, False, False, "cudnn", "wgmma", "FP8 block",
                  "tab:cyan"),
    "fp8_block_e5m2": (F.E5M2, 128, np.float32, False, True, False, False, False, "cudnn", "wgmma",
                       "FP8 block", "tab:cyan"),
}
# name: (bytes per value, scale bytes per element in 1-D blocks, in tiles (None: no tiles))
BYTES = {
    "fp8_e4m3": (1.0, 0.0, None),
    "fp8_e5m2": (1.0, 0.0, None),
    "mxfp8": (1.0, 1 / 32, None),
    "nvfp4": (0.5, 1 / 16, 1 / (16 * 16)),
    "fp8_block": (1.0, 4 / 128, 4 / (128 * 128)),
    "fp8_block_e5m2": (1.0, 4 / 128, 4 / (128 * 128)),
}


def test_the_registry_holds_the_public_names_in_order():
    assert NAMES == tuple(REGISTRY) == lp.FORMATS == ("fp8_e4m3", "fp8_e5m2", "mxfp8", "nvfp4", "fp8_block",
                                                     "fp8_block_e5m2")
    assert all(f.name == name for name, f in REGISTRY.items())


@pytest.mark.parametrize("name", list(FACTS))
def test_facts(name):
    f = format_named(name)
    got = (f.element, f.block, f.scale, f.tensor_scale, f.tiles, f.stochastic, f.pallas, f.auto_pallas,
           f.gemm, f.hopper_gemm, f.label, f.color)
    assert got == FACTS[name]
    assert f.per_tensor == (f.block is None)
    assert f.max == F.max_of(f.element)


@pytest.mark.parametrize("name", list(BYTES))
def test_bytes_per_element(name):
    f = format_named(name)
    values, rows, tiles = BYTES[name]
    assert f.value_bytes == values
    assert f.scale_bytes() == rows and f.copy_bytes() == values + rows
    if tiles is not None:
        assert f.scale_bytes(tiles=True) == tiles and f.copy_bytes(tiles=True) == values + tiles


def test_native_gemm_per_gpu_generation():
    hopper = [format_named(n).native_gemm(9) for n in NAMES]
    blackwell = [format_named(n).native_gemm(10) for n in NAMES]
    assert hopper == ["xla_fp8", "xla_fp8", "cudnn", "cudnn", "wgmma", "wgmma"]
    assert blackwell == ["xla_fp8", "xla_fp8", "cudnn", "cudnn", "cudnn", "cudnn"]


def test_four_over_six_is_a_variant_of_nvfp4():
    nvfp4 = format_named("nvfp4")
    v = nvfp4.variant("4over6")
    assert (v.option, v.name, v.label, v.pallas) == ("4over6", "nvfp4_4over6", "NVFP4 4/6", False)
    assert nvfp4.block_scale_searches == ("4over6",)
    assert not nvfp4.pallas_for("4over6") and nvfp4.pallas_for(None)
    assert all(format_named(n).block_scale_searches == () for n in NAMES if n != "nvfp4")
    with pytest.raises(ValueError, match="has no variant"):
        format_named("mxfp8").variant("4over6")


@pytest.mark.parametrize("bad", ["nvfp8", "NVFP4", None, ["mxfp8"]])
def test_an_unknown_name_is_one_line_listing_the_names(bad):
    with pytest.raises(ValueError) as e:
        format_named(bad)
    assert "\n" not in str(e.value) and all(repr(n) in str(e.value) for n in NAMES)
    with pytest.raises(ValueError) as e:
        lp.quantize(jnp.ones((4, 32), jnp.float32), bad)
    assert "\n" not in str(e.value) and "is not a known format" in str(e.value)


@pytest.mark.parametrize("name", list(NAMES))
def test_the_name_stays_the_public_api(name):
    x = jnp.linspace(-3.0, 3.0, 4 * 32, dtype=jnp.float32).reshape(4, 32)
    q = lp.quantize(x, name)
    assert q.fmt == name and format_named(q.fmt) is REGISTRY[name]
    np.testing.assert_array_equal(np.asarray(lp.dequantize(q)), np.asarray(format_named(name).dequantize(q)))


def test_the_recipes_vocabulary_agrees_with_the_registry():
    # recipes is pure data below nothing: it keeps the names; the registry keeps the facts.
    assert set(typing.get_args(recipes.Format)) == set(NAMES)
    assert set(recipes.PER_TENSOR_FORMATS) == set(names_where(lambda f: f.per_tensor))
    assert set(recipes.BLOCK_FORMATS) == set(names_where(lambda f: not f.per_tensor))
    for name in recipes.RECIPES:  # Bridge's names too: its subchannel recipe has E5M2 gradients
        recipe = recipes.get_recipe(name)
        for spec in recipe.operand_specs():
            if spec.fmt is None:
                continue
            f = format_named(spec.fmt)
            assert f.native_gemm(10) == recipe.native_backend, (recipe.name, spec.fmt)
            hopper = recipe.hopper_backend or recipe.native_backend
            assert f.native_gemm(9) == hopper, (recipe.name, spec.fmt)
            assert not spec.block_2d or f.tiles, (recipe.name, spec.fmt)


def test_each_scheme_has_its_implementations():
    from lp_jax.kernels import api
    from lp_jax.quantizer import PALLAS_ON_GPU
    from lp_jax.telemetry import stats

    assert PALLAS_ON_GPU == names_where(lambda f: f.auto_pallas) == ("mxfp8", "nvfp4")
    for f in REGISTRY.values():
        assert f.scheme in stats._BLOCKED, f.name
        if f.pallas and not f.per_tensor:
            assert f.scheme in api._BLOCK_QUANTIZERS and f.scheme in api._PAIR_COPIES, f.name
        if f.pallas and f.tiles:
            assert f.scheme in api._TILE_QUANTIZERS, f.name


def test_the_study_names_and_colours_recipes_as_their_formats():
    from lp_jax.study import plots, variants

    assert variants.LABELS == {"bf16": "BF16", "fp8_cs": "FP8-CS", "fp8_block": "FP8 block", "mxfp8": "MXFP8",
                               "nvfp4": "NVFP4"}
    assert plots.COLORS == {"bf16": "black", "fp8_cs": "tab:blue", "fp8_block": "tab:cyan",
                            "mxfp8": "tab:green", "nvfp4": "tab:red"}
    (v,) = [v for v in variants.parse_precisions("bf16,nvfp4:4over6:F0L1") if v.recipe == "nvfp4"]
    expected = ("nvfp4_4over6_f0l1", "NVFP4 4/6 F0L1", "4over6")
    assert (v.name, v.label, v.precision["block_scale_search"]) == expected


# ----------------------------------------------------------------- no branch on a format's name

# Where the format objects are made: the one place a name may be compared.
REGISTRY_MODULES = {"lp_jax/numerics/format.py", "lp_jax/numerics/registry.py"}
# Recipe names and the study's variant names share spellings with formats (nvfp4, mxfp8,
# fp8_block): a comparison whose other side names a recipe or a variant is about those.
OTHER_VOCABULARIES = ("recipe", "variant")
# Comparisons with a recipe's name where no identifier says so: (file, source) -> why.
NOT_FORMAT_BRANCHES = {
    ("lp_jax/study/report.py", "k != 'nvfp4'"): "k: a study variant's name (the ablations' NVFP4 run)",
}
_OPS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)


def _format_literals(node) -> bool:
    """Whether node is a format-name literal, or a tuple/list/set holding one."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_format_literals(e) for e in node.elts)
    return False


def _identifiers(node) -> list[str]:
    names = []
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            names.append(n.id)
        elif isinstance(n, ast.Attribute):
            names.append(n.attr)
        elif isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) \
                and isinstance(n.slice.value, str):
            names.append(n.slice.value)
    return names


def _names_another_vocabulary(node) -> bool:
    return any(word in name.lower() for name in _identifiers(node) for word in OTHER_VOCABULARIES)


def format_branches(source: str, path: str = "<string>") -> list[str]:
    """'path:line: source' of every comparison of a format-name literal in ``source`` (and
    every ``case`` matching one), except those against a recipe or a variant name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for left, op, right in zip(operands, node.ops, operands[1:]):
                if not isinstance(op, _OPS):
                    continue
                for literal, other in ((left, right), (right, left)):
                    if _format_literals(literal) and not _format_literals(other) \
                            and not _names_another_vocabulary(other):
                        text = ast.unparse(node)
                        if (path, text) not in NOT_FORMAT_BRANCHES:
                            found.append(f"{path}:{node.lineno}: {text}")
                        break
        elif isinstance(node, ast.match_case):
            for p in ast.walk(node.pattern):
                if isinstance(p, ast.MatchValue) and _format_literals(p.value):
                    found.append(f"{path}:{p.lineno}: case {ast.unparse(p)}")
    return found


@pytest.mark.parametrize("code", [
    'fmt == "mxfp8"', '"nvfp4" != q.fmt', 'spec.fmt in ("fp8_e4m3", "fp8_e5m2")', 'f not in ["fp8_block"]',
    'fmt is "nvfp4"', 'a < b == "mxfp8"', 'match fmt:\n    case "nvfp4":\n        pass',
])
def test_the_check_finds_a_branch_on_a_format_name(code):
    assert format_branches(code)


@pytest.mark.parametrize("code", [
    'self.fmt == "npy"', 'fmt not in ("npy", "bin")', 'recipe == "nvfp4"', 'v.recipe == "nvfp4"',
    'e["variant"].name in (REFERENCE, "nvfp4")', 'scale_rule == "rceil"', 'x = {"nvfp4": 1}["nvfp4"]',
    'name = "mxfp8"',
])
def test_the_check_passes_what_is_no_format_branch(code):
    assert format_branches(code) == []


def test_no_branch_on_a_format_name_outside_the_registry():
    found = []
    for path in sorted((ROOT / "lp_jax").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel not in REGISTRY_MODULES:
            found += format_branches(path.read_text(), rel)
    assert not found, ("a per-format choice compares the format's name; ask its object instead "
                       "(lp_jax.numerics.registry.format_named(fmt)):\n" + "\n".join(found))
