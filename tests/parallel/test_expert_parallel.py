"""Expert parallelism (mesh.expert, models/moe_dispatch.py) on 8 forced CPU devices: the routed
output, the gradients and a training step equal one device's; bad meshes are one line.

The training comparison uses the dense sharding tests' bar (tests/parallel/test_sharded_training.py):
steps 1 and 2 see the initial weights (step 1 runs at learning rate 0), and there a sharded
run matches one device to 1e-5, since only FP32 summation order may differ. With expert
parallelism alone the grouped GEMMs see exactly one device's groups, so the expert
gradients are the same bits (test_routed_output_and_expert_gradients_are_one_devices).
"""
import json

import numpy as np
import pytest

from lp_jax.errors import UserError
from lp_jax.training.validate import resolve
from tests.models.test_model_registry import tiny
from tests.support.expert_parallel_runs import meshes
from tests.support.forced_devices import run_python

ONE = (1, 1, 1, 1)


def _runs(recipe: str) -> dict:
    proc = run_python(["tests/support/expert_parallel_runs.py", recipe],
                      xla_flags="--xla_allow_excess_precision=false", timeout=1800)
    return {tuple(r["mesh"]): r for r in (json.loads(line) for line in proc.stdout.splitlines()
                                          if line.startswith("{"))}


def _rel(run, ref, key):
    got = np.array([s[key] for s in run["steps"]])
    want = np.array([s[key] for s in ref["steps"]])
    return np.abs(got - want) / np.abs(want)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["bf16", "mxfp8"])
def test_training_steps_on_expert_meshes_match_one_device(recipe):
    runs = _runs(recipe)
    ref = runs[ONE]
    for mesh in meshes(recipe):
        run = runs[mesh]
        data, fsdp, tensor, expert = mesh
        # The experts really are split: 8 / expert of them on each device (embed over fsdp).
        assert run["gate_up_shard"] == [8 // expert, 128 // fsdp, 192], mesh
        assert _rel(run, ref, "loss").max() <= 1e-5, (mesh, run, ref)
        # The routing losses and loads are the whole batch's, as on one device.
        for key in ("moe_aux_loss", "moe_load_max", "moe_load_min"):
            assert _rel(run, ref, key).max() <= 1e-5, (mesh, key, run, ref)
        if (data, fsdp, tensor) == (1, 1, 1):
            # Every expert's rows, quantized as one device quantizes them: the gradient
            # differs in FP32 summation order only (the router's, over the split batch).
            assert _rel(run, ref, "grad_norm").max() <= 1e-5, (mesh, run, ref)


@pytest.mark.slow
def test_routed_output_and_expert_gradients_are_one_devices():
    """Forward bit for bit in every recipe with expert=4; the experts' gradients too (NVFP4
    with stochastic rounding: each expert draws its one-device bits)."""
    proc = run_python(["tests/support/expert_parallel_layer.py"], timeout=1200)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert {r["recipe"] for r in rows} == {"none", "bf16", "fp8_cs", "mxfp8", "nvfp4"}
    for r in rows:
        # jax.lax.ragged_dot (no recipe) runs each expert's rows in another GEMM shape, whose
        # FP32 sums XLA:CPU blocks differently; lp.ragged_dot's windows are the same on both.
        assert r["output_max_rel"] <= (1e-6 if r["recipe"] == "none" else 0), r
        assert r["stats_max_rel"] <= 1e-6 and r["all_to_alls"] == 3 and r["gate_up_shard"] == [2, 128, 192], r
        if r["recipe"] != "none":
            assert r["expert_grads_equal"], r
            assert r["router_grad_max_rel"] <= 1e-5, r


@pytest.mark.parametrize("overrides, message", [
    (["model.type=moe", "mesh.data=1", "mesh.expert=3"],
     "mesh.data x mesh.fsdp x mesh.tensor x mesh.expert = data=1 x fsdp=1 x tensor=1 x expert=3 = 3 "
     "devices, but there are 6"),
    (["model.type=moe", "mesh.data=2", "mesh.expert=3"],
     "mesh.expert=3 does not divide model.num_experts=8: each expert-parallel rank must hold whole experts"),
    (["mesh.data=3", "mesh.expert=2"],
     "mesh.expert=2 splits a mixture of experts, but model.type=llama has no experts"),
    (["model.type=moe", "mesh.data=-1", "mesh.expert=4"],
     "mesh sizes data=-1 x fsdp=1 x tensor=1 x expert=4 cannot tile the 6 devices: 4 does not divide 6"),
    (["model.type=moe", "mesh.data=2", "mesh.expert=0"], "mesh.expert=0 is invalid"),
])
def test_bad_expert_meshes_are_one_line(overrides, message, tmp_path, token_cache):
    with pytest.raises(UserError) as e:
        resolve(tiny(tmp_path, token_cache, "data.micro_batch_size=1", "data.global_batch_size=24", *overrides),
                device_count=6, check_files=False)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_expert_ranks_split_the_batch(tmp_path, token_cache):
    plan = resolve(tiny(tmp_path, token_cache, "model.type=moe", "mesh.data=2", "mesh.expert=4",
                        "data.micro_batch_size=1", "data.global_batch_size=16"), device_count=8,
                   check_files=False)
    assert (plan.data_parallel, plan.fsdp, plan.tensor, plan.expert) == (2, 1, 1, 4)
    assert plan.accum_steps == 2  # 16 sequences, 1 per micro-batch on each of 2 x 4 ranks


@pytest.mark.parametrize("overrides, message", [
    (["model.type=moe", "mesh.data=2", "mesh.expert=4", "mesh.ep_dispatch_dtype=e4m3"],
     "mesh.ep_dispatch_dtype='e4m3' is invalid: choose one of bf16, fp8"),
    (["model.type=moe", "mesh.data=8", "mesh.ep_dispatch_dtype=fp8"],
     "mesh.ep_dispatch_dtype=fp8 sends the expert-parallel dispatch in FP8, but mesh.expert=1 dispatches "
     "nothing; set mesh.expert above 1 or mesh.ep_dispatch_dtype=bf16"),
])
def test_a_bad_or_idle_fp8_dispatch_is_one_line(overrides, message, tmp_path, token_cache):
    with pytest.raises(UserError) as e:
        resolve(tiny(tmp_path, token_cache, "data.micro_batch_size=1", "data.global_batch_size=16",
                     *overrides), device_count=8, check_files=False)
    assert str(e.value) == message


def test_an_fp8_dispatch_resolves_on_an_expert_mesh(tmp_path, token_cache):
    plan = resolve(tiny(tmp_path, token_cache, "model.type=moe", "mesh.data=2", "mesh.expert=4",
                        "mesh.ep_dispatch_dtype=fp8", "data.micro_batch_size=1", "data.global_batch_size=16"),
                   device_count=8, check_files=False)
    assert plan.config.mesh.ep_dispatch_dtype == "fp8" and plan.expert == 4
