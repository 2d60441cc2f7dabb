"""The mesh config, the partitioning rules, the block-straddle checks, multi-process settings
and per-process data rows: the parts that need no devices (plus two short subprocesses)."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import lp_jax
from lp_jax.config.schema import DistributedConfig
from lp_jax.data import pipeline as data_lib
from lp_jax.errors import UserError
from lp_jax.parallel.distributed import resolve_arguments
from lp_jax.parallel.mesh import mesh_shape
from lp_jax.parallel.mesh_checks import check_blocks, check_heads
from lp_jax.parallel.partitioning import param_spec, sharding_report, state_shardings
from models import llama

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("sizes, n, want", [
    ((-1, 1, 1), 8, (8, 1, 1, 1)), ((2, -1, 1), 8, (2, 4, 1, 1)), ((2, 2, -1), 8, (2, 2, 2, 1)),
    ((1, 8, 1), 8, (1, 8, 1, 1)), ((-1, 1, 1), 1, (1, 1, 1, 1)), ((1, -1, 8), 64, (1, 8, 8, 1)),
    ((-1, 1, 1, 4), 8, (2, 1, 1, 4)), ((2, 1, 1, -1), 8, (2, 1, 1, 4))])
def test_mesh_sizes_fill_the_devices(sizes, n, want):
    """(data, fsdp, tensor[, expert]) -> (data, fsdp, tensor, expert)."""
    assert mesh_shape(*sizes[:3], n, *sizes[3:]) == want


@pytest.mark.parametrize("sizes, n, message", [
    ((2, 2, 1), 8, r"mesh.data x mesh.fsdp x mesh.tensor = data=2 x fsdp=2 x tensor=1 = 4 devices, but there are 8"),
    ((-1, 3, 1), 8, r"cannot tile the 8 devices: 3 does not divide 8"),
    ((-1, -1, 1), 8, r"mesh.data and mesh.fsdp are both -1"),
    ((0, 1, 1), 8, r"mesh.data=0 is invalid"),
    ((1, 1, -2), 8, r"mesh.tensor=-2 is invalid")])
def test_bad_mesh_sizes_are_one_clear_line(sizes, n, message):
    with pytest.raises(UserError, match=message) as e:
        mesh_shape(*sizes, n)
    assert "\n" not in str(e.value)


def test_cli_rejects_a_mesh_that_does_not_match_the_devices_with_exit_2():
    proc = subprocess.run([sys.executable, "train.py", "--check", "mesh.data=2", "mesh.tensor=2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "mesh.data x mesh.fsdp x mesh.tensor" in lines[0], proc.stderr


def test_cli_rejects_a_mesh_that_splits_mxfp8_blocks_before_compiling():
    # fsdp=8 over the tiny model's 128 hidden features: 16 per shard, half an MXFP8 block.
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "train.py", "--check", "precision=mxfp8",
                           "precision.first_bf16_layers=0", "precision.last_bf16_layers=0",
                           "mesh.data=1", "mesh.fsdp=8", "data.source=mock", "data.global_batch_size=8",
                           "data.micro_batch_size=1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert "\n" not in line
    assert "blocks of layers/0/attn/" in line and "K (in features)=128" in line
    assert "mesh axis fsdp makes 8 shards of 16" in line and "MXFP8 32-element blocks" in line


def _tiny(**kw):
    return llama.preset("tiny", num_layers=2, **kw)


def test_blocks_split_along_tokens_name_the_batch_axes():
    recipe = lp_jax.get_recipe("mxfp8", first_bf16_layers=0, last_bf16_layers=0)
    # 8 data-parallel ranks x 1 sequence of 16 tokens: M shards of 16 split 32-blocks.
    with pytest.raises(UserError, match=r"wgrad_x x along M \(tokens\)=128: mesh axis data x fsdp "
                                          r"makes 8 shards of 16"):
        check_blocks(_tiny(), [recipe], {"data": 8, "fsdp": 1, "tensor": 1}, 1, 16)
    # NVFP4's 16-blocks (and 16-point RHT) fit 16 tokens per shard; 2 sequences fit MXFP8.
    nvfp4 = lp_jax.get_recipe("nvfp4", first_bf16_layers=0, last_bf16_layers=0)
    check_blocks(_tiny(), [nvfp4], {"data": 8, "fsdp": 1, "tensor": 1}, 1, 16)
    check_blocks(_tiny(), [recipe], {"data": 8, "fsdp": 1, "tensor": 1}, 2, 16)


def test_nvfp4_tiles_and_tensor_parallel_activations_are_checked():
    nvfp4 = lp_jax.get_recipe("nvfp4", first_bf16_layers=0, last_bf16_layers=0)
    # tensor=2 over 64 KV features... fine; 16x16 weight tiles need 16 | shard on both axes.
    check_blocks(_tiny(), [nvfp4], {"data": 1, "fsdp": 2, "tensor": 2}, 8, 32)
    narrow = _tiny(hidden_size=96, intermediate_size=96 * 3, num_heads=2, num_kv_heads=1, head_dim=48)
    with pytest.raises(UserError, match=r"the mesh splits quantization blocks of layers/0/attn/\w+_proj "
                                             r"\(NVFP4BlockScaling\): fprop_w w along K \(in features\)=96: "
                                             r"mesh axis fsdp makes 4 shards of 24, not a multiple of its "
                                             r"NVFP4 16x16 tiles"):
        check_blocks(narrow, [nvfp4], {"data": 1, "fsdp": 4, "tensor": 1}, 8, 32)  # 96/4 = 24
    bf16 = lp_jax.get_recipe("bf16")
    check_blocks(narrow, [bf16], {"data": 1, "fsdp": 4, "tensor": 1}, 8, 32)  # nothing to split


def test_tensor_parallelism_keeps_whole_heads():
    check_heads(_tiny(), 2)
    with pytest.raises(UserError, match=r"mesh.tensor=4 does not divide model.num_kv_heads=2"):
        check_heads(_tiny(), 4)


def _abstract_params(cfg):
    model = nnx.eval_shape(lambda: llama.Llama(cfg, rngs=nnx.Rngs(0)))
    return nnx.split(model, nnx.Param, ...)[1]


def test_llama_parameters_follow_the_megatron_and_fsdp_rules():
    mesh = {"data": 1, "fsdp": 4, "tensor": 2}
    want = {"embed/embedding": P("tensor", "fsdp"), "layers/0/attn/q_proj/kernel": P("fsdp", "tensor"),
            "layers/0/attn/k_proj/kernel": P("fsdp", "tensor"),
            "layers/0/attn/o_proj/kernel": P("tensor", "fsdp"),
            "layers/1/mlp/gate_proj/kernel": P("fsdp", "tensor"),
            "layers/1/mlp/down_proj/kernel": P("tensor", "fsdp"), "lm_head/kernel": P("fsdp", "tensor"),
            "final_norm/scale": P(None), "layers/1/attn_norm/scale": P(None)}
    params = _abstract_params(_tiny())
    rows = {path: (spec, fell_back) for path, _, spec, fell_back in sharding_report(params, mesh)}
    for path, spec in want.items():
        assert rows[path] == (spec, False), path
    assert not any(fell_back for _, fell_back in rows.values())


def test_moments_are_sharded_like_their_parameters_and_counters_replicated():
    import jax
    import optax

    from lp_jax.parallel.mesh import make_mesh
    from lp_jax.training.state import abstract_state

    cfg = _tiny()
    model = nnx.eval_shape(lambda: llama.Llama(cfg, rngs=nnx.Rngs(0)))
    state = abstract_state(nnx.split(model, nnx.Param, ...), optax.adamw(1e-3), 0)
    sh = state_shardings(state, make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    q = sh["params"]["layers"][0]["attn"]["q_proj"]["kernel"].spec
    mu = sh["opt_state"][0].mu["layers"][0]["attn"]["q_proj"]["kernel"].spec
    assert q == mu == P("fsdp", "tensor")
    assert sh["step"].spec == P() and sh["opt_state"][0].count.spec == P()


def test_undivisible_dimensions_stay_whole_and_unknown_matrices_get_fsdp():
    assert param_spec("layers/0/attn/k_proj/kernel", (128, 64), {"fsdp": 3, "tensor": 2}) == P(None, "tensor")
    assert param_spec("encoder/dense/kernel", (64, 256), {"fsdp": 4, "tensor": 2}) == P(None, "fsdp")
    assert param_spec("encoder/dense/bias", (256,), {"fsdp": 4, "tensor": 2}) == P(None)
    report = sharding_report({"layers": {"0": {"attn": {"k_proj": {"kernel": np.zeros((128, 64))}}}}},
                             {"fsdp": 3, "tensor": 2})
    assert report[0][3] is True  # reported as a fallback


def test_distributed_settings_from_config_and_environment(monkeypatch):
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_NTASKS",
                "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert resolve_arguments(DistributedConfig()) is None  # one process
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    assert resolve_arguments(DistributedConfig()) == {
        "coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3}
    config = DistributedConfig(coordinator_address="h:1", num_processes=2, process_id=1,
                               local_device_ids=(0, 1))
    assert resolve_arguments(config) == {"coordinator_address": "h:1", "num_processes": 2,
                                         "process_id": 1, "local_device_ids": [0, 1]}
    assert resolve_arguments(DistributedConfig(initialize=False)) is None
    with pytest.raises(UserError, match=r"distributed.process_id=5 is invalid: must be in 0..3"):
        resolve_arguments(DistributedConfig(process_id=5))
    monkeypatch.delenv("JAX_PROCESS_ID")
    with pytest.raises(UserError, match="set distributed.num_processes and distributed.process_id"):
        resolve_arguments(DistributedConfig())
    monkeypatch.setenv("JAX_PROCESS_ID", "x")
    with pytest.raises(UserError, match=r"JAX_PROCESS_ID='x' must be an integer"):
        resolve_arguments(DistributedConfig())


def test_each_process_reads_only_its_rows_and_together_they_read_the_global_batch():
    source = data_lib.MockSequences(384, 8, seed=0)
    global_batch, accum = 8, 2
    whole = data_lib.train_iterator(source, 0, global_batch, read_threads=0)
    # Two processes, two micro-batches of 4 rows: process p holds rows 2p, 2p+1 of each.
    parts = [data_lib.train_iterator(source, 0, global_batch, read_threads=0,
                                     rows=np.array([2 * p, 2 * p + 1, 4 + 2 * p, 5 + 2 * p]))
             for p in range(2)]
    for _ in range(3):
        batch, got = next(whole)["tokens"], [next(it)["tokens"] for it in parts]
        micro = batch.reshape(accum, 4, -1)
        for p in range(2):
            np.testing.assert_array_equal(got[p].reshape(accum, 2, -1), micro[:, 2 * p:2 * p + 2])
    assert parts[0].get_state() == whole.get_state()  # the same position: one batch per step


def test_importing_the_trainer_leaves_jax_distributed_initializable():
    # jax.distributed.initialize must run before the XLA backend starts; importing lp_jax,
    # the model and the trainer must not start it.
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    code = ("import lp_jax.training.cli, lp_jax.training.loop, models.llama, jax; "
            f"jax.distributed.initialize('localhost:{port}', num_processes=1, process_id=0); "
            "print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu",
                                                PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


def test_moe_experts_split_by_expert_and_the_router_stays_whole():
    from lp_jax import model_registry

    cfg = model_registry.preset("moe", "tiny", num_layers=1)
    model = nnx.eval_shape(lambda: model_registry.build_model("moe", cfg, nnx.Rngs(0)))
    params = nnx.split(model, nnx.Param, ...)[1]
    mesh = {"data": 1, "fsdp": 2, "expert": 4, "tensor": 1}
    rows = {path: (spec, fell_back) for path, _, spec, fell_back in sharding_report(params, mesh)}
    assert rows["layers/0/mlp/gate_up/kernel"] == (P("expert", "fsdp", None), False)
    assert rows["layers/0/mlp/down/kernel"] == (P("expert", None, "fsdp"), False)
    assert rows["layers/0/mlp/router/kernel"] == (P("fsdp", None), False)
    # 8 experts over 3 expert ranks cannot split: left whole, and reported.
    odd = {path: (spec, fell) for path, _, spec, fell in sharding_report(params, {**mesh, "expert": 3})}
    assert odd["layers/0/mlp/gate_up/kernel"] == (P(None, "fsdp", None), True)
