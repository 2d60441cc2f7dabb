"""`python -m lp_jax.export SOURCE HF_DIR`: a training run's weights -> a Hugging Face folder.

    python -m lp_jax.export RUN_DIR HF_DIR [--step N] [--dtype bfloat16] [--max-shard-size 5GB]

SOURCE is a run folder, its checkpoints/ folder or one checkpoints/STEP folder (a plain
state checkpoint of `python -m models.hf import` exports with `python -m models.hf export`).
HF_DIR is written whole (``lp_jax/runs/hf_export.py``): an earlier export there is replaced,
a folder that holds other files is refused. Bad input, and a write that fails (a full disk),
print one `error: ...` line and exit with status 2.
"""
from __future__ import annotations

import argparse
import os
import sys


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lp_jax.export", description=__doc__.split("\n")[0])
    ap.add_argument("source", help="a training run folder (or its checkpoints/ or checkpoints/STEP folder)")
    ap.add_argument("hf_dir")
    ap.add_argument("--step", type=int, default=None, help="the run's checkpoint to export "
                    "(default: the newest that restores)")
    ap.add_argument("--dtype", default=None, help="tensor dtype in the HF files (default: the "
                    "parameters' dtype); float32 | bfloat16 | float16")
    ap.add_argument("--max-shard-size", default="5GB")
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    # After argparse, so that --help and argument errors answer without importing JAX.
    from lp_jax.errors import UserError
    from lp_jax.runs.hf_export import export_run
    from lp_jax.runs.run_folder import is_run_source
    from models.hf_config import HFError

    try:
        if not os.path.isdir(args.source):
            raise UserError(f"{args.source}: no such folder")
        if not is_run_source(args.source):
            raise UserError(f"{args.source}: not a training run folder (no config.yaml) nor a "
                            "checkpoint folder of one; a state checkpoint exports with "
                            "python -m models.hf export")
        export_run(args.source, args.hf_dir, step=args.step, dtype=args.dtype,
                   max_shard_size=args.max_shard_size)
    except (HFError, UserError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
