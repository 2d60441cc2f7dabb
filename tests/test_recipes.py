"""Recipes: names, overrides, per-operand choices of docs/numerics.md, hashability."""
import pytest

import lp_jax as lp


@pytest.mark.parametrize("name,cls", [
    ("bf16", lp.BF16), ("fp8_cs", lp.Float8CurrentScaling), ("mxfp8", lp.MXFP8BlockScaling),
    ("nvfp4", lp.NVFP4BlockScaling), ("bf16_mixed", lp.BF16),
    ("bf16_with_fp8_current_scaling_mixed", lp.Float8CurrentScaling),
    ("bf16_with_mxfp8_mixed", lp.MXFP8BlockScaling), ("bf16_with_nvfp4_mixed", lp.NVFP4BlockScaling),
    ("fp8_block", lp.Float8BlockScaling), ("Float8BlockScaling", lp.Float8BlockScaling),
    ("bf16_with_fp8_subchannel_scaling_mixed", lp.Float8BlockScaling),
])
def test_names(name, cls):
    assert type(lp.get_recipe(name)) is cls


def test_default_policies_follow_megatron_bridge():
    assert lp.get_recipe("fp8_cs").policy == "F1L1"
    assert lp.get_recipe("mxfp8").policy == "F0L0"
    assert lp.get_recipe("fp8_block").policy == "F0L0"
    assert lp.get_recipe("nvfp4").policy == "F0L4"
    assert lp.get_recipe("nvfp4", policy="F2L1").policy == "F2L1"


def test_fp8_cs_operands_hybrid():
    r = lp.get_recipe("fp8_cs")
    assert (r.fprop_x.fmt, r.fprop_w.fmt, r.dgrad_dy.fmt) == ("fp8_e4m3", "fp8_e4m3", "fp8_e5m2")
    assert (r.dgrad_w.fmt, r.wgrad_x.fmt, r.wgrad_dy.fmt) == ("fp8_e4m3", "fp8_e4m3", "fp8_e5m2")
    assert lp.get_recipe("fp8_cs", fp8_format="E4M3").dgrad_dy.fmt == "fp8_e4m3"


def test_mxfp8_operands_all_e4m3_blocks():
    r = lp.get_recipe("mxfp8", scale_rule="floor")
    for f in ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_x", "wgrad_dy"):
        assert getattr(r, f) == lp.OperandSpec("mxfp8", scale_rule="floor")


def test_fp8_block_operands_rows_and_weight_tiles():
    r = lp.get_recipe("fp8_block")
    rows, tiles = lp.OperandSpec("fp8_block"), lp.OperandSpec("fp8_block", block_2d=True)
    assert (r.fprop_x, r.dgrad_dy, r.wgrad_x, r.wgrad_dy) == (rows,) * 4
    assert r.fprop_w == r.dgrad_w == tiles  # one copy serves both weight GEMMs
    assert (r.gemm_dtype, r.native_backend) == ("fp8", "cudnn")
    with pytest.raises(ValueError, match="backend='xla_fp8' cannot run recipe 'fp8_block'"):
        lp.get_recipe("fp8_block", backend="xla_fp8")
    with pytest.raises(ValueError, match="quantize_impl='pallas' cannot run recipe 'fp8_block'"):
        lp.get_recipe("fp8_block", quantize_impl="pallas")


def test_fp8_block_hybrid_puts_the_gradients_in_e5m2_blocks_as_bridge_does():
    """TE's Float8BlockScaling defaults to E4M3 everywhere; fp8_format HYBRID puts dy of the
    dgrad and wgrad GEMMs in E5M2 1x128 blocks. Bridge's subchannel recipe is HYBRID."""
    assert lp.get_recipe("fp8_block").fp8_format == "E4M3"
    assert lp.get_recipe("Float8BlockScaling").fp8_format == "E4M3"
    bridge = lp.get_recipe("bf16_with_fp8_subchannel_scaling_mixed")
    assert bridge == lp.get_recipe("fp8_block", fp8_format="HYBRID") and bridge.policy == "F0L0"
    rows, tiles = lp.OperandSpec("fp8_block"), lp.OperandSpec("fp8_block", block_2d=True)
    assert (bridge.fprop_x, bridge.fprop_w, bridge.dgrad_w, bridge.wgrad_x) == (rows, tiles, tiles, rows)
    assert bridge.dgrad_dy == bridge.wgrad_dy == lp.OperandSpec("fp8_block_e5m2")
    assert bridge.native_backends == ("cudnn", "wgmma", "xla_scaled_dot")
    # fields given with the Bridge name go on top of Bridge's
    e4m3 = lp.get_recipe("bf16_with_fp8_subchannel_scaling_mixed", fp8_format="E4M3")
    assert e4m3 == lp.get_recipe("fp8_block")
    with pytest.raises(ValueError, match=r"fp8_format='E5M2' is not valid; expected one of"):
        lp.get_recipe("fp8_block", fp8_format="E5M2")


def test_nvfp4_4over6_on_weights_activations_or_all_never_gradients():
    assert lp.get_recipe("nvfp4").fprop_w.block_scale_search is None  # off by default
    fields = ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_x", "wgrad_dy")
    for on, searched in (("weights", {"fprop_w", "dgrad_w"}), ("activations", {"fprop_x", "wgrad_x"}),
                         ("all", {"fprop_w", "dgrad_w", "fprop_x", "wgrad_x"})):
        r = lp.get_recipe("nvfp4", block_scale_search="4over6", block_scale_search_on=on,
                          block_scale_search_metric="mse")
        assert {f for f in fields if getattr(r, f).block_scale_search == "4over6"} == searched
        assert all(getattr(r, f).metric == "mse" for f in searched)
        assert r.wgrad_x.rht  # the RHT'd copy is chosen after the transform
    for kwargs, match in ((dict(block_scale_search="4/6"), "block_scale_search='4/6' is not valid"),
                          (dict(block_scale_search="4over6", block_scale_search_on="grads"), "not valid"),
                          (dict(block_scale_search="4over6", block_scale_search_metric="max"), "not valid"),
                          (dict(block_scale_search="4over6", quantize_impl="pallas"), "no Pallas")):
        with pytest.raises(ValueError, match=match):
            lp.get_recipe("nvfp4", **kwargs)


def test_nvfp4_operands_and_ablations():
    r = lp.get_recipe("nvfp4")
    assert r.fprop_w.block_2d and r.dgrad_w == r.fprop_w
    assert not r.fprop_x.block_2d and not r.fprop_x.stochastic and not r.fprop_x.rht
    assert r.dgrad_dy.stochastic and not r.dgrad_dy.rht
    assert r.wgrad_x.rht and not r.wgrad_x.stochastic
    assert r.wgrad_dy.rht and r.wgrad_dy.stochastic
    off = lp.get_recipe("nvfp4", disable_rht=True, disable_stochastic_rounding=True, disable_2d=True)
    assert not any(getattr(off, f).rht or getattr(off, f).stochastic or getattr(off, f).block_2d
                   for f in ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_x", "wgrad_dy"))


def test_recipes_are_hashable_and_compare_by_value():
    a, b = lp.get_recipe("nvfp4"), lp.get_recipe("bf16_with_nvfp4_mixed")
    assert a == b and hash(a) == hash(b)
    assert a != lp.get_recipe("nvfp4", disable_rht=True)
    assert lp.dot_general(a) == lp.dot_general("nvfp4")


@pytest.mark.parametrize("call,match", [
    (lambda: lp.get_recipe("fp4"), "unknown recipe 'fp4'.*valid names"),
    (lambda: lp.get_recipe("nvfp4", disable_hadamard=True), "no field 'disable_hadamard'.*disable_rht"),
    (lambda: lp.get_recipe("fp8_cs", fp8_format="E5M2"), "fp8_format"),
    (lambda: lp.get_recipe("mxfp8", scale_rule="ceil"), "scale_rule"),
    (lambda: lp.get_recipe("nvfp4", last_bf16_layers=-1), "last_bf16_layers"),
    (lambda: lp.get_recipe("nvfp4", policy="L4"), "F<i>L<j>"),
    (lambda: lp.get_recipe("bf16", backend="cuda"), "backend"),
])
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
