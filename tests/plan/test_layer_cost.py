"""The plan's per-layer cost (``--layer-cost``): the quantization floor it is held against,
the split of a module's kernels into loop and rest, and the table it prints."""
import pytest

from lp_jax.plan.gpus import GPUS
from lp_jax.plan.layer_cost import Part, parts
from lp_jax.plan.quant_minimum import minimum_layer_bytes, tensor_bytes_per_element
from lp_jax.plan.table import layer_table
from lp_jax.recipes import get_recipe
from models import llama
from tests.plan.test_plan_hlo import LOOP
from tests.support.plan_targets import TINY, needs_plugin

EIGHT_B = llama.preset("llama3_8b")
TOKENS = 8192


def _hand_floor(bytes_per_element: float) -> float:
    """MXFP8 at the 8B's shapes, counted by hand: inputs (the attention norm's output once for
    q, k, v; the heads' output; the MLP norm's output once for gate and up; the SwiGLU
    product), the seven output gradients, the seven weights."""
    d, f, kv = 4096, 14336, 1024
    inputs = TOKENS * (d + d + d + f)
    grads = TOKENS * (d + kv + kv + d + f + f + d)
    weights = d * d + d * kv + d * kv + d * d + 3 * d * f
    return bytes_per_element * (inputs + grads + weights)


def test_the_mxfp8_floor_reads_each_tensor_once_and_writes_two_copies_with_scales():
    per_element = 2 + 2 * (1 + 1 / 32)
    got = minimum_layer_bytes(EIGHT_B, get_recipe("mxfp8"), TOKENS)
    assert got == pytest.approx(_hand_floor(per_element))
    assert 3.0e9 < got < 3.4e9  # about 3 GB per 8B layer of 8192 tokens


def test_bf16_has_no_floor_and_nvfp4s_tiled_weight_is_one_copy():
    assert minimum_layer_bytes(EIGHT_B, get_recipe("bf16"), TOKENS) == 0
    nvfp4 = get_recipe("nvfp4")
    assert tensor_bytes_per_element(nvfp4, "fprop_w", "dgrad_w") == pytest.approx(2 + 0.5 + 1 / 256)
    assert tensor_bytes_per_element(nvfp4, "fprop_x", "wgrad_x") == pytest.approx(2 + 2 * (0.5 + 1 / 16))
    one_d = get_recipe("nvfp4", disable_2d=True)
    assert tensor_bytes_per_element(one_d, "fprop_w", "dgrad_w") == pytest.approx(2 + 2 * (0.5 + 1 / 16))
    assert (minimum_layer_bytes(EIGHT_B, nvfp4, TOKENS)
            < minimum_layer_bytes(EIGHT_B, get_recipe("mxfp8"), TOKENS))


def test_a_loop_bodys_kernels_are_the_loop_part_and_nothing_is_left_outside():
    inside, outside = parts(LOOP, GPUS["b200"], 1)
    assert inside.kernels > 0 and inside.gemm_s > 0 and inside.hbm_bytes > 0
    assert outside == Part(0.0, 0, 0.0, 0.0)  # the entry only holds the loop and plumbing


def _row(recipe, hbm, kernels, gemm_ms, other_ms, floor):
    loops = Part(hbm, kernels, gemm_ms / 1e3, other_ms / 1e3)
    cost = {"loops": loops.as_dict(), "outside": Part(1e9, 10, 0.0, 1e-4).as_dict(),
            "quant_minimum_bytes": floor, "seq_len": 8192}
    return {"recipe": recipe, "layer_cost": cost}


def test_the_layer_table_holds_each_recipe_against_bf16_and_its_floor():
    rows = [_row("bf16", 30e9, 100, 8.0, 4.0, 0.0), _row("mxfp8", 36e9, 150, 4.0, 2.0, 3e9)]
    text = layer_table(rows, GPUS["b200"])
    bf16, mxfp8 = (line for line in text.splitlines() if line.startswith(("| bf16", "| mxfp8")))
    cells = [c.strip() for c in mxfp8.strip("|").split("|")]
    # extra 6 GB over BF16 against a 3 GB floor; 1.5x the kernels; 12 ms against 6 ms
    assert cells[1:6] == ["36.00", "6.00", "3.00", "2.00", "150"]
    assert cells[6] == "1.50" and cells[9] == "0.50" and cells[10] == "6.00" and cells[11] == "2.00"
    assert [c.strip() for c in bf16.strip("|").split("|")][2:5] == ["-", "-", "-"]


@pytest.mark.gpu_compile
@needs_plugin
def test_a_compiled_layer_is_its_loops_and_mxfp8_moves_at_least_its_floor_more_than_bf16():
    """The floor counts every quantization of a layer, its weights' included: compared with
    the weights' copies made in the layer (``precision.cache_weights=false``). The GEMMs are
    the reference backend's (BF16 GEMMs of the dequantized values, so they read what BF16's
    read): the native ones read 1-byte operands and write BF16 results, which can save more
    than quantizing costs (MXFP8 on cuDNN does, docs/plan.md). With the cache (the default)
    the weights' passes leave the layer loops, which then move less."""
    from lp_jax.plan.layer_cost import layer_cost
    from tests.plan.test_plan_memory import NARROW

    def run(recipe, *keys):
        return layer_cost(TINY, [*NARROW, "data.seq_len=1024", f"precision.recipe={recipe}", *keys],
                          GPUS["b200"], 1)

    cost = {"bf16": run("bf16", "precision.cache_weights=false"),
            "mxfp8": run("mxfp8", "precision.cache_weights=false", "precision.backend=reference")}
    for c in cost.values():
        # The layer's forward and backward run in the scans; outside them its optimizer
        # update and stacking move its parameters, a small part of its traffic at 1024 tokens.
        assert c.loops.kernels > 0 and c.loops.gemm_s > 0 and c.loops.other_s > 0
        assert 0 < c.outside.hbm_bytes < c.loops.hbm_bytes
    assert cost["bf16"].quant_minimum_bytes == 0 and cost["mxfp8"].quant_minimum_bytes > 0
    # Quantizing in passes of their own, beside GEMMs that read what BF16's read, cannot
    # move less than the floor more than BF16.
    extra = cost["mxfp8"].loops.hbm_bytes - cost["bf16"].loops.hbm_bytes
    assert extra >= cost["mxfp8"].quant_minimum_bytes, (extra, cost["mxfp8"].quant_minimum_bytes)
    cached = run("mxfp8", "precision.backend=reference")
    assert cached.loops.hbm_bytes < cost["mxfp8"].loops.hbm_bytes
    assert cached.loops.kernels < cost["mxfp8"].loops.kernels
