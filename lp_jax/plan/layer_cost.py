"""What one transformer layer costs the step on the GPU: its HBM bytes, kernel launches and
estimated time, GEMMs (and attention) apart from everything else.

Measured as the difference of the step compiled at 3 and 2 layers (both scanned) at the
config's sequence length, every layer quantized (FiLj off), so a recipe's figure is its
quantized layer's. The difference is split by where the kernels run: inside the layer
loops (the scans: the layer's forward and backward) and outside them (the layer's share of
the optimizer update, the stacking of its parameters and the unstacking of its gradient).
Beside it, the floor of the layer's quantization traffic (``quant_minimum``), which the
quantized recipes' extra bytes over BF16 are held against.
"""
from __future__ import annotations

import dataclasses

from lp_jax.plan.gpus import GPU
from lp_jax.plan.hlo_module import Module
from lp_jax.plan.kernels import kernels
from lp_jax.plan.layer_bytes import LAYERS, compile_layers
from lp_jax.plan.quant_minimum import minimum_layer_bytes
from lp_jax.plan.roofline import estimate


@dataclasses.dataclass(frozen=True)
class Part:
    hbm_bytes: float
    kernels: int
    gemm_s: float  # kernels doing GEMM or attention FLOPs
    other_s: float  # every other kernel: bandwidth and launches

    @property
    def time_s(self) -> float:
        return self.gemm_s + self.other_s

    def minus(self, other: "Part") -> "Part":
        return Part(self.hbm_bytes - other.hbm_bytes, self.kernels - other.kernels,
                    self.gemm_s - other.gemm_s, self.other_s - other.other_s)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "time_s": self.time_s}


@dataclasses.dataclass(frozen=True)
class LayerCost:
    loops: Part  # inside the layer loops: the layer's forward and backward
    outside: Part  # outside them: its optimizer update, stacking and gradient unstacking
    quant_minimum_bytes: float  # the floor of its quantization's traffic (0 for BF16)
    seq_len: int

    def as_dict(self) -> dict:
        return {"loops": self.loops.as_dict(), "outside": self.outside.as_dict(),
                "quant_minimum_bytes": self.quant_minimum_bytes, "seq_len": self.seq_len}


def parts(text: str, gpu: GPU, count: int) -> tuple[Part, Part]:
    """(inside loops, outside them) of a compiled module's kernels, collectives left out."""
    found = [k for k in kernels(Module.parse(text), count) if k.collective is None]
    out = []
    for looped in (True, False):
        est = estimate([k for k in found if k.looped == looped], gpu, count)
        out.append(Part(est.hbm_bytes, est.launches, est.gemm_s, est.other_s))
    return out[0], out[1]


def layer_cost(config_path: str, overrides: list[str], gpu: GPU, count: int,
               cache: dict | None = None) -> LayerCost:
    """Two compiles (layers 2 and 3 at the config's sequence length), or none that
    ``cache`` holds already."""
    from lp_jax.config.yaml_io import load_config

    seq = load_config(config_path, overrides).data.seq_len
    measured, plan = {}, None
    for layers in LAYERS:
        step, plan = compile_layers(config_path, overrides, gpu, count, layers, seq, cache)
        measured[layers] = parts(step.text, gpu, count)
    (loops_hi, out_hi), (loops_lo, out_lo) = measured[LAYERS[1]], measured[LAYERS[0]]
    cfg = plan.config
    tokens = cfg.data.micro_batch_size * plan.accum_steps * seq
    minimum = minimum_layer_bytes(plan.model_config, plan.phases[0].recipe, tokens) / plan.tensor
    return LayerCost(loops_hi.minus(loops_lo), out_hi.minus(out_lo), minimum, seq)
