"""See what a training run's checkpoint writes: ``python -m lp_jax.evaluation.generate RUN_DIR --prompt TEXT``.

Loads the run's latest checkpoint and tokenizer as ``eval.py --checkpoint`` does (plain
model, BF16 compute), then samples with the KV-cache generator of ``models.generate``.
For a Hugging Face folder use ``python -m models.generate HF_DIR``.
"""
from __future__ import annotations

import argparse
import sys

import jax.numpy as jnp

from lp_jax.errors import UserError
from lp_jax.evaluation.loading import load_from_run_dir
from models.generate import generate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lp_jax.evaluation.generate", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="a train.py run folder (config.yaml + checkpoints/)")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        loaded = load_from_run_dir(args.run_dir)
        tok = loaded.tokenizer
        ids = ([tok.bos_id] if tok.bos_id is not None else []) + list(tok.encode(args.prompt))
        out = generate(loaded.model, jnp.asarray([ids]), args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, eos_id=getattr(tok, "eos_id", None), seed=args.seed)
    except (UserError, ValueError, FileNotFoundError) as e:
        print(f"python -m lp_jax.evaluation.generate: error: {e}", file=sys.stderr)
        return 2
    new = [int(t) for t in out[0, len(ids):]]
    print(args.prompt + tok.decode(new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
