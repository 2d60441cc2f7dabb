"""How close each recipe's loss and weight gradients are to BF16's, at a trained checkpoint.

    python bench/grad_fidelity.py runs/study/study_tiny/runs/bf16 [--recipes fp8_cs,mxfp8,nvfp4]

Loads the run's final weights (as eval.py does), swaps every Linear inside the layers to
each recipe (F0L0, so every layer counts), and takes one loss-and-gradient of the
trainer's own forward on a batch of text (default: Python standard-library sources, the
tiny configs' training text; ``--text FILE`` for another). Prints, per recipe, the loss
gap to BF16 and, over the layer weights, the cosine between the recipe's and BF16's
gradients and the regression slope of one on the other (1.0: no scale bias; stochastic
rounding is unbiased, so NVFP4's slope should stay near 1 too).

What it is for: telling a recipe that trains worse because its per-step gradients are
worse from one that drifts for other reasons.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import lp_jax  # noqa: E402
from bench.common import platform_line, print_table  # noqa: E402
from lp_jax.errors import UserError
from lp_jax.evaluation.loading import load_from_run_dir  # noqa: E402
from lp_jax.parallel.mesh import make_mesh  # noqa: E402
from lp_jax.training.state import split_model  # noqa: E402
from lp_jax.training.step import forward_nll  # noqa: E402


def text_batch(tokenizer, text: str, rows: int, seq_len: int) -> dict:
    ids = tokenizer.encode(text)
    need = rows * (seq_len + 1)
    if len(ids) < need:
        raise SystemExit(f"grad_fidelity: the text has {len(ids)} tokens, {need} needed "
                         f"(--rows {rows} x (--seq-len {seq_len} + 1))")
    ids = np.asarray(ids[:need], np.int32).reshape(rows, seq_len + 1)
    return {"tokens": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": np.ones((rows, seq_len), bool),
            "segment_ids": np.ones((rows, seq_len), np.int32),
            "positions": np.tile(np.arange(seq_len, dtype=np.int32), (rows, 1))}


def loss_and_grads(model, recipe: str, batch: dict, mesh):
    lp_jax.apply_recipe(model, lp_jax.get_recipe(recipe, first_bf16_layers=0, last_bf16_layers=0))
    graphdef, params, rest = split_model(model)

    def mean_nll(p):
        nll, count = forward_nll(graphdef, p, rest, batch, jax.random.key(0), mesh)
        return nll / count

    loss, grads = jax.jit(jax.value_and_grad(mean_nll))(params)
    return float(loss), grads


def compare(ref, grads) -> tuple[np.ndarray, np.ndarray]:
    """Cosines and slopes over the layer weights (the Linears a recipe quantizes)."""
    other = dict(jax.tree_util.tree_leaves_with_path(grads))
    cosines, slopes = [], []
    for path, a in jax.tree_util.tree_leaves_with_path(ref):
        if "layers" not in jax.tree_util.keystr(path) or a.ndim < 2:
            continue
        a = np.asarray(a, np.float64).ravel()
        b = np.asarray(other[path], np.float64).ravel()
        cosines.append(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
        slopes.append(a @ b / (a @ a))
    return np.array(cosines), np.array(slopes)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="a train.py run folder (config.yaml and checkpoints)")
    p.add_argument("--recipes", default="fp8_cs,mxfp8,nvfp4")
    p.add_argument("--text", help="a text file (default: Python standard-library sources)")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    args = p.parse_args(argv)
    try:
        loaded = load_from_run_dir(args.run_dir)
    except UserError as e:
        raise SystemExit(f"grad_fidelity: {e}") from None
    if args.text:
        text = open(args.text, encoding="utf-8", errors="replace").read()
    else:
        text = "".join(open(m.__file__, encoding="utf-8").read() for m in (json.decoder, json.encoder, logging))
    batch = text_batch(loaded.tokenizer, text, args.rows, args.seq_len)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    print(f"{platform_line()}; {loaded.source}; {args.rows} x {args.seq_len} tokens")
    ref_loss, ref = loss_and_grads(loaded.model, "bf16", batch, mesh)
    rows = [["bf16", f"{ref_loss:.4f}", "-", "1", "1", "1"]]
    for recipe in [r.strip() for r in args.recipes.split(",") if r.strip()]:
        loss, grads = loss_and_grads(loaded.model, recipe, batch, mesh)
        cos, slope = compare(ref, grads)
        rows.append([recipe, f"{loss:.4f}", f"{100 * (loss / ref_loss - 1):+.2f}%", f"{cos.mean():.4f}",
                     f"{cos.min():.4f}", f"{slope.mean():.4f}"])
    print_table(["recipe (F0L0)", "loss", "gap to BF16", "grad cosine, mean", "min", "grad slope, mean"],
                rows, title="Loss and layer-weight gradients against BF16, one batch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
