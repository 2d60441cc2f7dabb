"""Tokens/s and MFU of the trainer's step per recipe, for a model preset, on this machine.

    python bench/train_throughput.py [--preset llama3_1b --seq-len 2048 --batch 4 --steps 4]
                                     [--recipes bf16,fp8_cs,mxfp8,nvfp4,fp8_block] [--set KEY=VALUE ...] [--tiny]

Each recipe trains ``steps`` optimizer steps of the trainer's own jitted step (the config
the trainer would resolve: recipe defaults, FiLj policy and GEMM backend as "auto" picks
them here) on random tokens; the first step includes compilation and is left out. Nothing
is written to disk (a checkpoint of a 1B model with its Adam moments is ~15 GB).
tokens/s = tokens per step / median step time; MFU = model FLOPs (lp_jax.training.metrics)
per second per device / the device's dense peak for the recipe's GEMM format.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lp_jax  # noqa: E402
from bench.common import platform_line, print_table  # noqa: E402
from lp_jax.config.yaml_io import load_config  # noqa: E402
from lp_jax.gemm.backends import backend_on, current_platform  # noqa: E402
from lp_jax.parallel.mesh import make_mesh  # noqa: E402
from lp_jax.training import metrics as metrics_lib  # noqa: E402
from lp_jax.training import state as state_lib  # noqa: E402
from lp_jax.training.optimizer import make_optimizer  # noqa: E402
from lp_jax.training.step import StepSpec, train_step  # noqa: E402
from lp_jax.training.validate import resolve  # noqa: E402
from models import llama  # noqa: E402


def _batch(rng, rows, seq_len, vocab):
    tokens = rng.integers(0, vocab, (rows, seq_len + 1))
    return {"tokens": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32),
            "segment_ids": np.ones((rows, seq_len), np.int32),
            "positions": np.tile(np.arange(seq_len, dtype=np.int32), (rows, 1)),
            "loss_mask": np.ones((rows, seq_len), bool)}


def measure(preset: str, recipe: str, seq_len: int, batch: int, steps: int, extra=()) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:  # resolve checks the run folder; nothing is written
        plan = resolve(load_config(None, [
            f"run_dir={run_dir}", f"model.preset={preset}", "data.source=mock",
            f"data.seq_len={seq_len}", f"data.global_batch_size={batch}",
            f"data.micro_batch_size={batch // jax.device_count() or 1}", "model.scan_layers=true",
            f"precision={recipe}", f"steps={steps}", *extra]))
    cfg, phase = plan.config, plan.phases[0]
    mesh = make_mesh(plan.data_parallel, plan.fsdp, plan.tensor, plan.expert)
    spec = StepSpec.from_plan(plan, mesh)
    tx = make_optimizer(spec.optimizer)
    build = lambda: llama.Llama(plan.model_config, rngs=nnx.Rngs(0))  # noqa: E731
    abstract = nnx.eval_shape(build)
    report = lp_jax.apply_recipe(abstract, phase.recipe)
    graphdef = state_lib.split_model(abstract)[0]
    target = state_lib.abstract_state(state_lib.split_model(abstract), tx, cfg.seed)
    state = state_lib.init_state(build, tx, cfg.seed, spec.state_shardings(target))
    rng, times = np.random.default_rng(0), []
    for _ in range(steps):
        placed = state_lib.place_batch(_batch(rng, batch, seq_len, plan.model_config.vocab_size),
                                       plan.accum_steps, mesh, batch)
        t0 = time.perf_counter()
        state, m = train_step(graphdef, spec, state, placed)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times[1:] or times)  # the first step compiles
    tokens = batch * seq_len
    tflops = metrics_lib.flops_per_token(plan.model_config, seq_len) * tokens / seconds / jax.device_count() / 1e12
    peak = metrics_lib.peak_tflops(jax.devices()[0].device_kind, phase.recipe.name)
    return {"recipe": recipe, "policy": phase.recipe.policy, "quantized": len(report.quantized),
            "backend": backend_on(phase.recipe, current_platform()), "compile_s": times[0] - seconds,
            "step_s": seconds, "tokens_per_sec": tokens / seconds, "tflops": tflops,
            "mfu": tflops / peak if peak else None, "loss": float(m["loss"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama3_1b")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per recipe (the first compiles)")
    ap.add_argument("--recipes", default="bf16,fp8_cs,mxfp8,nvfp4,fp8_block")
    ap.add_argument("--budget-s", type=float, default=None, help="start no new recipe after this")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every recipe (e.g. model.num_layers=8), after the defaults")
    ap.add_argument("--tiny", action="store_true", help="the tiny preset (a CPU smoke run)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    extra = ()
    if args.tiny:  # a smoke run of every row: no time budget
        args.budget_s = None
        args.preset, args.seq_len, args.batch, args.steps = "tiny", 32, 2, 2
        extra = ("precision.last_bf16_layers=1",)  # NVFP4's F0L4 would leave 4 layers all BF16
    print(platform_line())
    rows = []
    for recipe in args.recipes.split(","):
        if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
            print(f"... {recipe}: skipped, time budget of {args.budget_s:.0f} s spent", file=sys.stderr)
            continue
        r = measure(args.preset, recipe, args.seq_len, args.batch, args.steps,
                    (*(extra if recipe == "nvfp4" else ()), *args.set))
        rows.append((recipe, r["policy"], r["quantized"], r["backend"], f"{r['compile_s']:.0f}",
                     f"{r['step_s'] * 1e3:.0f}", f"{r['tokens_per_sec']:.0f}", f"{r['tflops']:.1f}",
                     "" if r["mfu"] is None else f"{r['mfu']:.3f}", f"{r['loss']:.3f}"))
        print(f"... {recipe}: {r['tokens_per_sec']:.0f} tokens/s, MFU {rows[-1][8] or 'n/a'}, "
              f"compile {r['compile_s']:.0f} s", flush=True)
    base = float(rows[0][6]) if rows and rows[0][0] == "bf16" else None
    rows = [(*r, f"{float(r[6]) / base:.2f}" if base else "") for r in rows]
    print_table(["recipe", "policy", "quantized Linears", "GEMM backend", "compile s", "step ms",
                 "tokens/s", "TFLOP/s/device", "MFU", "last loss", "x bf16 tokens/s"], rows,
                title=f"{args.preset}: {args.batch} x {args.seq_len} tokens per step, median of "
                      f"{max(args.steps - 1, 1)} steps after the compiling one")
    return 0


if __name__ == "__main__":
    sys.exit(main())
