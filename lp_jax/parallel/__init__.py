"""Parallelism: the device mesh, the partitioning rules, multi-process start-up, and which
Linears gather quantized weights or reduce tensor-parallel sums in BF16."""
