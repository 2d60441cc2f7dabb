"""What the plan says when XLA cannot compile for the described GPU without a driver."""
import pathlib
import re

import jax
import pytest

from lp_jax.errors import UserError
from lp_jax.plan.compile_step import DEVICELESS_CUDNN_JAX_LIMIT, compile_lowered


class _Lowered:
    def __init__(self, error):
        self.error = error

    def compile(self):
        raise self.error


def test_a_cudnn_graph_that_needs_a_driver_is_one_line_that_names_the_jax_to_install():
    xla = jax.errors.JaxRuntimeError(
        "INVALID_ARGUMENT: StreamExecutor is null and deviceless cuDNN compilation is not enabled; "
        "failed to resolve cuDNN support for custom call: __cudnn$fmhaSoftmax")
    with pytest.raises(UserError) as caught:
        compile_lowered(_Lowered(xla))
    message = str(caught.value)
    assert "CUDA driver" in message and "below 0.12.1" in message and "[gpu]" in message
    assert "\n" not in message


def test_any_other_compile_error_is_xlas_own():
    xla = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory")
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        compile_lowered(_Lowered(xla))


def test_the_gpu_extra_stops_below_the_jax_the_message_names():
    pyproject = (pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text()
    gpu = re.search(r'^gpu = \["jax\[cuda13\]([^"]*)"\]', pyproject, re.MULTILINE)
    assert gpu is not None, "pyproject.toml's gpu extra is not one jax[cuda13] requirement"
    assert f"<{DEVICELESS_CUDNN_JAX_LIMIT}" in gpu.group(1).split(","), gpu.group(1)
