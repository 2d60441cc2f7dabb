"""precision.param_gather (Megatron's fp8_param_gather / fp4_param_gather): the quantized
Linears' weight copies come from the FP32 masters, and FSDP all-gathers move their FP8/FP4
bytes and scales, quantized from each device's FP32 master shard, with the unsharded codes.

In-process: the wire format (FP4 codes two per byte), the recipe and config key, the weight
copies against the NumPy oracle's quantization of the FP32 master (on) and of its BF16 cast
(off), and which Linears get a gather layout (quantized ones, by the partitioning rules; the
state tree is untouched). In subprocesses with 8 forced CPU devices: on meshes (1,8,1),
(2,4,1), (2,2,2), for column- and row-parallel kernels, the gathered bytes and scales equal
``lp_jax.quantize`` of the whole weight (FP32 on, its BF16 cast off) bit for bit, and y, dx
equal the partitioner-gathered GEMM's bit for bit, dW to FP32 summation order (on (2,2,2)
also lowered for CUDA, where the xla_fp8/cudnn GEMMs take the gathered operands); (slow) the
trainer's first step equals the partitioner-gathered masters', with FP8/FP4 bytes in the
compiled all-gathers and one scalar all-reduce(max) per tensor amax; (slow) a checkpoint
crosses param_gather on/off.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lp_jax
from lp_jax.config.schema import PrecisionConfig
from lp_jax.gemm.operands import Transposed
from lp_jax.gemm.param_gather import _from_wire, _to_wire
from lp_jax.gemm.prepared_kernel import weight_operands
from lp_jax.parallel.linear_layout import LinearLayout
from models import llama
from tests.support import numpy_reference as ref
from tests.support.forced_devices import run_python
from tests.support.quantize_checks import codes

MESHES = ((1, 8, 1), (2, 4, 1), (2, 2, 2))


def _subprocess(args, timeout=600):
    return run_python(args, timeout=timeout).stdout


@pytest.mark.parametrize("dtype", [jnp.float4_e2m1fn, jnp.float8_e4m3fn, jnp.float8_e8m0fnu])
def test_low_precision_arrays_travel_as_bytes(dtype):
    codes = np.random.default_rng(0).integers(0, 16 if dtype == jnp.float4_e2m1fn else 255, (6, 8))
    a = jax.lax.bitcast_convert_type(jnp.asarray(codes, jnp.uint4 if dtype == jnp.float4_e2m1fn
                                                 else jnp.uint8), dtype)
    for axis in (0, 1):
        wire = _to_wire(a, axis)
        assert wire.dtype == jnp.uint8
        packed = list(a.shape)
        packed[axis] //= 2 if dtype == jnp.float4_e2m1fn else 1  # FP4: two codes per byte
        assert list(wire.shape) == packed
        back = _from_wire(wire, a.dtype, axis)
        assert back.dtype == a.dtype
        bits = jnp.uint4 if dtype == jnp.float4_e2m1fn else jnp.uint8
        np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(back, bits)), codes)


def test_recipe_and_config_key():
    # Off by default, as Megatron's fp8_param_gather: the weights' BF16 cast is quantized.
    assert not any(lp_jax.get_recipe(n).param_gather for n in ("bf16", "fp8_cs", "mxfp8", "nvfp4"))
    assert lp_jax.get_recipe("mxfp8", param_gather=True).param_gather
    with pytest.raises(ValueError, match="param_gather='yes' must be true or false"):
        lp_jax.get_recipe("nvfp4", param_gather="yes")
    assert "param_gather" not in PrecisionConfig().overrides()  # None: the recipe's default
    assert PrecisionConfig(param_gather=False).overrides()["param_gather"] is False


def _copy_codes(copy):
    """(data codes, scale bits, global scale) of a weight copy, and whether it is stored
    transposed (a 1-D block copy along the kernel's first axis)."""
    q = copy.q if isinstance(copy, Transposed) else copy
    scale = np.asarray(q.scale)
    return (codes(q.data), scale.view(np.uint8 if scale.dtype.itemsize == 1 else np.uint32),
            None if q.global_scale is None else np.float32(q.global_scale)), isinstance(copy, Transposed)


def _oracle_codes(w, spec, axis, transposed):
    """The NumPy oracle's (data codes, scale bits, global scale) of the kernel ``w`` [K, N]."""
    t, axis = (w.T, 1) if transposed else (w, axis)
    r = ref.quantize(t, spec.fmt, axis, block_2d=spec.block_2d, scale_rule=spec.scale_rule)
    scale = np.asarray(r.scale)
    return r.data, scale.view(np.uint8 if scale.dtype.itemsize == 1 else np.uint32), r.global_scale


@pytest.mark.parametrize("name", ["fp8_cs", "fp8_block", "mxfp8", "nvfp4"])
def test_param_gather_quantizes_the_fp32_master_and_off_its_bf16_cast(name):
    """With param_gather the weight's fprop and dgrad copies are the NumPy oracle's
    quantization of the FP32 master itself (one rounding, TE's fp8/fp4_param_gather); off,
    of its BF16 cast (two roundings). The two differ on some element: a cast rounds first."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((128, 256)) * 0.05).astype(np.float32)
    w_bf16 = np.asarray(jnp.asarray(w).astype(jnp.bfloat16).astype(jnp.float32))
    got = {}
    for param_gather, source in ((True, w), (False, w_bf16)):
        r = lp_jax.get_recipe(name, param_gather=param_gather)
        copies = jax.jit(lambda w, r=r: weight_operands(r, w, jnp.bfloat16, materialize=True))(w)
        for copy, spec, axis in zip(copies, (r.fprop_w, r.dgrad_w), (0, 1)):
            (data, scale, global_scale), transposed = _copy_codes(copy)
            want_data, want_scale, want_global = _oracle_codes(source, spec, axis, transposed)
            np.testing.assert_array_equal(data, want_data, err_msg=f"{name} {param_gather} axis {axis}")
            np.testing.assert_array_equal(scale, want_scale, err_msg=f"{name} {param_gather} axis {axis}")
            assert (global_scale is None) == (want_global is None) and \
                (global_scale is None or global_scale == want_global)
            got[param_gather, axis] = data
    assert any(not np.array_equal(got[True, a], got[False, a]) for a in (0, 1))


def _layouts(model):
    return {"/".join(map(str, p)): n.dot_general.gather for p, n in nnx.iter_graph(model)
            if isinstance(n, nnx.Linear)}


def test_layouts_follow_the_partitioning_rules_and_leave_the_state_alone():
    model = nnx.eval_shape(lambda: llama.Llama(llama.preset("tiny", num_layers=4), rngs=nnx.Rngs(0)))
    before = jax.tree.map(lambda x: (x.shape, x.dtype), nnx.state(model))
    # F1L1: layers 0 and 3 stay in BF16
    gathered = lp_jax.apply_recipe(model, lp_jax.get_recipe("fp8_cs", param_gather=True),
                                   layout=LinearLayout({"data": 1, "fsdp": 4, "tensor": 2})).gathered
    layouts = _layouts(model)
    column, row = ("fsdp", "tensor"), ("tensor", "fsdp")
    for layer in (1, 2):
        for name in ("attn/q_proj", "attn/k_proj", "attn/v_proj", "mlp/gate_proj", "mlp/up_proj"):
            assert layouts[f"layers/{layer}/{name}"] == column
        for name in ("attn/o_proj", "mlp/down_proj"):
            assert layouts[f"layers/{layer}/{name}"] == row
    assert sorted(gathered) == sorted(p for p, layout in layouts.items() if layout)
    assert len(gathered) == 14  # BF16-policy layers and the LM head gather as before
    assert layouts["lm_head"] is None and layouts["layers/0/attn/q_proj"] is None
    assert jax.tree.map(lambda x: (x.shape, x.dtype), nnx.state(model)) == before
    # nothing sharded
    assert lp_jax.apply_recipe(model, lp_jax.get_recipe("fp8_cs", param_gather=True),
                               layout=LinearLayout({"data": 8, "fsdp": 1, "tensor": 1})).gathered == []
    assert not any(_layouts(model).values())
    assert lp_jax.apply_recipe(model, lp_jax.get_recipe("fp8_cs", param_gather=False),
                               layout=LinearLayout({"data": 1, "fsdp": 8, "tensor": 1})).gathered == []



def _quantize_impls(model):
    return {n.dot_general.recipe.quantize_impl for _, n in nnx.iter_graph(model)
            if isinstance(n, nnx.Linear) and n.dot_general.recipe.quantized}


def test_auto_quantizers_stay_xla_where_the_partitioner_splits_the_gemms():
    """The Pallas kernels bring no partitioning rule: with fsdp or tensor > 1, "auto" is
    XLA's quantizers; with data parallelism alone (local GEMMs) it stays "auto"."""
    model = nnx.eval_shape(lambda: llama.Llama(llama.preset("tiny", num_layers=2), rngs=nnx.Rngs(0)))
    for mesh, impls in (({"data": 1, "fsdp": 2, "tensor": 1}, {"xla"}),
                        ({"data": 1, "fsdp": 1, "tensor": 2}, {"xla"}),
                        ({"data": 8, "fsdp": 1, "tensor": 1}, {"auto"})):
        lp_jax.apply_recipe(model, "mxfp8", layout=LinearLayout(mesh))
        assert _quantize_impls(model) == impls, mesh
    lp_jax.apply_recipe(model, lp_jax.get_recipe("mxfp8", quantize_impl="pallas"),
                        layout=LinearLayout({"data": 1, "fsdp": 2, "tensor": 1}))
    assert _quantize_impls(model) == {"pallas"}  # a forced choice is the user's


GEMMS = r'''
import json, re, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import lp_jax as lp
from lp_jax.gemm import param_gather
from lp_jax.gemm.dot_general import LowPrecisionDotGeneral
from lp_jax.gemm.operands import quantize_kwargs
from lp_jax.parallel.mesh import make_mesh

rng = np.random.default_rng(0)
x = rng.standard_normal((64, 512)).astype(np.float32)
# [K, N]: every shard whole MXFP8 blocks, NVFP4 tiles and FP8 128x128 tiles on every mesh
w = (rng.standard_normal((512, 256)) * 0.05).astype(np.float32)
w[5, 250] = 3.0  # the tensor amax lives on one shard
w_nan = w.copy()
w_nan[300, 7] = np.nan  # a NaN on one shard makes the tensor scale 1, as unsharded
dn = (((1,), (0,)), ((), ()))
LAYOUTS = (("fsdp", "tensor"), ("tensor", "fsdp"))  # column- and row-parallel kernels [K, N]
failures, checked = [], 0
cuda = sys.argv[1] == "cuda"

def leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        p.dtype == q.dtype and np.array_equal(np.atleast_1d(np.asarray(p)).view(np.uint8),
                                              np.atleast_1d(np.asarray(q)).view(np.uint8)) for p, q in zip(la, lb))

for sizes in [tuple(map(int, m.split(","))) for m in sys.argv[2:]]:
    mesh = make_mesh(*sizes)
    # FP8 block's 128x128 tiles stay whole only where no axis of w is split more than 2 ways
    for name, pg in [(n, pg) for n in ("fp8_cs", "mxfp8", "nvfp4") + (("fp8_block",) if max(sizes[1:]) <= 2 else ())
                     for pg in (False, True)]:
        r = lp.get_recipe(name, first_bf16_layers=0, last_bf16_layers=0, param_gather=pg)
        shard = lambda layout: NamedSharding(mesh, P(*layout))

        def both(w_col, w_row):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                out = []
                for layout, ww in zip(LAYOUTS, (w_col, w_row)):
                    fq, dq = param_gather.forward(r, layout, ww, jnp.bfloat16)
                    out.append((fq, param_gather.backward(layout, dq)))
                return out

        for weight in (w, w_nan):
            # param_gather quantizes the FP32 master; off, its BF16 cast
            wc = jnp.asarray(weight) if pg else jnp.asarray(weight).astype(jnp.bfloat16)
            want_f = lp.quantize(wc, r.fprop_w.fmt, axis=0, **quantize_kwargs(r.fprop_w))
            want_d = lp.quantize(wc, r.dgrad_w.fmt, axis=1, **quantize_kwargs(r.dgrad_w))
            got = jax.jit(both, in_shardings=(shard(LAYOUTS[0]), shard(LAYOUTS[1])))(weight, weight)
            for layout, (fq, bq) in zip(LAYOUTS, got):
                checked += 1
                if not (leaves_equal(fq, want_f) and leaves_equal(bq, want_d)):
                    failures.append(f"{name} pg={pg} {sizes} {layout} {'NaN ' if weight is w_nan else ''}weight: "
                                    "gathered bytes differ from quantize(w)")

        def grads(x, w_col, w_row):
            out = []
            for layout, ww in zip(LAYOUTS, (w_col, w_row)):
                for gather in (None, layout):
                    dg = LowPrecisionDotGeneral(r, gather)
                    def loss(x, ww):
                        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                            y = dg(x.astype(jnp.bfloat16), ww, dn)
                        return jnp.sum(y.astype(jnp.float32) ** 2), y
                    (_, y), (gx, gw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, ww)
                    out.append((y, gx, gw))
            return out

        rows = NamedSharding(mesh, P(("data", "fsdp"), None))
        outs = jax.jit(grads, in_shardings=(rows, shard(LAYOUTS[0]), shard(LAYOUTS[1])))(x, w, w)
        for i, layout in enumerate(LAYOUTS):
            (y0, gx0, gw0), (y1, gx1, gw1) = outs[2 * i], outs[2 * i + 1]
            tag = f"{name} pg={pg} {sizes} {layout}"
            if not (np.array_equal(np.asarray(y0), np.asarray(y1)) and np.array_equal(np.asarray(gx0), np.asarray(gx1))):
                failures.append(f"{tag}: y or dx differs with param_gather")
            gw0, gw1 = np.asarray(gw0), np.asarray(gw1)
            if np.abs(gw1 - gw0).max() > 1e-5 * np.abs(gw0).max():
                failures.append(f"{tag}: dW differs beyond FP32 summation order")
        if cuda and pg:  # the GPU backends (xla_fp8, cudnn) take the gathered operands: lowered for CUDA
            module = jax.jit(grads).trace(x, w, w).lower(lowering_platforms=("cuda",)).as_text()
            wire = re.findall(r'"stablehlo\.all_gather".* : \(tensor<(?:\d+x)*(\w+)>\)', module)
            # fwd + bwd, 2 layouts; FP8 block's one copy serves both GEMMs, its FP32 scales travel as they are
            want = {"fp8_cs": ["ui8"] * 4, "fp8_block": ["f32", "ui8"] * 4}.get(name, ["ui8"] * 8)
            if sorted(wire) != sorted(want):
                failures.append(f"{name} {sizes}: CUDA lowering gathers {wire}")
print(json.dumps({"checked": checked, "failures": failures}))
'''


@pytest.mark.parametrize("mesh", [pytest.param(m, marks=[] if m == (2, 2, 2) else [pytest.mark.slow])
                                  for m in MESHES], ids=lambda m: "x".join(map(str, m)))
def test_gathered_bytes_and_gemms_equal_the_unsharded_recipe(mesh):
    out = _subprocess(["-c", GEMMS, "cuda" if mesh == (2, 2, 2) else "-", ",".join(map(str, mesh))])
    result = json.loads(out.strip().splitlines()[-1])
    recipes = 4 if max(mesh[1:]) <= 2 else 3  # fp8_block where its tiles stay whole
    assert result["checked"] == recipes * 2 * 2 * 2, result  # x param_gather on, off x column-, row-parallel x 2 weights
    assert result["failures"] == [], result["failures"]


def test_a_shard_of_partial_blocks_is_refused():
    from jax.sharding import AbstractMesh

    from lp_jax.gemm import param_gather

    mesh = AbstractMesh((1, 8, 1), ("data", "fsdp", "tensor"))
    w = jax.ShapeDtypeStruct((128, 64), jnp.float32)  # 8 shards of 16 rows: half MXFP8 blocks
    with jax.sharding.use_abstract_mesh(mesh), pytest.raises(ValueError, match="splits mxfp8 blocks of 32"):
        jax.eval_shape(lambda w: param_gather.forward(lp_jax.get_recipe("mxfp8"), ("fsdp", None), w,
                                                      jnp.bfloat16), w)
    w = jax.ShapeDtypeStruct((1024, 64), jnp.float32)  # 64 columns in 8 shards: partial 128x128 tiles
    with jax.sharding.use_abstract_mesh(mesh), \
            pytest.raises(ValueError, match="splits fp8_block blocks of 128"):
        jax.eval_shape(lambda w: param_gather.forward(lp_jax.get_recipe("fp8_block"), (None, "fsdp"), w,
                                                      jnp.bfloat16), w)


# (element type bitcast to bytes for the gathers, gathers per Linear per pass, tensor amax?,
# per-tensor amaxes of activations and gradients per Linear: on a mesh with a data axis each
# is one scalar all-reduce(max) over data (the data shard_map, manual_axes.tensor_amax): FP8-CS
# x and dy; NVFP4 x, dy and their RHT'd wgrad copies)
_WIRE = {"fp8_cs": ({"f8E4M3FN->ui8"}, 1, True, 2),
         "mxfp8": ({"f8E4M3FN->ui8", "f8E8M0FNU->ui8"}, 2, False, 0),
         "nvfp4": ({"f4E2M1FN->ui4", "f8E4M3FN->ui8"}, 2, True, 4)}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(_WIRE))
def test_first_train_step_and_its_all_gathers(recipe):
    result = json.loads(_subprocess(["tests/support/param_gather_runs.py", recipe, "2,2,2"]).splitlines()[-1])
    (loss_off, loss_on), (norm_off, norm_on) = result["loss"], result["grad_norm"]
    assert abs(loss_on - loss_off) <= 1e-6 * abs(loss_off), result["loss"]
    assert abs(norm_on - norm_off) <= 1e-5 * abs(norm_off), result["grad_norm"]
    assert max(result["mu_rel"].values()) <= 1e-5, result["mu_rel"]  # first gradients
    types, per_pass, tensor_amax, data_amaxes = _WIRE[recipe]
    linears = 2 * 7  # 2 layers x q, k, v, o, gate, up, down
    gathers = 2 * per_pass * linears  # forward and backward
    on, off = result["on"], result["off"]
    assert on["lowered_gathers"] == {"ui8": gathers}, on
    assert on["compiled_gathers"].get("u8") == gathers, on
    # Each gathered payload is the bitcast of FP8/FP4 codes or scales (E8M0 scales are also
    # bitcast when the reference GEMM decodes them, hence at least).
    assert set(on["bitcast_to_bytes"]) == types, on
    assert all(n >= 2 * linears for n in on["bitcast_to_bytes"].values()), on
    # One all-reduce(max) over fsdp per quantized weight, besides the data axis's (mesh 2,2,2).
    assert on["lowered_scalar_max_all_reduces"] == linears * (int(tensor_amax) + data_amaxes), on
    # Off, the partitioner gathers each weight's BF16 cast forward and backward (XLA:CPU widens
    # those all-gathers to f32); on, those 2 x 14 are gone and nothing else moves.
    assert "u8" not in off["compiled_gathers"] and not off["lowered_gathers"], off
    assert off["compiled_gathers"]["f32"] - on["compiled_gathers"].get("f32", 0) == 2 * linears, (off, on)


RESUME = r'''
import json, sys
from lp_jax.config.yaml_io import load_config
from lp_jax.training.loop import run
from lp_jax.training.metrics import read_metrics
from lp_jax.training.validate import resolve

tmp = sys.argv[1]
common = ["model.preset=tiny", "model.num_layers=2", "steps=3", "data.source=mock", "data.seq_len=32",
          "data.global_batch_size=8", "data.micro_batch_size=1", "logging.val_batches=0",
          "logging.progress_bar=false", "logging.tensorboard=false", "checkpoint.async_save=false",
          "schedule.warmup_steps=2", "mesh.data=1", "mesh.fsdp=8", "precision.recipe=fp8_cs",
          "precision.first_bf16_layers=0", "precision.last_bf16_layers=0"]
plan = lambda run_dir, *extra: resolve(load_config(None, [f"run_dir={run_dir}", *common, *extra]))
for name, first, then in (("on_off", "true", "false"), ("off_on", "false", "true")):
    run(plan(f"{tmp}/{name}", f"precision.param_gather={first}", "stop_at=1"))
    run(plan(f"{tmp}/{name}", f"precision.param_gather={then}"))
for name, setting in (("on", "true"), ("off", "false")):
    run(plan(f"{tmp}/{name}", f"precision.param_gather={setting}"))
print(json.dumps({name: [m["loss"] for m in read_metrics(f"{tmp}/{name}")]
                  for name in ("on_off", "off_on", "on", "off")}))
'''


@pytest.mark.slow
def test_checkpoint_crosses_param_gather_on_and_off(tmp_path):
    """A checkpoint written with param_gather on resumes with it off and the reverse. Step 1
    runs at lr 0, so step 2 reads the initial weights again: there a resumed run's loss is
    that of a run with its new setting from the start. The two settings' losses differ (the
    weights' copies are rounded from the FP32 master or from its BF16 cast)."""
    out = _subprocess(["-c", RESUME, str(tmp_path)])
    losses = {k: np.array(v) for k, v in json.loads(out.strip().splitlines()[-1]).items()}
    assert all(len(v) == 3 for v in losses.values()), losses
    on, off = losses["on"], losses["off"]
    assert abs(on[0] - off[0]) > 1e-6 * abs(off[0]), losses
    np.testing.assert_allclose([losses["on_off"][0], losses["off_on"][0]], [on[0], off[0]], rtol=1e-6)
    np.testing.assert_allclose([losses["on_off"][1], losses["off_on"][1]], [off[1], on[1]], rtol=1e-6)
    # Step 3 follows one update whose Adam moments hold step 1's gradients, taken with the
    # other setting: the same to the rounding paths' difference.
    np.testing.assert_allclose([losses["on_off"][2], losses["off_on"][2]], [off[2], on[2]], rtol=1e-3)
