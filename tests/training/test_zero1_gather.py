"""ZeRO-1's weight gather of param_gather kernels (lp_jax.training.zero1_gather): FP8/FP4 bytes
quantized from each data rank's slice of the FP32 master, with the whole master's codes.

In-process, the data ranks stood in for by a vmap named "data": each rank's gathered copies
are the NumPy oracle's quantization of the whole FP32 master, for slices along either
dimension. In a subprocess on 2 forced CPU devices (slow): which kernels are sliced (the
scanned layers' Linears) and which gathered in FP32 (a lone layer's), and the first train
step on 2 data ranks with ZeRO-1 equal to the one without (every rank holding the FP32
masters), with FP8/FP4 bytes in the compiled all-gathers.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lp_jax as lp
from lp_jax.gemm.param_gather import gathered_copies
from tests.support import numpy_reference as ref
from tests.support.forced_devices import run_python
from tests.support.quantize_checks import codes


def _values(q):
    """The dequantized values of a quantized weight copy, float32."""
    return np.asarray(lp.dequantize(q))


@pytest.mark.parametrize("name", ["fp8_cs", "mxfp8", "nvfp4", "fp8_block"])
@pytest.mark.parametrize("dim", [0, 1])
def test_each_ranks_gathered_copies_are_the_whole_fp32_masters(name, dim):
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((256, 256)) * 0.05).astype(np.float32)
    w[200, 3] = 2.0  # the tensor amax lives on rank 1's slice along either dimension
    recipe = lp.get_recipe(name, param_gather=True)
    slices = jnp.stack(np.split(w, 2, axis=dim))
    fq, dq = jax.jit(jax.vmap(lambda s: gathered_copies(recipe, s, jnp.bfloat16, dim, "data"),
                              axis_name="data"))(slices)
    for spec, axis, copy in ((recipe.fprop_w, 0, fq), (recipe.dgrad_w, 1, dq if dq is not None else fq)):
        want = ref.quantize(w, spec.fmt, axis, block_2d=spec.block_2d)
        for rank in range(2):
            got = jax.tree.map(lambda a, rank=rank: a[rank], copy)
            np.testing.assert_array_equal(codes(got.data), want.data, err_msg=f"{name} rank {rank} axis {axis}")
            np.testing.assert_array_equal(_values(got), want.dequantized)
    assert (dq is None) == (name in ("fp8_cs", "nvfp4", "fp8_block"))  # one copy serves both GEMMs


STEP = r'''
import collections, json, re, sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
import lp_jax
from lp_jax.parallel.linear_layout import LinearLayout
from lp_jax.parallel.mesh import make_mesh
from lp_jax.parallel.partitioning import path_string
from lp_jax.training import state as state_lib, zero1_gather
from lp_jax.training.optimizer import make_optimizer
from lp_jax.training.step import StepSpec, jitted_train_step
from models import llama
from tests.support.sharded_runs import OPTIMIZER, batches

recipe_name = sys.argv[1]
GATHER = re.compile(r"=\s*(\w+)\[([\d,]*)\]\S*\s+all-gather(?:-start)?\(")
out = {}
for tag, sizes, zero1, pg in (("dp", (2, 1, 1), False, True), ("zero1", (2, 1, 1), True, True),
                              ("zero1_off", (2, 1, 1), True, False)):
    mesh = make_mesh(*sizes)
    spec = StepSpec(OPTIMIZER, 1, mesh, shard_optimizer=zero1, gather_dtype="bfloat16")
    # Layers 2-3 a scanned run, layer 0 quantized alone, layer 1 in BF16.
    recipe = lp_jax.get_recipe(recipe_name, first_bf16_layers=0, last_bf16_layers=0, bf16_layers=(1,),
                               param_gather=pg)
    cfg = llama.preset("tiny", num_layers=4, scan_layers=True)

    def build_model():
        model = llama.Llama(cfg, rngs=nnx.Rngs(0))
        lp_jax.apply_recipe(model, recipe, layout=LinearLayout(dict(mesh.shape)))
        return model

    tx = make_optimizer(OPTIMIZER)
    graphdef, params, rest = state_lib.split_model(nnx.eval_shape(build_model))
    target = state_lib.abstract_state((graphdef, params, rest), tx, 0)
    state = state_lib.init_state(build_model, tx, 0, spec.state_shardings(target))
    plan = zero1_gather.plan(spec, graphdef, state["params"], state["rest"])
    batch = state_lib.place_batch(batches(cfg.vocab_size)[0], 1, mesh)
    compiled = jitted_train_step(spec, state).lower(graphdef, spec, state, batch).compile()
    gathers = collections.Counter()
    for dtype, dims in GATHER.findall(compiled.as_text()):
        gathers[dtype] += 1
    state, metrics = compiled(state, batch)
    mu = {path_string(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(state["opt_state"])
          if ".mu" in jax.tree_util.keystr(p) or "'mu'" in jax.tree_util.keystr(p)}
    out[tag] = dict(loss=float(metrics["loss"]), grad_norm=float(metrics["grad_norm"]),
                    sliced=sorted(plan.sliced), full=sorted(plan.full), gathers=dict(gathers), mu=mu)
ref = out["dp"]["mu"]
for tag in ("zero1", "zero1_off"):
    out[tag]["mu_rel"] = max(float(np.abs(out[tag]["mu"][k] - ref[k]).max() / max(np.abs(ref[k]).max(), 1e-30))
                             for k in ref)
for tag in out:
    del out[tag]["mu"]
print(json.dumps(out))
'''

LINEARS = ("attn/q_proj", "attn/k_proj", "attn/v_proj", "attn/o_proj", "mlp/gate_proj", "mlp/up_proj",
           "mlp/down_proj")


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["fp8_cs", "mxfp8", "nvfp4"])
def test_zero1_step_gathers_bytes_and_equals_replicated_fp32_masters(recipe):
    """Two data ranks, with ZeRO-1 and without it (each rank holding the whole FP32 masters):
    the same first step. Param_gather off under ZeRO-1 (the copies from the BF16 cast) is
    another step, which the tolerances tell apart."""
    out = json.loads(run_python(["-c", STEP, recipe], devices=2, timeout=900).stdout.strip().splitlines()[-1])
    dp, zero1, off = out["dp"], out["zero1"], out["zero1_off"]
    # The scanned run's Linears gather bytes; the lone quantized layer 0 gathers FP32.
    assert zero1["sliced"] == sorted(f"layers/{i}/{n}/kernel" for i in (2, 3) for n in LINEARS), zero1
    assert zero1["full"] == sorted(f"layers/0/{n}/kernel" for n in LINEARS), zero1
    assert dp["sliced"] == dp["full"] == off["sliced"] == off["full"] == [], out
    assert abs(zero1["loss"] - dp["loss"]) <= 1e-6 * dp["loss"], out
    assert abs(zero1["grad_norm"] - dp["grad_norm"]) <= 1e-5 * dp["grad_norm"], out
    assert zero1["mu_rel"] <= 1e-5 < off["mu_rel"], out  # first moments: the first gradients
    # Bytes on the wire (u8) with param_gather; none off, where XLA:CPU widens BF16 gathers to f32.
    assert zero1["gathers"].get("u8", 0) > 0 and "u8" not in off["gathers"], out
