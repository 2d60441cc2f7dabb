"""Communication time of a compiled step from its collectives, next to its compute time.

A bandwidth-only model (no latency, no overlap with compute), as NCCL's "bus bandwidth"
counts it: a device sends, over its own link, (n-1)/n of a reduce-scatter's or an
all-to-all's operand, 2(n-1)/n of an all-reduce's, (n-1) times an all-gather's operand
(its shard), and all of a collective-permute's; n is the collective's group size. Each
collective runs at the bandwidth of the slowest link its group uses: NVLink when all its
devices sit in one node, the network otherwise (devices are numbered in mesh order,
``gpus_per_node`` to a node, as lp_jax.parallel.mesh lays them out).

The defaults: H100/H200 SXM NVLink 4, 900 GB/s per GPU counting both directions, so 450
GB/s each way; 50 GB/s per GPU across nodes (one 400 Gb/s NIC per GPU); compute at the
GPU's dense BF16 peak, 989.4 TFLOP/s (lp_jax.training.metrics.PEAK_TFLOPS).
"""
from __future__ import annotations

NVLINK_GBPS = 450.0
NETWORK_GBPS = 50.0
BF16_PEAK_TFLOPS = 989.4


def wire_bytes(kind: str, operand_bytes: int, n: int) -> float:
    """Bytes one device sends for one collective over a group of n devices."""
    if n <= 1:
        return 0.0
    return {"all-reduce": 2 * (n - 1) / n * operand_bytes,
            "reduce-scatter": (n - 1) / n * operand_bytes,
            "all-to-all": (n - 1) / n * operand_bytes,
            "all-gather": (n - 1) * operand_bytes,
            "collective-permute": float(operand_bytes)}[kind]


def seconds(collectives, device_count: int, gpus_per_node: int, nvlink_gbps: float = NVLINK_GBPS,
            network_gbps: float = NETWORK_GBPS) -> float:
    """Communication seconds of one run of the module (bench.hlo_collectives.collectives)."""
    total = 0.0
    for c in collectives:
        groups = c.groups or (tuple(range(device_count)),)
        n = max(len(g) for g in groups)
        crosses = any(len({d // gpus_per_node for d in g}) > 1 for g in groups)
        gbps = network_gbps if crosses else nvlink_gbps
        total += wire_bytes(c.kind, c.bytes, n) * c.runs / (gbps * 1e9)
    return total


def compute_seconds(flops_per_device: float, peak_tflops: float = BF16_PEAK_TFLOPS) -> float:
    return flops_per_device / (peak_tflops * 1e12)
