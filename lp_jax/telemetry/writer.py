"""quant_stats.jsonl and the TensorBoard scalars and image of the training probe.

On resume the file is cut back to the restored step, so after a stop and a resume it reads
as if the run had never stopped. TensorBoard gets its own event file in the run's
``tensorboard/`` folder: one scalar per statistic, layer, Linear and operand
(``quant_sqnr_db/03.attn/q_proj.fprop_x``), and the SQNR of all layers as one heatmap image
(``quant_stats/sqnr_db``, when matplotlib is installed).
"""
from __future__ import annotations

import os
import pathlib
import sys

from lp_jax.runs.jsonl import JsonlAppender, read_jsonl
from lp_jax.telemetry import heatmap
from lp_jax.telemetry.probe import OPERANDS, Layout
from lp_jax.telemetry.records import number, record, sqnr_grid
from lp_jax.telemetry.stats import STATS

FILE = "quant_stats.jsonl"


def read_quant_stats(run_dir: str | os.PathLike) -> list[dict]:
    """The records of RUN_DIR/quant_stats.jsonl ([] if none), up to a line cut short by a
    killed process."""
    return read_jsonl(pathlib.Path(run_dir) / FILE)


class QuantStatsWriter:
    def __init__(self, run_dir: str | os.PathLike, start_step: int, tensorboard: bool = True):
        self.path = pathlib.Path(run_dir) / FILE
        self._file = JsonlAppender(self.path, start_step)  # drops an interrupted session's rows
        self._tb = None
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                print("quant stats: tensorboardX is not installed; quant_stats.jsonl only",
                      file=sys.stderr)
            else:
                self._tb = SummaryWriter(str(pathlib.Path(run_dir) / "tensorboard"),
                                         filename_suffix=".quant_stats")

    def write(self, step: int, layout: Layout, stats: dict) -> None:
        rec = record(step, layout, stats)
        self._file.write(rec)
        if self._tb is not None:
            self._tensorboard(step, rec)

    def _tensorboard(self, step: int, rec: dict) -> None:
        for row in rec["layers"]:
            for op in OPERANDS if row["operands"] else ():
                for stat in STATS:
                    tag = f"quant_{stat}/{row['layer']:02d}.{row['linear']}.{op}"
                    self._tb.add_scalar(tag, number(row["operands"][op][stat]), step)
        if heatmap.available():
            values, labels = sqnr_grid(rec["layers"])
            fig = heatmap.sqnr_figure(values, labels, list(OPERANDS),
                                      f"SQNR (dB), {rec['recipe']} {rec['policy']}, step {step}")
            self._tb.add_image("quant_stats/sqnr_db", heatmap.rgb_array(fig), step, dataformats="HWC")
        self._tb.flush()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()

