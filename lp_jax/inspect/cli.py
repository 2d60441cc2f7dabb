"""``python -m lp_jax.inspect RUN_DIR [--recipe R] [--batches N] [--budget PCT] [--hf DIR]``

Which layers of a trained model to keep in BF16: on N batches of the run's data, with recipe
R on every layer, the training probe's statistics (``lp_jax.telemetry``) of every Linear, each
layer's sensitivity (the loss increase over all-BF16 when only it is quantized) and the fewest
BF16 layers whose gap fits ``--budget`` percent, printed as a config override; written to
RUN_DIR/inspect.md and RUN_DIR/inspect_sqnr.png. Bad input is one line on stderr, exit
status 2. docs/telemetry.md describes each step.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from lp_jax.errors import UserError
from lp_jax.inspect import sensitivity as sens_lib


@dataclasses.dataclass
class Inspection:
    run_dir: str
    source: str  # what the weights came from
    recipe: object
    batches: int
    rows: list  # telemetry records' layer rows
    sensitivity: sens_lib.Sensitivity
    proposal: sens_lib.Proposal
    budget_pct: float
    heatmap: str | None  # path of the PNG, None without matplotlib


def _recipe(saved, name: str | None):
    import lp_jax

    run_precision = saved.config.precision
    try:
        if name is None or name == run_precision.recipe:
            overrides = {k: v for k, v in run_precision.overrides().items()
                         if k not in ("first_bf16_layers", "last_bf16_layers", "bf16_layers")}
            recipe = lp_jax.get_recipe(saved.recipe if name is None else name, **overrides)
        else:
            recipe = lp_jax.get_recipe(name, backend=run_precision.backend)
        recipe = lp_jax.get_recipe(recipe, policy="F0L0", bf16_layers=())
    except ValueError as e:
        raise UserError(f"--recipe: {' '.join(str(e).split())}") from None
    if not recipe.quantized:
        raise UserError(f"--recipe {recipe.name}: quantizes nothing; name a low-precision "
                        "recipe (fp8_cs, mxfp8, nvfp4)")
    return recipe


def _model(run_dir: str, hf: str | None):
    """(the run's checkpoint read, the model (compute dtype as trained, FP32 weights), a
    description of its source). Without ``hf``, the newest checkpoint that restores."""
    import jax.numpy as jnp

    from lp_jax.runs.run_folder import open_and_restore, open_run

    try:
        if hf is None:
            saved, model = open_and_restore(run_dir, as_trained=True)
            return saved, model, f"{saved.checkpoint_dir} step {saved.step}"
        saved = open_run(run_dir)
    except UserError as e:
        raise UserError(str(e)) from None
    from models.hf import load_hf

    if not os.path.isdir(hf):
        raise UserError(f"--hf {hf}: no such folder")
    try:
        return saved, load_hf(hf, dtype=jnp.dtype(saved.config.model.dtype)), f"hf:{os.path.abspath(hf)}"
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"--hf {hf}: {' '.join(str(e).split())}") from None


def _batches(saved, vocab_size: int, n: int, mesh) -> list:
    """N global batches of the run's data ([1, global, L]: one micro-batch each)."""
    from lp_jax.config.schema import MOCK_SOURCES
    from lp_jax.data import pipeline as data_lib
    from lp_jax.data.tokenizers import get_tokenizer
    from lp_jax.training.state import place_batch

    d = saved.config.data
    tokenizer = None if d.source in MOCK_SOURCES else get_tokenizer(d.tokenizer)
    splits = data_lib.open_splits(d, tokenizer, vocab_size, saved.config.seed, progress=False)
    source = splits.val if splits.val is not None else splits.train
    return [place_batch(b, 1, mesh) for b in data_lib.validation_batches(source, d.global_batch_size, n)]


def _statistics(model, recipe, mesh, batches, seed: int) -> list:
    """The training probe's statistics with ``recipe`` on every layer, over the batches."""
    import jax

    import lp_jax
    from lp_jax.telemetry.probe import aggregate, as_numpy, instrument
    from lp_jax.telemetry.records import layer_rows
    from lp_jax.training.quant_stats import probe_step, scan_layers_for_probe
    from lp_jax.training.state import split_model

    lp_jax.apply_recipe(model, recipe)
    layout = instrument(model, recipe)
    scan_layers_for_probe(model)
    graphdef, params, rest = split_model(model)
    rng = jax.random.key_data(jax.random.key(seed))
    per_batch = [as_numpy(probe_step(graphdef, layout, mesh, params, rest, b, rng, i))
                 for i, b in enumerate(batches)]
    return layer_rows(layout, aggregate(per_batch))


def _loss_of_mask(model, recipe, mesh, batches):
    import jax
    import jax.numpy as jnp

    from lp_jax.training.quant_stats import scan_layers_for_probe
    from lp_jax.training.state import split_model
    from lp_jax.training.step import forward_nll

    num_layers = sens_lib.make_selectable(model, recipe)
    scan_layers_for_probe(model)  # one traced layer body for a uniform stack
    graphdef, params, rest = split_model(model)
    key = jax.random.key(0)  # the forward draws no random bits; a fixed scope all the same

    @jax.jit
    def nll(params, rest, batch, mask):
        with sens_lib.quantized_layers(mask):
            micro = jax.tree.map(lambda a: a[0], batch)
            return forward_nll(graphdef, params, rest, micro, key, mesh)

    def loss_of_mask(mask) -> float:
        total = count = 0.0
        for batch in batches:
            b_nll, b_count = nll(params, rest, batch, jnp.asarray(mask))
            total, count = total + float(b_nll), count + float(b_count)
        return total / max(count, 1.0)

    return loss_of_mask, num_layers


def inspect_run(run_dir: str, recipe: str | None = None, batches: int = 4, budget: float = 0.5,
                hf: str | None = None, write: bool = True) -> Inspection:
    import jax

    import lp_jax
    from lp_jax.parallel.mesh import make_mesh

    if batches < 1:
        raise UserError(f"--batches {batches}: must be at least 1")
    if budget < 0:
        raise UserError(f"--budget {budget}: must be >= 0 (percent)")
    if not os.path.isdir(run_dir):
        raise UserError(f"{run_dir}: no such folder")
    if recipe is not None:  # a misspelt name fails before the checkpoint is read
        try:
            lp_jax.get_recipe(recipe)
        except ValueError as e:
            raise UserError(f"--recipe: {' '.join(str(e).split())}") from None
    saved, model, source = _model(run_dir, hf)
    chosen = _recipe(saved, recipe)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    data = _batches(saved, model.config.vocab_size, batches, mesh)
    graphdef_state = _split(model)
    rows = _statistics(_merge(graphdef_state), chosen, mesh, data, saved.config.seed)
    loss_of_mask, num_layers = _loss_of_mask(_merge(graphdef_state), chosen, mesh, data)
    sensitivity = sens_lib.measure(loss_of_mask, num_layers)
    proposal = sens_lib.propose(sensitivity, loss_of_mask, budget)
    result = Inspection(run_dir, source, chosen, batches, rows, sensitivity, proposal, budget, None)
    if write:
        from lp_jax.inspect.report import write_files

        write_files(result)
    return result


def _split(model):
    from flax import nnx

    return nnx.split(model)


def _merge(graphdef_state):
    from flax import nnx

    return nnx.merge(*graphdef_state)  # a fresh copy of the modules, sharing the arrays


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lp_jax.inspect",
        description="Per-layer quantization statistics and sensitivity of a trained run, and "
                    "the layers to keep in BF16 (docs/telemetry.md).")
    parser.add_argument("run_dir", help="a training run folder (config.yaml, checkpoints/)")
    parser.add_argument("--recipe", default=None,
                        help="fp8_cs | mxfp8 | nvfp4 (default: the run's own recipe)")
    parser.add_argument("--batches", type=int, default=4,
                        help="batches of the run's data to measure on (default 4)")
    parser.add_argument("--budget", type=float, default=0.5,
                        help="allowed loss increase over all-BF16, in percent (default 0.5)")
    parser.add_argument("--hf", default=None, help="a Hugging Face Llama folder: its weights "
                        "instead of the run's latest checkpoint")
    args = parser.parse_args(argv)

    try:
        result = inspect_run(args.run_dir, args.recipe, args.batches, args.budget, args.hf)
    except UserError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    from lp_jax.inspect.report import console

    print(console(result))
    return 0
