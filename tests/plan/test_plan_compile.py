"""``python -m lp_jax.plan`` for real: the tiny config compiled for H200 and B200 targets per
recipe, the Pallas kernels and the GEMM backends compiled for sm_90a and sm_100a, and bad
input. The compiles need JAX's CUDA plugin (``pip install -e '.[gpu]'``, no GPU): without it
they skip, saying so."""
import json

import pytest

from lp_jax.plan import cli, environment
from tests.support.plan_targets import TINY, needs_plugin

pytestmark = pytest.mark.gpu_compile
# Two layers, every Linear quantized, short sequences, one micro-batch per step: small compiles.
SMALL = ["model.num_layers=2", "data.seq_len=64", "data.global_batch_size=2", "data.micro_batch_size=2",
         "data.source=mock", "precision.first_bf16_layers=0", "precision.last_bf16_layers=0"]
LINEARS_PER_LAYER = 7


def _only_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m lp_jax.plan: error: "), err
    return err[0]


def test_an_unknown_gpu_is_one_line(capsys):
    assert cli.main(["--config", TINY, "--gpu", "a100"]) == 2
    assert "unknown GPU 'a100': choose one of h100, h200, b200, gb200" in _only_error_line(capsys)


def test_a_missing_plugin_is_one_line_that_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setattr(environment, "PLUGINS", ("jax_plugins.no_such_plugin",))
    assert cli.main(["--config", TINY, "--gpu", "h200"]) == 2
    assert "pip install -e '.[gpu]'" in _only_error_line(capsys)


@needs_plugin
def test_a_config_that_cannot_be_placed_is_one_line(capsys):
    assert cli.main(["--config", TINY, "--gpu", "h200", "--gpus", "3", "mesh.data=2"]) == 2
    assert "mesh" in _only_error_line(capsys)


@needs_plugin
@pytest.mark.parametrize("gpu", ["h200", "b200"])
def test_the_tiny_step_compiles_per_recipe_with_the_gemms_each_gpu_has(gpu, tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = cli.main(["--config", TINY, "--gpu", gpu, "--gpus", "1", "--json", str(out), *SMALL])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads(out.read_text())
    assert report["gpu"] == gpu and report["gpus"] == 1
    rows = {r["recipe"]: r for r in report["rows"]}
    assert set(rows) == {"bf16", "fp8_cs", "mxfp8", "nvfp4"}
    quantized = 2 * LINEARS_PER_LAYER
    assert rows["fp8_cs"]["gemm_operand_types"].get("fp8", 0) >= 2 * quantized  # FP8 operands
    for name in ("mxfp8", "nvfp4"):
        block_scaled = rows[name]["gemms"].get("cudnn_block_scaled", 0)
        assert block_scaled == (3 * quantized if gpu == "b200" else 0), rows[name]["gemms"]
    for r in rows.values():
        assert r["memory"]["fits"] and r["kernels"] > 0 and r["estimate"]["step_s"] > 0
        assert f"| {r['recipe']} | {r['policy']} |" in printed
    assert rows["bf16"]["estimate"]["x_bf16"] == pytest.approx(1.0)


@needs_plugin
def test_xla_scaled_dot_is_one_triton_gemm_per_gemm_on_b200(tmp_path, capsys):
    """Forced onto XLA's scaled dot, MXFP8's and NVFP4's GEMMs compile for B200 into Triton
    fusions of FP8 / FP4 operands, no cuDNN call, and the step has fewer kernels than on
    cuDNN (no scale swizzles, no separate scaling of an FP32 result)."""
    rows = {}
    for backend in ("cudnn", "xla_scaled_dot"):
        out = tmp_path / f"{backend}.json"
        code = cli.main(["--config", TINY, "--gpu", "b200", "--gpus", "1", "--recipes", "mxfp8,nvfp4",
                         "--json", str(out), *SMALL, f"precision.backend={backend}"])
        assert code == 0, capsys.readouterr().out
        rows[backend] = {r["recipe"]: r for r in json.loads(out.read_text())["rows"]}
    quantized = 3 * 2 * LINEARS_PER_LAYER
    for name, operand in (("mxfp8", "fp8"), ("nvfp4", "fp4")):
        row = rows["xla_scaled_dot"][name]
        assert "cudnn_block_scaled" not in row["gemms"], row["gemms"]
        assert row["gemm_operand_types"].get(operand, 0) == quantized, row["gemm_operand_types"]
        assert row["kernels"] < rows["cudnn"][name]["kernels"], (row["kernels"], rows["cudnn"][name]["kernels"])


@needs_plugin
def test_nvfp4_with_the_pallas_quantizers_compiles_inside_the_data_shard_map(tmp_path, capsys):
    """"auto" runs the Pallas kernels for NVFP4 on a data-parallel mesh; their tensor amax
    reduces over the data axis outside the kernel (Mosaic GPU lowers no collective in it)."""
    out = tmp_path / "plan.json"
    code = cli.main(["--config", TINY, "--gpu", "b200", "--gpus", "2", "--recipes", "nvfp4", "--json", str(out),
                     "--hlo-dir", str(tmp_path), *SMALL, "mesh.data=2", "data.global_batch_size=4"])
    assert code == 0, capsys.readouterr().out
    (row,) = json.loads(out.read_text())["rows"]
    assert row["gemms"].get("cudnn_block_scaled") == 3 * 2 * LINEARS_PER_LAYER, row["gemms"]
    assert 'custom_call_target="mosaic_gpu' in (tmp_path / "nvfp4.hlo.txt").read_text()


@needs_plugin
def test_memory_figures_are_xlas_buffer_assignment():
    from lp_jax.config.yaml_io import load_config
    from lp_jax.plan.compile_step import compile_step
    from lp_jax.plan.gpus import GPUS
    from lp_jax.plan.rows import row
    from lp_jax.training.validate import resolve

    plan = resolve(load_config(TINY, [*SMALL, "precision.recipe=mxfp8", "precision.quantize_impl=xla"]),
                   device_count=1, check_files=False)
    step = compile_step(plan, GPUS["h200"], 1)
    m = step.compiled.memory_analysis()
    got = row(plan, GPUS["h200"], 1, step)["memory"]
    assert got["per_gpu_bytes"] == (m.argument_size_in_bytes + m.output_size_in_bytes
                                    - m.alias_size_in_bytes + m.temp_size_in_bytes)
    assert got["temp_bytes"] == m.temp_size_in_bytes and got["arguments_bytes"] == m.argument_size_in_bytes


def _compiled_text(fn, gpu, *shapes):
    import jax

    from lp_jax.kernels.launch import compiled_kernels
    from lp_jax.plan.compile_step import topology_devices
    from lp_jax.plan.gpus import GPUS

    mesh = jax.sharding.Mesh(topology_devices(GPUS[gpu], 1), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in shapes]
    with compiled_kernels():
        lowered = jax.jit(fn).trace(*args).lower()
    return lowered.compile().as_text()


PALLAS_COMPILES = r"""
import sys
from tests.plan.test_plan_compile import _compiled_text
import jax.numpy as jnp
import lp_jax as lp
for fmt in ("fp8_e4m3", "mxfp8", "nvfp4"):
    text = _compiled_text(lambda x: lp.quantize(x, fmt, impl="pallas").data, sys.argv[1], ((256, 256), jnp.bfloat16))
    print(fmt, "mosaic_gpu" in text)
"""


@needs_plugin
@pytest.mark.parametrize("gpu", ["h200", "b200"])
def test_the_pallas_quantizers_compile_for_the_gpu(gpu):
    """In a process of its own: Mosaic GPU links its kernels for the first SM version a
    process compiles for (another target in the same process fails in ptxas), as the plan
    compiles each recipe in a process of its own."""
    from tests.support.forced_devices import run_python

    proc = run_python(["-c", PALLAS_COMPILES, gpu], devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["fp8_e4m3", "True", "mxfp8", "True", "nvfp4", "True"], proc.stdout


@needs_plugin
@pytest.mark.parametrize("scan", ["false", "true"])
def test_fp8_block_on_one_h200_runs_the_wgmma_kernel(scan, tmp_path, capsys):
    """Hopper's FP8 block GEMM compiled into the train step for sm_90a: three Mosaic GPU
    kernels per quantized Linear, counted as FP8 GEMMs (scanned layers: some inside the
    dynamic-slice fusions XLA wraps around them)."""
    out = tmp_path / "plan.json"
    code = cli.main(["--config", TINY, "--gpu", "h200", "--gpus", "1", "--recipes", "fp8_block",
                     "--json", str(out), *SMALL, f"model.scan_layers={scan}"])
    assert code == 0, capsys.readouterr().out
    (row,) = json.loads(out.read_text())["rows"]
    assert row["gemms"].get("pallas_wgmma") == 3 * 2 * LINEARS_PER_LAYER, row["gemms"]
    assert row["gemm_operand_types"].get("fp8", 0) >= 3 * 2 * LINEARS_PER_LAYER


@needs_plugin
def test_fp8_block_on_eight_h200s_with_zero3_splits_the_wgmma_kernel(tmp_path, capsys):
    """ZeRO-3 (fsdp = 8): the kernel's partitioning rule runs it on each GPU's tokens."""
    out = tmp_path / "plan.json"
    code = cli.main(["--config", TINY, "--gpu", "h200", "--gpus", "8", "--recipes", "fp8_block",
                     "--json", str(out), *SMALL, "model.hidden_size=1024", "model.intermediate_size=2048",
                     "model.num_heads=8", "model.num_kv_heads=8", "model.head_dim=128", "data.seq_len=128",
                     "data.global_batch_size=8", "data.micro_batch_size=1", "mesh.data=1", "mesh.fsdp=8"])
    assert code == 0, capsys.readouterr().out
    (row,) = json.loads(out.read_text())["rows"]
    assert row["gemms"].get("pallas_wgmma") == 3 * 2 * LINEARS_PER_LAYER, row


@needs_plugin
@pytest.mark.parametrize("gpu", ["h200", "b200"])
@pytest.mark.parametrize("recipe,backend", [("fp8_cs", "reference"), ("fp8_cs", "xla_fp8"),
                                            ("fp8_block", "cudnn"), ("fp8_block", "auto"),
                                            ("mxfp8", "cudnn"), ("nvfp4", "cudnn"), ("nvfp4", "auto")])
def test_every_gemm_backend_compiles_for_the_gpu(gpu, recipe, backend):
    import jax.numpy as jnp

    import lp_jax as lp

    # XLA's quantizers: the Pallas ones are Mosaic GPU kernels, and a process links those for
    # the first SM version it compiles for (test_the_pallas_quantizers_compile_for_the_gpu).
    dg = lp.dot_general(lp.get_recipe(recipe, backend=backend, first_bf16_layers=0, last_bf16_layers=0,
                                      quantize_impl="xla"))
    text = _compiled_text(lambda x, w: dg(x, w, (((1,), (0,)), ((), ()))), gpu,
                          ((128, 256), jnp.bfloat16), ((256, 128), jnp.float32))
    if backend in ("cudnn", "auto") and recipe != "fp8_cs" and gpu == "b200":
        assert "__cudnn$blockScaledDot" in text
