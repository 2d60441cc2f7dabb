"""`python -m models.hf import|export`: HF folder <-> Orbax checkpoint of the model state.

    python -m models.hf import HF_DIR CKPT_DIR [--param-dtype float32]
    python -m models.hf export CKPT_DIR HF_DIR [--dtype bfloat16] [--max-shard-size 5GB]
    python -m models.hf export STATE_DIR HF_DIR --preset llama3_8b   # a bare state checkpoint

A training run folder exports with `python -m lp_jax.export RUN_DIR HF_DIR`. Bad input
prints one `error: ...` line and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from models.hf_config import HFError


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m models.hf", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF Llama folder -> Orbax checkpoint of nnx.state(model)")
    imp.add_argument("hf_dir")
    imp.add_argument("ckpt_dir", help="new folder: state/, llama_config.json, hf_config.json")
    imp.add_argument("--param-dtype", default="float32", help="master weight dtype (float32)")
    imp.add_argument("--dtype", default="bfloat16", help="compute dtype recorded in the config")
    exp = sub.add_parser("export", help="Orbax state checkpoint -> HF Llama folder")
    exp.add_argument("ckpt_dir", help="a state checkpoint written by import")
    exp.add_argument("hf_dir")
    exp.add_argument("--dtype", default=None, help="tensor dtype in the HF files (default: the "
                     "parameters' dtype); float32 | bfloat16 | float16")
    exp.add_argument("--max-shard-size", default="5GB")
    exp.add_argument("--preset", default=None, help="model preset, for a checkpoint without "
                     "llama_config.json")
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    # Deferred so that `--help` and argument errors answer without importing JAX.
    from models import hf
    from models.config import preset
    try:
        if args.command == "import":
            if os.path.exists(os.path.join(args.ckpt_dir, "state")):
                raise HFError(f"{args.ckpt_dir} already holds a checkpoint; choose a new folder")
            model = hf.load_hf(args.hf_dir, dtype=args.dtype, param_dtype=args.param_dtype)
            hf.save_state_checkpoint(model, args.ckpt_dir, hf_config=hf.read_hf_config(args.hf_dir))
            print(f"imported {args.hf_dir} -> {args.ckpt_dir}")
        elif not os.path.isdir(args.ckpt_dir):
            raise HFError(f"{args.ckpt_dir}: no such folder")
        else:
            cfg = None
            if args.preset is not None:
                try:
                    cfg = preset(args.preset)
                except ValueError as e:
                    raise HFError(str(e)) from None
            model = hf.load_state_checkpoint(args.ckpt_dir, cfg)
            extra = None
            hf_config_path = os.path.join(args.ckpt_dir, "hf_config.json")
            if os.path.isfile(hf_config_path):
                with open(hf_config_path) as f:
                    extra = json.load(f)
            hf.save_hf(model, args.hf_dir, dtype=args.dtype, max_shard_size=args.max_shard_size,
                       extra_config=extra)
            print(f"exported {args.ckpt_dir} -> {args.hf_dir}")
    except HFError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
