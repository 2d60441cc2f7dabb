"""Quantization telemetry: the statistics of one GEMM operand (``lp_jax.telemetry.stats``), the
probe that measures all six operands of every quantized Linear on one batch (``.probe``), the
quant_stats.jsonl record and tables (``.records``), the files (``.writer``) and the SQNR
heatmap (``.heatmap``). docs/telemetry.md."""
