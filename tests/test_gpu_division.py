"""lp_jax asks XLA for IEEE float32 division on NVIDIA GPUs through XLA_FLAGS, before JAX
starts (lp_jax.gpu_division); the PTX itself is checked by tests/plan/test_gpu_division_ptx.py."""
import os
import subprocess
import sys

import jax

from lp_jax import gpu_division
from lp_jax.gpu_division import IEEE, with_ieee_division


def test_the_option_joins_the_flags_and_keeps_the_rest_as_it_is():
    assert with_ieee_division("") == f"--xla_backend_extra_options={IEEE}"
    assert with_ieee_division("--xla_dump_to=dumps --xla_dump_emitter_re=.*") == (
        f"--xla_dump_to=dumps --xla_dump_emitter_re=.* --xla_backend_extra_options={IEEE}")
    assert with_ieee_division("--a=1 --xla_backend_extra_options=-foo=1 --b") == (
        f"--a=1 --xla_backend_extra_options={IEEE},-foo=1 --b")
    assert with_ieee_division("--xla_backend_extra_options= --b") == f"--xla_backend_extra_options={IEEE} --b"


def test_a_division_precision_the_user_chose_is_kept():
    flags = "--xla_backend_extra_options=-nvptx-prec-divf32=1"
    assert with_ieee_division(flags) == flags


def test_importing_lp_jax_sets_the_flag_before_jax_starts():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    code = "import os, lp_jax; print(os.environ['XLA_FLAGS'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"--xla_backend_extra_options={IEEE}"


def test_after_jax_started_the_flags_are_left_alone():
    jax.devices()  # starts the backend, which has read XLA_FLAGS already
    environ = {"XLA_FLAGS": "--xla_dump_to=dumps"}
    assert gpu_division.request(environ) is False
    assert environ == {"XLA_FLAGS": "--xla_dump_to=dumps"}
    assert gpu_division.request({"XLA_FLAGS": f"--xla_backend_extra_options={IEEE}"}) is True
