"""The trainer's side of the telemetry: every ``logging.quant_stats_every`` steps, before the
step runs, the probe measures the step's own batch (its first micro-batch), weights, recipe
and stochastic-rounding key, and the statistics go to quant_stats.jsonl and TensorBoard.

The train step itself is not changed, so steps without a probe cost what they cost with
the telemetry off; a probe step costs one extra forward and backward with the statistics
(and, the first time and after a precision switch, the probe's compilation).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from lp_jax.telemetry.probe import as_numpy, collect, instrument
from lp_jax.telemetry.writer import QuantStatsWriter
from lp_jax.training.state import split_model

# The forward the train step differentiates (same mesh rules, same rng_scope), reused so
# the probe's GEMMs see what the step's see.
from lp_jax.training.step import forward_nll

_STATS_KEY_TAG = 0x51A75  # folds the probe's own key (stochastically rounded statistics)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def probe_step(graphdef, layout, mesh, params, rest, batch, rng, step):
    micro = jax.tree.map(lambda a: a[0], batch)
    step_key = jax.random.fold_in(jax.random.wrap_key_data(rng), step)  # as the train step

    def loss(params):
        nll, count = forward_nll(graphdef, params, rest, micro, jax.random.fold_in(step_key, 0), mesh)
        return nll, count  # the step differentiates the summed NLL: the same dy

    stats, _ = collect(loss, layout, jax.random.fold_in(step_key, _STATS_KEY_TAG), params)
    return stats


def scan_layers_for_probe(model) -> None:
    """Scans the probe's copy of an lp_jax Llama over runs of identical layers (the layers'
    arithmetic is the same; ``models.llama``): the statistics are traced once per run of
    layers instead of once per layer, which keeps the probe's compile time from growing with
    depth (each layer adds 42 quantizations to measure)."""
    config = getattr(model, "config", None)
    if getattr(config, "scan_layers", None) is False and hasattr(config, "replace"):
        model.config = config.replace(scan_layers=True)


class QuantStatsProbe:
    """Built by the loop when ``logging.quant_stats_every`` > 0 (on every process: the probe
    is a collective program; only ``primary`` writes)."""

    def __init__(self, run_dir, start_step: int, every: int, tensorboard: bool, primary: bool):
        self.every = every
        self.writer = QuantStatsWriter(run_dir, start_step, tensorboard) if primary else None
        self._instrumented = None  # (train graphdef, recipe, probe graphdef, layout)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def _probe_graph(self, graphdef, recipe, state):
        if self._instrumented is None or self._instrumented[:2] != (graphdef, recipe):
            model = nnx.merge(graphdef, state["params"], state["rest"])
            layout = instrument(model, recipe)
            scan_layers_for_probe(model)
            self._instrumented = (graphdef, recipe, split_model(model)[0], layout)
        return self._instrumented[2:]

    def measure(self, step: int, graphdef, recipe, mesh, state, batch) -> None:
        """Measures and writes; blocks until the statistics are on the host, so the step
        that follows may donate the state."""
        if not recipe.quantized:
            return
        probe_graphdef, layout = self._probe_graph(graphdef, recipe, state)
        stats = as_numpy(probe_step(probe_graphdef, layout, mesh, state["params"], state["rest"],
                                batch, state["rng"], jnp.int32(step)))
        if self.writer is not None:
            self.writer.write(step, layout, stats)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
