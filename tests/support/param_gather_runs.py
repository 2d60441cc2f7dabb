"""precision.param_gather's FSDP gathers of quantized bytes against the partitioner's gathers
of the FP32 masters: the first train step and its compiled collectives (8 forced CPU
devices), for tests/gemm/test_param_gather.py.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/support/param_gather_runs.py nvfp4 2,2,2

The tiny 2-layer model of tests/support/sharded_runs.py, every Linear in the recipe with
param_gather (weights quantized from the FP32 masters), one step of the trainer's jitted
train step with the weights gathered by the partitioner ("off") and as quantized bytes ("on"). Step 1 runs at learning
rate 0, so the state after it holds the first gradients in Adam's first moment
(mu = (1 - b1) x the clipped gradient). Prints one JSON line: both losses and gradient
norms, per parameter the largest |mu_on - mu_off| over the largest |mu_off|, and for each
program its collectives: the compiled program's all-gathers by element type, the lowered
module's all_gathers by operand type, its scalar f32 all_reduce(max)es (tensor amaxes),
and which low-precision types are bitcast to bytes (for a gather).
"""
from __future__ import annotations

import collections
import json
import re
import sys

import jax
import numpy as np

from lp_jax.parallel.partitioning import path_string
from lp_jax.training import state as state_lib
from lp_jax.training.step import jitted_train_step
from tests.support.sharded_runs import batches, build


def _first_step(recipe: str, mesh_sizes, byte_gathers: bool):
    """(loss, grad norm, first moments by path, lowered module text, compiled HLO text)."""
    cfg, graphdef, spec, state, mesh = build(recipe, "bfloat16", mesh_sizes, True, byte_gathers=byte_gathers)
    batch = state_lib.place_batch(batches(cfg.vocab_size)[0], 1, mesh)
    lowered = jitted_train_step(spec, state).lower(graphdef, spec, state, batch)
    compiled = lowered.compile()
    state, metrics = compiled(state, batch)
    # Adam's first moments, wherever the optimizer chain keeps them.
    mu = {path_string(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(state["opt_state"])
          if ".mu" in jax.tree_util.keystr(p) or "'mu'" in jax.tree_util.keystr(p)}
    return float(metrics["loss"]), float(metrics["grad_norm"]), mu, lowered.as_text(), compiled.as_text()


_COMPILED_GATHER = re.compile(r"=\s*(\w+)\[[\d,]*\]\S*\s+all-gather(?:-start)?\(")
_LOWERED_GATHER = re.compile(r'"stablehlo\.all_gather".* : \(tensor<(?:\d+x)*([a-zA-Z]\w*)>\)')
# An all_reduce whose body is a maximum, on one f32 scalar: a tensor amax reduced over shards.
_SCALAR_MAX = re.compile(r'"stablehlo\.all_reduce"\((?:(?!"stablehlo\.all_reduce").)*?stablehlo\.maximum'
                         r'(?:(?!"stablehlo\.all_reduce").)*?\}\) : \(tensor<f32>\) -> ', re.S)
_TO_BYTES = re.compile(r"stablehlo\.bitcast_convert \S+ : \(tensor<(?:\d+x)*(\w+)>\) -> tensor<(?:\d+x)*(ui[48])>")


def _collectives(module: str, compiled: str) -> dict:
    return {"compiled_gathers": dict(collections.Counter(_COMPILED_GATHER.findall(compiled))),
            "lowered_gathers": dict(collections.Counter(_LOWERED_GATHER.findall(module))),
            "lowered_scalar_max_all_reduces": len(_SCALAR_MAX.findall(module)),
            "bitcast_to_bytes": dict(collections.Counter(f"{a}->{b}" for a, b in _TO_BYTES.findall(module)))}


def compare(recipe: str, mesh_sizes) -> dict:
    off_loss, off_norm, off_mu, off_module, off_hlo = _first_step(recipe, mesh_sizes, False)
    on_loss, on_norm, on_mu, on_module, on_hlo = _first_step(recipe, mesh_sizes, True)
    rel = {k: float(np.abs(on_mu[k] - off_mu[k]).max() / max(np.abs(off_mu[k]).max(), 1e-30))
           for k in off_mu}
    return {"recipe": recipe, "mesh": list(mesh_sizes), "loss": [off_loss, on_loss],
            "grad_norm": [off_norm, on_norm], "mu_rel": rel,
            "mu_equal": int(sum(np.array_equal(on_mu[k], off_mu[k]) for k in off_mu)),
            "off": _collectives(off_module, off_hlo), "on": _collectives(on_module, on_hlo)}


def main(recipe: str, mesh: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    print(json.dumps(compare(recipe, tuple(int(v) for v in mesh.split(",")))), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
