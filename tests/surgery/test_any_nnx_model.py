"""apply_recipe on an NNX model lp_jax did not write: a GPT-2-style model (blocks in an
nnx.List named h; nnx.LinearGeneral for qkv, nnx.Einsum for the output projection, nnx.Linear
for the MLP). Every recipe: each selected GEMM equals lp.dot_general's call on the same
operands, bit for bit, forward and backward; the layer policy lands on the right blocks; bad
input is a one-line error and the model is left as it was; the docs' example runs."""
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lp_jax as lp
from lp_jax.surgery.gemm_modules import LowPrecisionEinsum, current

RECIPES = ("bf16", "fp8_cs", "fp8_block", "mxfp8", "nvfp4")
# Contractions of 128 (fp8_block's blocks), 2 x 64 tokens.
D, HEADS, HEAD_DIM, FFN, VOCAB = 128, 2, 64, 256, 64
BF16 = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32)
GEMMS = ("qkv", "out", "fc", "proj")


class Block(nnx.Module):
    def __init__(self, rngs):
        self.qkv = nnx.LinearGeneral(D, (3, HEADS, HEAD_DIM), use_bias=False, rngs=rngs, **BF16)
        self.out = nnx.Einsum("BLHK,HKD->BLD", (HEADS, HEAD_DIM, D), rngs=rngs, **BF16)
        self.fc = nnx.Linear(D, FFN, rngs=rngs, **BF16)
        self.proj = nnx.Linear(FFN, D, rngs=rngs, **BF16)

    def __call__(self, x):
        q, k, v = jnp.moveaxis(self.qkv(x), 2, 0)
        x = x + self.out(jax.nn.dot_product_attention(q, k, v, is_causal=True))
        return x + self.proj(jax.nn.gelu(self.fc(x)))


class GPT(nnx.Module):
    def __init__(self, num_layers=6, seed=0):
        rngs = nnx.Rngs(seed)
        self.wte = nnx.Embed(VOCAB, D, rngs=rngs, **BF16)
        self.h = nnx.List([Block(rngs) for _ in range(num_layers)])
        self.lm_head = nnx.Linear(D, VOCAB, use_bias=False, rngs=rngs, **BF16)

    def __call__(self, tokens):
        x = self.wte(tokens)
        for block in self.h:
            x = block(x)
        return self.lm_head(x)


class MyDense(nnx.Module):
    """A user's module that takes a dot_general, contracting the input's last axis."""

    def __init__(self, din, dout, rngs):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (din, dout)) / din ** 0.5)
        self.dot_general = jax.lax.dot_general

    def __call__(self, x):
        return self.dot_general(x, self.kernel[...], (((x.ndim - 1,), (0,)), ((), ())))


def _x(shape, seed=1):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(jnp.bfloat16)


def _vjp(fn, x, kernel_or_state, dy):
    y, pullback = jax.vjp(fn, x, kernel_or_state)
    return y, *pullback(dy)


def _module_and_reference_all(cases):
    """For each (module, reference, x): (y, dx, dkernel) of the module and of the reference
    call ``reference(x, kernel)`` for the same cotangent, all in one jitted function."""
    graphdefs = [nnx.graphdef(m) for m, _, _ in cases]
    refs = [r for _, r, _ in cases]

    @jax.jit
    def run(states, xs, kernels):
        out = []
        for graphdef, ref, state, x, kernel in zip(graphdefs, refs, states, xs, kernels):
            y = jax.eval_shape(lambda s, x: nnx.merge(graphdef, s)(x), state, x)
            dy = jax.random.normal(jax.random.key(7), y.shape, jnp.float32).astype(y.dtype)
            y_m, dx_m, dstate = _vjp(lambda x, s: nnx.merge(graphdef, s)(x), x, state, dy)
            out.append(((y_m, dx_m, dstate["kernel"][...]), _vjp(ref, x, kernel, dy)))
        return out

    return run([nnx.state(m) for m, _, _ in cases], [x for _, _, x in cases],
               [m.kernel[...] for m, _, _ in cases])


def _assert_same(got, want):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@pytest.mark.parametrize("name", RECIPES)
def test_each_selected_gemm_is_lp_dot_general_bit_for_bit(name):
    """Every GEMM kind of a quantized block, a LinearGeneral over axis=(-2, -1) (one flattened
    K) and a user's module with a dot_general: output, dx and dkernel equal lp.dot_general's."""
    recipe = lp.get_recipe(name, policy="F0L0")
    model = GPT(num_layers=2)
    lp.apply_recipe(model, recipe)
    block = model.h[1]
    rngs = nnx.Rngs(0)
    extra = nnx.Dict(attn_out=nnx.LinearGeneral((HEADS, HEAD_DIM), D, axis=(-2, -1), use_bias=False,
                                                rngs=rngs, **BF16),
                     mine=MyDense(D, FFN, rngs))
    report = lp.apply_recipe(extra, recipe)
    assert set(report.quantized) == {"attn_out", "mine"} and report.layer_container is None
    assert extra["mine"].dot_general == lp.dot_general(recipe)
    dg = lp.dot_general(recipe)
    linear = lambda x, w: dg(x, w, (((2,), (0,)), ((), ())))  # noqa: E731
    x, heads, hidden = _x((2, 64, D)), _x((2, 64, HEADS, HEAD_DIM), 2), _x((2, 64, FFN), 3)
    for module in (block.fc, block.proj):  # the references have no bias
        module.bias.set_value(jnp.zeros_like(module.bias[...]))
    cases = [
        (block.qkv, linear, x),
        (block.out, lambda x, w: jnp.einsum("BLHK,HKD->BLD", x, w, preferred_element_type=x.dtype,
                                            _dot_general=dg), heads),
        (block.fc, linear, x),
        (block.proj, linear, hidden),
        (extra["attn_out"], lambda x, w: dg(x, w, (((2, 3), (0, 1)), ((), ()))), heads),
        (extra["mine"], linear, x),
    ]
    for got, want in _module_and_reference_all(cases):
        _assert_same(got, want)
        assert got[2].dtype == jnp.float32  # the weight gradient stays FP32


def _bf16_blocks(model, name):
    return [i for i, block in enumerate(model.h) if isinstance(current(getattr(block, name),
                                                                       _kind(name)).recipe, lp.BF16)]


def _kind(name):
    return {"qkv": "LinearGeneral", "out": "Einsum"}.get(name, "Linear")


@pytest.mark.parametrize("recipe,expected", [
    (lp.get_recipe("fp8_cs"), [0, 5]),                          # F1L1
    (lp.get_recipe("nvfp4"), [2, 3, 4, 5]),                     # F0L4
    (lp.get_recipe("mxfp8"), []),                               # F0L0
    (lp.get_recipe("fp8_block", policy="F2L1"), [0, 1, 5]),
    (lp.get_recipe("mxfp8", bf16_layers=[3]), [3]),
    (lp.get_recipe("nvfp4", policy="F1L0", bf16_layers=[4]), [0, 4]),
])
def test_layer_policy_lands_on_the_right_blocks(recipe, expected):
    model = GPT(num_layers=6)
    report = lp.apply_recipe(model, recipe)
    assert (report.layer_container, report.num_layers, report.stacked_container) == ("h", 6, False)
    assert "over 6 layers (container 'h')" in str(report).splitlines()[0]
    for name in GEMMS:
        assert _bf16_blocks(model, name) == expected
    assert isinstance(model.h[0].out.einsum_op, LowPrecisionEinsum)
    assert sorted({int(p.split("/")[1]) for p in report.bf16_by_policy}) == expected
    assert len(report.quantized) == 4 * (6 - len(expected))
    assert report.not_selected == ["lm_head"] == report.fp32_weight_gradients
    if expected:
        assert f"BF16 (layer policy): h/{{{_fold(expected)}}}/{{fc, out, proj, qkv}}" in str(report)


def _fold(indices):
    from lp_jax.surgery.report import _ranges
    return _ranges(indices)


def test_include_exclude_on_module_paths_and_reapplying():
    model = GPT(num_layers=2)
    report = lp.apply_recipe(model, lp.get_recipe("mxfp8"), include=r"h/\d+/(qkv|out)$", exclude="h/0/")
    assert set(report.quantized) == {"h/1/qkv", "h/1/out"}
    assert model.h[1].fc.dot_general == lp.dot_general("bf16")  # not selected: BF16, FP32 wgrad
    lp.apply_recipe(model, "bf16", fp32_weight_gradients=False, include="fc")
    assert model.h[1].qkv.dot_general is None and model.h[1].out.einsum_op is jnp.einsum


def test_a_stacked_model_gets_the_policy_per_slice():
    rngs = nnx.Rngs(0)

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return Block(rngs)

    model = nnx.Dict(blocks=make(rngs), head=nnx.Linear(D, VOCAB, rngs=rngs))
    report = lp.apply_recipe(model, lp.get_recipe("mxfp8", bf16_layers=[1]))
    assert (report.layer_container, report.num_layers, report.stacked_container) == ("blocks", 3, True)
    assert set(report.per_slice) == {f"blocks/{n}" for n in GEMMS}
    assert "over 3 layers (stacked container 'blocks')" in str(report)


def _state(model):
    return jax.tree.map(np.asarray, nnx.state(model)), nnx.graphdef(model)


def _refused(model, match, **kw):
    recipe = kw.pop("recipe", "mxfp8")
    before = nnx.graphdef(model)
    with pytest.raises(ValueError, match=match) as err:
        lp.apply_recipe(model, recipe, **kw)
    assert "\n" not in str(err.value)
    assert nnx.graphdef(model) == before  # nothing was swapped


def test_bad_input_is_one_line_and_changes_nothing():
    gpt = GPT(num_layers=2)
    _refused(gpt, r"include rule 'attn' matches no GEMM; the model's GEMMs are h/0/fc", include="attn")
    _refused(gpt, "exclude rule 'mlp' matches no GEMM", exclude=["h/0", "mlp"])
    _refused(gpt, r"selected no GEMM to run mxfp8: saw 9 GEMMs .*exclude=h/", exclude="h/")
    rngs = nnx.Rngs(0)
    conv = nnx.Dict(conv=nnx.Conv(3, 8, (3, 3), rngs=rngs), fc=nnx.Linear(8, 8, rngs=rngs))
    _refused(conv, r"include rule 'conv' matches no GEMM; it matches only .*conv \(Conv\)", include="conv")
    mlp = nnx.Dict(up=nnx.Linear(D, FFN, rngs=rngs), down=nnx.Linear(FFN, D, rngs=rngs))
    _refused(mlp, r"layer policy F0L4 needs the model's layers, but apply_recipe found no layer container",
             recipe="nvfp4")
    _refused(mlp, r"layer policy F0L0\+bf16\[0\] needs", recipe=lp.get_recipe("mxfp8", bf16_layers=[0]))
    assert len(lp.apply_recipe(mlp, lp.get_recipe("nvfp4", policy="F0L0")).quantized) == 2
    two = nnx.Dict(enc=nnx.List([Block(rngs)]), dec=nnx.List([Block(rngs), Block(rngs)]))
    _refused(two, r"several layer containers \(.*'enc' \(indexed, 1 layers\).*\): name one with layers=")
    _refused(two, r"layers='decoder' names no layer container", layers="decoder")
    assert lp.apply_recipe(two, "mxfp8", layers="dec").num_layers == 2
    batched = nnx.Dict(h=nnx.List([nnx.Dict(per_head=nnx.LinearGeneral(
        D, 8, batch_axis={0: HEADS}, axis=-1, rngs=rngs))]))
    _refused(batched, r"cannot quantize 1 selected GEMMs .*h/0/per_head: nnx.LinearGeneral with batch_axis")
    per_head = nnx.Dict(h=nnx.List([nnx.Dict(e=nnx.Einsum("BHLK,HKD->BHLD", (HEADS, HEAD_DIM, 8), rngs=rngs))]))
    _refused(per_head, r"h/0/e: nnx.Einsum 'BHLK,HKD->BHLD': 'H' appear in inputs, kernel and output")
    kernel_first = nnx.Dict(h=nnx.List([nnx.Dict(e=nnx.Einsum("BK,KD->DB", (D, 8), rngs=rngs))]))
    _refused(kernel_first, r"output 'DB' puts the kernel's axes first")
    _refused(per_head, "selected no GEMM", exclude="e")


def test_numbered_attributes_are_a_container():
    class Numbered(nnx.Module):
        def __init__(self, rngs):
            for i in range(3):
                setattr(self, f"block_{i}", nnx.Linear(D, D, rngs=rngs))

    report = lp.apply_recipe(Numbered(nnx.Rngs(0)), lp.get_recipe("fp8_cs"))  # F1L1
    assert (report.layer_container, report.num_layers) == ("block", 3)
    assert report.bf16_by_policy == ["block_0", "block_2"] and list(report.quantized) == ["block_1"]


@pytest.mark.slow
def test_the_docs_example_runs(capsys):
    text = (Path(__file__).parents[2] / "docs" / "your_model.md").read_text()
    section = text.split("## NNX models", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope = {}
    exec(compile(code, "docs/your_model.md", "exec"), scope)
    out = capsys.readouterr().out
    assert "over 4 layers (container 'h'): 8 GEMMs run NVFP4BlockScaling, 8 kept in BF16" in out
    losses = scope["losses"]
    assert losses[-1] < losses[0]
