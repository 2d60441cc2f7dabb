"""The GPUs a plan compiles for: their vendor data-sheet figures and the target description
XLA's GPU compiler takes in place of a device (``GpuTargetConfigProto`` text).

Peaks are dense tensor-core TFLOP/s (no structured sparsity) per GPU; memory is what one
GPU holds; NVLink is one direction of the GPU's NVLink bandwidth. Sources: NVIDIA H100
Tensor Core GPU data sheet (SXM5: 132 SMs, 80 GB HBM3 at 3.35 TB/s, BF16 989.4, FP8 1978.9);
NVIDIA H200 data sheet (SXM: 141 GB HBM3e at 4.8 TB/s, the H100's compute); NVIDIA HGX B200
figures (per GPU: 180 GB HBM3e at 8 TB/s, BF16 2250, FP8 4500, FP4 9000); NVIDIA GB200 NVL72
data sheet (per GPU: 186 GB HBM3e at 8 TB/s, BF16 2500, FP8 5000, FP4 10000). NVLink: 900
GB/s per GPU both ways on Hopper (NVLink 4), 1800 GB/s on Blackwell (NVLink 5).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    description: str  # the device name XLA is told
    compute_capability: tuple[int, int]
    sms: int
    memory_bytes: int
    hbm_bytes_per_s: float
    peak_tflops: dict[str, float]  # operand type -> dense TFLOP/s ("fp4" absent: no FP4 MMA)
    nvlink_gbps: float  # one direction, GB/s
    clock_ghz: float
    l2_bytes: int
    gpus_per_node: int = 8  # NVLink domain

    def peak(self, operand_type: str | None) -> float:
        """TFLOP/s for a GEMM of this operand type; FP32 runs at TF32 rate (half of BF16);
        a type without native tensor cores (FP4 on Hopper) at the BF16 rate it is expanded to."""
        if operand_type == "fp32":
            return self.peak_tflops["bf16"] / 2
        return self.peak_tflops.get(operand_type or "bf16", self.peak_tflops["bf16"])

    def target_config(self) -> str:
        """``GpuTargetConfigProto`` text for ``jax.experimental.topologies.get_topology_desc``."""
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: {self.sms}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.hbm_bytes_per_s)}
  l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory_bytes}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  dnn_version: "9.10.0"
}}
platform_name: "CUDA"
runtime_version {{ major: 13 }}
device_description_str: "{self.description}"
"""


GB = 10 ** 9
GPUS = {
    "h100": GPU("h100", "NVIDIA H100 80GB HBM3", (9, 0), 132, 80 * GB, 3.35e12,
                {"bf16": 989.4, "fp8": 1978.9}, 450.0, 1.98, 50 * 2 ** 20),
    "h200": GPU("h200", "NVIDIA H200", (9, 0), 132, 141 * GB, 4.8e12,
                {"bf16": 989.4, "fp8": 1978.9}, 450.0, 1.98, 50 * 2 ** 20),
    "b200": GPU("b200", "NVIDIA B200", (10, 0), 148, 180 * GB, 8.0e12,
                {"bf16": 2250.0, "fp8": 4500.0, "fp4": 9000.0}, 900.0, 1.965, 126 * 2 ** 20),
    "gb200": GPU("gb200", "NVIDIA GB200", (10, 0), 148, 186 * GB, 8.0e12,
                 {"bf16": 2500.0, "fp8": 5000.0, "fp4": 10000.0}, 900.0, 2.062, 126 * 2 ** 20,
                 gpus_per_node=72),
}


def gpu(name: str) -> GPU:
    """The GPU named (h100, h200, b200, gb200); a ValueError of one line for any other."""
    key = name.lower()
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}: choose one of {', '.join(GPUS)}")
    return GPUS[key]
