"""What XLA divides with in a program compiled for an H200 (JAX's CUDA plugin, no GPU): its
default is div.full.f32 and rcp.approx.f32 (not IEEE); with lp_jax imported first, the
IEEE div.rn.f32 and rcp.rn.f32 (lp_jax.gpu_division)."""
import os
import re
import subprocess
import sys

import pytest

from tests.support.plan_targets import needs_plugin

pytestmark = pytest.mark.gpu_compile

# The H200 is described by the target config the plan uses (read in this process), so that
# the control program imports nothing of lp_jax.
_PROGRAM = """
{imports}
import os, jax, jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
topology = topologies.get_topology_desc(platform="cuda", target_config=os.environ["H200_TARGET"],
                                        topology="1x1x1")
sharding = NamedSharding(Mesh(list(topology.devices), ("x",)), P())
amax = jax.ShapeDtypeStruct((1024,), jnp.float32, sharding=sharding)
jax.jit(lambda a: (jnp.float32(448) / a, jnp.float32(1) / (a * 3))).trace(amax).lower().compile()
"""


def _divisions(tmp_path, imports):
    from lp_jax.plan.gpus import GPUS

    dump = tmp_path / imports.replace(" ", "_")
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_emitter_re=.*", JAX_PLATFORMS="cpu",
               JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1", JAX_ENABLE_COMPILATION_CACHE="false",
               H200_TARGET=GPUS["h200"].target_config())
    subprocess.run([sys.executable, "-c", _PROGRAM.format(imports=imports)], env=env, check=True,
                   capture_output=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    ptx = "".join(p.read_text() for p in dump.glob("*.ptx"))
    assert ptx, "no PTX dumped"
    return set(re.findall(r"\b(div\.\w+\.f32|rcp\.\w+\.f32)", ptx))


@needs_plugin
def test_xla_divides_as_ieee_does_once_lp_jax_is_imported(tmp_path):
    assert _divisions(tmp_path, "import lp_jax") == {"div.rn.f32", "rcp.rn.f32"}
    # without it, XLA's own lowering: what lp_jax.gpu_division is for
    assert _divisions(tmp_path, "import os") == {"div.full.f32", "rcp.approx.f32"}
