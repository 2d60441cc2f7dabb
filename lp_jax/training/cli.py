"""The command line behind train.py: bad input (the config, or the data, folders and
checkpoints it names) exits 2 with one line, never a traceback; a run that has to stop
(non-finite steps, a checkpoint or metrics file that cannot be written, the run folder
gone) exits 1 with one line; a first SIGINT/SIGTERM saves and exits
checkpoint.preempted_exit_code (75) for a scheduler to requeue the run; a second interrupts
at once and exits 130 with one line. In a multi-process run, a process that dies ends the
others, each with one line naming it, exiting checkpoint.preempted_exit_code too
(lp_jax.parallel.peer_watch)."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from lp_jax.config.yaml_io import dump_yaml, load_config
from lp_jax.errors import RunStoppedError, UserError

EXIT_CONFIG_ERROR = 2  # bad input: the config, or the files and folders it names
EXIT_STOPPED = 1  # the run stopped before its end: non-finite steps, a checkpoint not written
DEFAULT_CONFIG = "configs/tiny.yaml"


def find_config(path: str) -> str:
    """A config path as given, else relative to the repository (train.py's folder)."""
    if os.path.exists(path):
        return path
    beside = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), path)
    return beside if os.path.exists(beside) else path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="train.py",
        description="Pretrain a Llama in BF16, FP8-CS, MXFP8 or NVFP4. Re-running the same "
                    "command resumes from the run's latest checkpoint.",
        epilog="Overrides are dotted keys, e.g. steps=20 precision=nvfp4 "
               "precision.last_bf16_layers=1 optimizer.b2=0.99 (docs/training.md lists them all).")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help=f"YAML run config (default {DEFAULT_CONFIG})")
    parser.add_argument("--check", action="store_true",
                        help="validate the config, print it resolved, and exit without training")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    peers = _Peers()
    try:
        return _main(args, peers)
    finally:
        if peers.watch is not None:
            peers.watch.bye()  # this process ends deliberately: the others do not report it


class _Peers:
    """The peer watch of a multi-process run (lp_jax.parallel.peer_watch), once started."""
    watch = None


def _main(args: argparse.Namespace, peers: _Peers) -> int:
    try:
        config = load_config(find_config(args.config), args.overrides)
        from lp_jax.parallel.distributed import maybe_initialize, watch_peers
        from lp_jax.training.validate import resolve

        if maybe_initialize(config.distributed):  # before JAX counts the devices
            peers.watch = watch_peers(config.checkpoint.preempted_exit_code)

        plan = resolve(config)
    except UserError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if args.check:
        print(dump_yaml(config), end="")
        print(f"# ok: {plan.model_config.num_layers} layers, vocab {plan.model_config.vocab_size}, "
              f"{plan.accum_steps} micro-batch(es) per step, mesh data={plan.data_parallel} "
              f"fsdp={plan.fsdp} expert={plan.expert} tensor={plan.tensor}, recipes "
              f"{', '.join(f'{p.name} {p.recipe.policy} from step {p.from_step}' for p in plan.phases)}")
        return 0
    from lp_jax.training.loop import run
    from lp_jax.training.stop_signal import EXIT_INTERRUPTED, Interrupted

    try:
        try:
            result = run(plan)
        except Exception as e:
            if peers.watch is not None and not isinstance(e, UserError):
                peers.watch.settle()  # a collective that failed because a process died
            raise
    except UserError as e:  # found once the run opens its data and checkpoints
        print(f"train.py: error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except Interrupted as e:
        e.say()
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:  # before the run installed its handlers
        print("train.py: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except RunStoppedError as e:
        print(f"train.py: stopped: {e}", file=sys.stderr)
        return EXIT_STOPPED
    val = f", val_loss {result.val_loss:.4f}" if result.val_loss is not None else ""
    loss = f"loss {result.loss:.4f}" if result.loss is not None else "nothing left to train"
    print(f"step {result.step}/{config.steps}: {loss}{val}; "
          f"{result.nonfinite_steps} non-finite step(s) skipped; run folder {result.run_dir}")
    if result.preempted_by:  # saved, not finished: exit-code-based requeues must run it again
        return config.checkpoint.preempted_exit_code
    return 0
