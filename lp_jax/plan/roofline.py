"""An estimated step time from a compiled module's kernels: a roofline per kernel.

Each kernel costs the larger of its FLOPs at ``GEMM_EFFICIENCY`` of the dense peak of its
operand type and its HBM bytes at ``HBM_EFFICIENCY`` of the memory bandwidth, plus
``LAUNCH_S`` per launch. Collectives cost their wire bytes (``comm_time``) at the link's
bandwidth: NVLink within a node, the network across nodes. Synchronous collectives add to
the compute; asynchronous ones (XLA's ``-start``/``-done`` pairs) overlap with it, and only
what exceeds the compute time adds. docs/plan.md states why these constants.
"""
from __future__ import annotations

import collections
import dataclasses

from lp_jax.plan.comm_time import NETWORK_GBPS, wire_bytes
from lp_jax.plan.gpus import GPU
from lp_jax.plan.kernels import Kernel

GEMM_EFFICIENCY = 0.70  # of the dense peak: large GEMMs reach 70-80% on Hopper and Blackwell
HBM_EFFICIENCY = 0.80  # of the data-sheet bandwidth: what streaming kernels reach
LAUNCH_S = 2e-6  # per kernel launch (and its tail), XLA's command buffers included


@dataclasses.dataclass(frozen=True)
class Estimate:
    step_s: float
    gemm_s: float  # kernels doing GEMM or attention FLOPs
    other_s: float  # every other kernel (bandwidth and launches)
    collective_s: float  # wire time of all collectives
    exposed_collective_s: float  # the part not hidden behind compute
    launches: int
    hbm_bytes: float
    flops: float
    collective_bytes: float
    gemms: dict[str, int]  # library -> GEMM launches per step
    gemm_types: dict[str, int]  # operand type -> GEMM launches per step


# Libraries whose GEMMs are expected to reach less of the peak. lp_jax's Hopper FP8 block
# GEMM (one warpgroup per CTA, its FP32 scaling of each K block not overlapped with that
# CTA's next WGMMA; DeepGEMM's tuned kernel reports about 75%): an assumption until
# bench/gpu_check.sh times it on an H200.
LIBRARY_EFFICIENCY = {"pallas_wgmma": 0.50}


def kernel_seconds(k: Kernel, gpu: GPU) -> float:
    efficiency = LIBRARY_EFFICIENCY.get(k.library, GEMM_EFFICIENCY)
    compute = k.flops / (efficiency * gpu.peak(k.operand_type) * 1e12) if k.flops else 0.0
    memory = k.bytes / (HBM_EFFICIENCY * gpu.hbm_bytes_per_s)
    return max(compute, memory) + LAUNCH_S


def collective_seconds(k: Kernel, gpu: GPU, device_count: int) -> float:
    crosses = k.group_size > min(gpu.gpus_per_node, device_count)
    gbps = NETWORK_GBPS if crosses else gpu.nvlink_gbps
    return wire_bytes(k.collective, k.bytes, k.group_size) / (gbps * 1e9)


def estimate(kernels: list[Kernel], gpu: GPU, device_count: int) -> Estimate:
    gemm_s = other_s = sync_s = async_s = 0.0
    gemms, types = collections.Counter(), collections.Counter()
    for k in kernels:
        if k.collective is not None:
            t = collective_seconds(k, gpu, device_count) * k.runs
            if k.is_async:
                async_s += t
            else:
                sync_s += t
            continue
        t = kernel_seconds(k, gpu) * k.runs
        if k.library is not None:
            gemm_s += t
            gemms[k.library] += k.runs
            types[k.operand_type or "unknown"] += k.runs
        else:
            other_s += t
    compute = gemm_s + other_s
    exposed = sync_s + max(0.0, async_s - compute)
    return Estimate(compute + exposed, gemm_s, other_s, sync_s + async_s, exposed,
                    sum(k.runs for k in kernels),
                    float(sum(k.bytes * k.runs for k in kernels if k.collective is None)),
                    float(sum(k.flops * k.runs for k in kernels)),
                    float(sum(k.bytes * k.runs for k in kernels if k.collective is not None)),
                    dict(gemms), dict(types))
