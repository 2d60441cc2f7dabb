"""What logging.quant_stats_every costs a training run: the trainer on configs/tiny.yaml
(or --config), once with the probe off and once every --every steps, same seed and data.

    python bench/quant_stats_overhead.py [--config configs/tiny.yaml] [--steps 300]
        [--every 100] [--precision nvfp4] [overrides ...]

Prints, per setting: the mean train-step time over steps 2..N (step_time_s of
metrics.jsonl: step 1 holds the compilation), the probe's calls (the first one includes
its compilation), and the mean time per step with the probes counted in: every probe at
the steady-state cost of the later ones, and then with the first probe's compilation. Runs write to a temporary folder (or --keep DIR).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import platform_line, print_table  # noqa: E402
from lp_jax.config.yaml_io import load_config  # noqa: E402
from lp_jax.training import quant_stats as telemetry  # noqa: E402
from lp_jax.training.loop import run  # noqa: E402
from lp_jax.training.metrics import read_metrics  # noqa: E402
from lp_jax.training.validate import resolve  # noqa: E402


def timed_probe_calls() -> list[float]:
    """Wraps QuantStatsProbe.measure to record how long each call takes (it blocks until the
    statistics are on the host, so this is its whole cost to the loop)."""
    calls: list[float] = []
    measure = telemetry.QuantStatsProbe.measure

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        measure(self, *args, **kwargs)
        calls.append(time.perf_counter() - t0)

    telemetry.QuantStatsProbe.measure = timed
    return calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--precision", default="nvfp4")
    parser.add_argument("--keep", default=None, help="write the runs under this folder and keep "
                        "them (default: a temporary folder)")
    parser.add_argument("overrides", nargs="*", help="more config overrides, key=value")
    args = parser.parse_args()
    calls = timed_probe_calls()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or scratch
        for every in (0, args.every):
            del calls[:]
            overrides = [f"run_dir={tmp}/every{every}", f"steps={args.steps}", f"precision={args.precision}",
                         f"logging.quant_stats_every={every}", "logging.progress_bar=false",
                         "logging.tensorboard=false", f"checkpoint.every={args.steps}", *args.overrides]
            t0 = time.perf_counter()
            run(resolve(load_config(args.config, overrides)))
            wall = time.perf_counter() - t0
            steps = [m["step_time_s"] for m in read_metrics(f"{tmp}/every{every}")][1:]
            step_mean = statistics.mean(steps)
            later = calls[1:]
            # every probe counted at its steady-state cost (the first one's compile aside)
            steady = statistics.mean(later) if later else (calls[0] if calls else 0.0)
            with_probes = (sum(steps) + steady * len(calls)) / len(steps)
            with_compile = (sum(steps) + sum(calls)) / len(steps)
            rows.append([every, f"{step_mean * 1e3:.1f}", len(calls),
                         f"{calls[0]:.1f}" if calls else "-",
                         f"{statistics.mean(later) * 1e3:.0f}" if later else "-",
                         f"{with_probes * 1e3:.1f}", f"{with_compile * 1e3:.1f}", f"{wall:.0f}"])
    base = float(rows[0][1])
    for row in rows:
        row.append(f"{100 * (float(row[5]) / base - 1):+.2f}%")
    print(platform_line())
    print_table(["quant_stats_every", "train step ms (2..N)", "probes", "1st probe s",
                 "later probes ms", "ms/step with probes", "ms/step with probe compile",
                 "run wall s", "vs every=0 (probes counted)"], rows,
                title=f"{args.config} {args.precision}, {args.steps} steps")


if __name__ == "__main__":
    main()
