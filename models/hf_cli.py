"""`python -m models.hf import|export`: HF folder <-> Orbax checkpoint of the model state.

    python -m models.hf import HF_DIR CKPT_DIR [--param-dtype float32]
    python -m models.hf export CKPT_DIR HF_DIR [--dtype bfloat16] [--max-shard-size 5GB]
    python -m models.hf export STATE_DIR HF_DIR --preset llama3_8b   # a bare state checkpoint

A training run folder exports with `python -m lp_jax.export RUN_DIR HF_DIR`. Both write
their output folder whole (``models.files``): export replaces an earlier export (one holding
lp_jax_export.json) and refuses any other folder that holds files; import refuses a folder
that is not empty. Bad input, and a write that fails (a full disk), print one `error: ...`
line and exit with status 2.
"""
from __future__ import annotations

import argparse
import os
import sys

from models.hf_config import HFError


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m models.hf", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF Llama or Qwen3-MoE folder -> Orbax checkpoint of "
                         "nnx.state(model)")
    imp.add_argument("hf_dir")
    imp.add_argument("ckpt_dir", help="new folder: state/, llama_config.json, hf_config.json")
    imp.add_argument("--param-dtype", default="float32", help="master weight dtype (float32)")
    imp.add_argument("--dtype", default="bfloat16", help="compute dtype recorded in the config")
    exp = sub.add_parser("export", help="Orbax state checkpoint -> HF Llama or Qwen3-MoE folder")
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
    try:
        if args.command == "import":
            _import(args)
        else:
            _export(args)
    except HFError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _import(args) -> None:
    # Deferred so that `--help` and argument errors answer without importing JAX.
    from models import hf
    from models.files import check_output, written_whole

    check_output(args.ckpt_dir, "ckpt_dir", replaces_exports=False)  # import never overwrites
    model = hf.load_hf(args.hf_dir, dtype=args.dtype, param_dtype=args.param_dtype)
    hf_config = hf.read_hf_config(args.hf_dir)
    with written_whole(args.ckpt_dir, "ckpt_dir") as folder:
        hf.save_state_checkpoint(model, folder, hf_config=hf_config)
    print(f"imported {args.hf_dir} -> {args.ckpt_dir}")


def _export(args) -> None:
    from models import hf
    from models.config import preset
    from models.files import check_output, read_json_object, written_whole

    if not os.path.isdir(args.ckpt_dir):
        raise HFError(f"{args.ckpt_dir}: no such folder")
    check_output(args.hf_dir, "hf_dir", replaces_exports=True)
    cfg = None
    if args.preset is not None:
        try:
            cfg = preset(args.preset)
        except ValueError as e:
            raise HFError(str(e)) from None
    hf_config_path = os.path.join(args.ckpt_dir, "hf_config.json")
    extra = read_json_object(hf_config_path) if os.path.isfile(hf_config_path) else None
    model = hf.load_state_checkpoint(args.ckpt_dir, cfg)
    marker = {"written_by": "python -m models.hf export", "source": os.path.abspath(args.ckpt_dir)}
    with written_whole(args.hf_dir, "hf_dir", marker=marker) as folder:
        hf.save_hf(model, folder, dtype=args.dtype, max_shard_size=args.max_shard_size,
                   extra_config=extra)
    print(f"exported {args.ckpt_dir} -> {args.hf_dir}")


if __name__ == "__main__":
    sys.exit(main())
