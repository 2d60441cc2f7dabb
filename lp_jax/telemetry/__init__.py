"""Quantization telemetry: per-operand statistics (stats.py), the probe that collects them for
every quantized Linear on one batch (probe.py), their files (writer.py), and the SQNR
heatmap (heatmap.py). docs/telemetry.md."""
