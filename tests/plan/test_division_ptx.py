"""What the quantizers divide with in a program compiled for an H200 (JAX's CUDA plugin, no
GPU): no float32 division instruction at all, in XLA's kernels or in the Pallas (Mosaic GPU)
ones. XLA's own division there is div.full.f32 and rcp.approx.f32, not IEEE; the scales'
quotients are taken on integers instead (lp_jax.numerics.division)."""
import os
import re
import subprocess
import sys

import pytest

from tests.support.plan_targets import ROOT, needs_plugin

pytestmark = pytest.mark.gpu_compile

_PROGRAM = """
import os, sys, jax, jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import lp_jax as lp
from lp_jax.kernels.launch import compiled_kernels
from lp_jax.plan.gpus import GPUS

topology = topologies.get_topology_desc(platform="cuda", target_config=GPUS["h200"].target_config(),
                                        topology="1x1x1")
sharding = NamedSharding(Mesh(list(topology.devices), ("x",)), P())
x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=sharding)
programs = {{
    "plain division": lambda t: (jnp.float32(448) / t.astype(jnp.float32), 1 / t.astype(jnp.float32)),
    "fp8_e4m3": lambda t: lp.quantize(t, "fp8_e4m3"),
    "fp8_e4m3 pallas": lambda t: lp.quantize(t, "fp8_e4m3", impl="pallas"),
    "fp8_block": lambda t: lp.quantize(t, "fp8_block"),
    "nvfp4": lambda t: lp.quantize(t, "nvfp4"),
    "nvfp4 2d": lambda t: lp.quantize(t, "nvfp4", block_2d=True),
    "nvfp4 pallas": lambda t: lp.quantize(t, "nvfp4", impl="pallas"),
    "nvfp4 4over6": lambda t: lp.quantize(t, "nvfp4", block_scale_search="4over6"),
}}
with compiled_kernels():
    jax.jit(programs[{name!r}]).trace(x).lower().compile()
"""


def _divisions(tmp_path, name):
    dump = tmp_path / name.replace(" ", "_")
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_emitter_re=.*", JAX_PLATFORMS="cpu",
               JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1", JAX_ENABLE_COMPILATION_CACHE="false",
               MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_TO=str(dump))
    subprocess.run([sys.executable, "-c", _PROGRAM.format(name=name)], env=env, check=True,
                   capture_output=True, cwd=ROOT)
    ptx = "".join(p.read_text(errors="replace") for p in dump.rglob("*.ptx"))
    assert ptx, "no PTX dumped"
    return set(re.findall(r"\b((?:div|rcp)\.[\w.]*f32)\b", ptx))


@needs_plugin
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e4m3 pallas", "fp8_block", "nvfp4", "nvfp4 2d",
                                  "nvfp4 pallas", "nvfp4 4over6"])
def test_quantizers_compiled_for_an_h200_have_no_float_division(tmp_path, name):
    assert _divisions(tmp_path, name) == set()


@needs_plugin
def test_xla_divides_approximately_on_an_h200(tmp_path):
    """What the quantizers avoid, and proof that the PTX read above holds divisions when there
    are any."""
    assert _divisions(tmp_path, "plain division") == {"div.full.f32", "rcp.approx.f32"}
