"""``python -m lp_jax.plan --config CONFIG --gpu {h100,h200,b200,gb200}``: will the run fit,
and how fast would it be? The trainer's step compiled for N described GPUs, one row per
recipe: memory per GPU, GEMMs by library, kernels, HBM bytes, FLOPs, collective bytes and
an estimated step time (docs/plan.md). Bad input is one ``error:`` line and exit status 2."""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from typing import Sequence

from lp_jax.plan.environment import deviceless, plugin_problem

PROG = "python -m lp_jax.plan"
RECIPES = "bf16,fp8_cs,mxfp8,nvfp4"
DEFAULT_GPUS = 8
EXIT_BAD_INPUT = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="a run config, as train.py takes it")
    p.add_argument("--gpu", required=True, help="h100 | h200 | b200 | gb200")
    p.add_argument("--gpus", type=int, default=None,
                   help=f"how many (default: the config's mesh size, else {DEFAULT_GPUS})")
    p.add_argument("--recipes", default=RECIPES, help="comma-separated (default %(default)s)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--hlo-dir", default=None, metavar="DIR", help="write DIR/<recipe>.hlo.txt")
    p.add_argument("--layer-bytes", action="store_true",
                   help="also measure what one layer keeps for its backward, in bytes per token per "
                        "hidden unit (four more compiles per recipe, at 2 and 3 layers; docs/plan.md)")
    p.add_argument("--layer-cost", action="store_true",
                   help="also measure one layer's forward and backward: HBM bytes, kernels, GEMM and "
                        "other time, against BF16's and the quantization's floor (two more compiles per "
                        "recipe, shared with --layer-bytes; docs/plan.md)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as train.py")
    return p


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    deviceless()
    from lp_jax.config.yaml_io import load_config
    from lp_jax.errors import UserError
    from lp_jax.plan.gpus import gpu as gpu_named
    from lp_jax.plan.rows import with_ratios
    from lp_jax.plan.table import layer_table, table
    from lp_jax.recipes import RECIPES as KNOWN
    from lp_jax.training.cli import find_config
    from lp_jax.training.validate import resolve

    try:
        gpu = gpu_named(args.gpu)
    except ValueError as e:
        return _fail(str(e))
    problem = plugin_problem()
    if problem:
        return _fail(problem)
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in recipes if r not in KNOWN]
    if unknown or not recipes:
        return _fail(f"--recipes {args.recipes!r}: unknown {', '.join(unknown) or 'empty'}; "
                     f"choose from {RECIPES}")
    if args.gpus is not None and args.gpus < 1:
        return _fail(f"--gpus {args.gpus}: must be at least 1")
    config_path = find_config(args.config)
    try:
        config = load_config(config_path, args.overrides)
        count = args.gpus or _mesh_size(config) or DEFAULT_GPUS
        for recipe in recipes:  # every recipe placed on the GPUs before any compiles
            resolve(load_config(config_path, [*args.overrides, f"precision.recipe={recipe}"]),
                    device_count=count, check_files=False)
    except UserError as e:
        return _fail(str(e))
    if args.hlo_dir:
        os.makedirs(args.hlo_dir, exist_ok=True)
    rows = []
    for recipe in recipes:
        print(f"{PROG}: compiling {recipe} for {count} x {gpu.name} ...", file=sys.stderr, flush=True)
        rows.append(_compile(config_path, args, recipe, count))
    rows = with_ratios(rows)
    print(table(rows, gpu, count))
    if args.layer_cost:
        print()
        print(layer_table(rows, gpu))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu.name, "gpus": count, "rows": rows}, f, indent=2)
    return 1 if any("error" in r for r in rows) else 0


def _mesh_size(config) -> int | None:
    sizes = (config.mesh.data, config.mesh.fsdp, config.mesh.tensor, config.mesh.expert)
    return None if -1 in sizes else math.prod(sizes)


def _compile(config_path: str, args, recipe: str, count: int) -> dict:
    request = {"config": config_path, "overrides": list(args.overrides), "recipe": recipe,
               "gpu": args.gpu, "gpus": count, "hlo_dir": args.hlo_dir, "layer_bytes": args.layer_bytes,
               "layer_cost": args.layer_cost}
    proc = subprocess.run([sys.executable, "-m", "lp_jax.plan.worker", json.dumps(request)],
                          capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        try:
            return json.loads(lines[-1])
        except json.JSONDecodeError:
            pass
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"recipe": recipe, "error": f"the compile stopped (exit {proc.returncode}): {last[:300]}"}


if __name__ == "__main__":
    sys.exit(main())
