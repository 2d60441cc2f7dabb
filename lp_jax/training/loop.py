"""The training run: build or restore, step, log, validate, checkpoint, stop cleanly.

Steps are numbered from 1; the checkpoint of step N holds the state after N steps and
the data iterator positioned at batch N + 1. The run ends at ``steps``, or earlier at
``stop_at`` or on SIGTERM/SIGINT: the step in flight finishes, a checkpoint is written,
and re-running the same command continues as if nothing had happened (same batches,
same stochastic-rounding bits, same schedule).
"""
from __future__ import annotations

import dataclasses
import math
import pathlib
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lp_jax.training import data as data_lib
from lp_jax.training import metrics as metrics_lib
from lp_jax.training.checkpoint import Checkpointer, abstract_like
from lp_jax.training.config_io import changed_keys, dump_yaml, to_dict, with_defaults
from lp_jax.training.distributed import is_primary
from lp_jax.training.optimizer import OptimizerSpec, make_optimizer
from lp_jax.training.mesh import make_mesh
from lp_jax.training.partitioning import state_shardings
from lp_jax.training.state import abstract_state, init_state, place_batch, split_model
from lp_jax.training.step import StepSpec, eval_step, train_step
from lp_jax.training.validate import Plan


class NonFiniteLossError(RuntimeError):
    """optimizer.on_nonfinite=stop and a step's loss or gradient norm was not finite."""


@dataclasses.dataclass
class RunResult:
    step: int  # last step trained (the checkpointed one)
    loss: float | None  # loss of that step
    val_loss: float | None  # last validation loss measured
    nonfinite_steps: int
    stopped_early: bool  # stop_at or a signal ended the run before `steps`
    run_dir: str


class _StopSignal:
    """SIGTERM/SIGINT set a flag that the loop reads after each step (a second SIGINT
    interrupts at once, as usual)."""

    def __init__(self):
        self.received: str | None = None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def agree(self) -> None:
        """With several processes, every one stops if any received a signal (one collective
        per step), so they all save the same step and none waits for the others forever."""
        if jax.process_count() == 1:
            return
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(self.received is not None))
        if self.received is None and np.any(flags):
            self.received = "signal to another process"

    def _handle(self, signum, frame):
        if self.received and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def run(plan: Plan) -> RunResult:
    from models import llama

    import lp_jax

    cfg = plan.config
    primary = is_primary()  # process 0 writes the run folder's files and prints
    run_dir = pathlib.Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if primary:
        (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    mesh = make_mesh(plan.data_parallel, plan.fsdp, plan.tensor)
    spec = StepSpec(OptimizerSpec.from_config(cfg), plan.accum_steps, mesh)
    tx = make_optimizer(spec.optimizer)
    say = print if primary else (lambda *_: None)
    global_batch = cfg.data.global_batch_size

    ckpt = Checkpointer(cfg.checkpoint.dir or run_dir / "checkpoints", cfg.checkpoint.keep,
                        cfg.checkpoint.async_save)
    start = (ckpt.latest_step() if cfg.checkpoint.resume else None) or 0
    splits = data_lib.open_splits(cfg.data, plan.tokenizer, plan.model_config.vocab_size,
                                  cfg.seed, progress=cfg.logging.progress_bar)
    rows = data_lib.host_rows(mesh, global_batch, plan.accum_steps)  # None: this process reads all rows
    train_it = data_lib.train_iterator(splits.train, cfg.seed, global_batch,
                                       cfg.data.read_threads, rows=rows)
    val_data = None
    if splits.val is not None and cfg.logging.val_batches > 0:
        val_data = data_lib.validation_batches(splits.val, global_batch,
                                               cfg.logging.val_batches, rows=rows)

    def build_model():
        return llama.Llama(plan.model_config, rngs=nnx.Rngs(cfg.seed))

    def with_recipe(model, phase):
        report = lp_jax.apply_recipe(model, phase.recipe)
        say(str(report).splitlines()[0])
        if phase.recipe.quantized and not report.quantized:
            say(f"warning: the layer policy {phase.recipe.policy} leaves no Linear quantized")
        return split_model(model)[0]

    phase = plan.phase_at(start + 1)
    abstract_model = nnx.eval_shape(build_model)
    graphdef = with_recipe(abstract_model, phase)
    target = abstract_state(split_model(abstract_model), tx, cfg.seed)
    shardings = state_shardings(target, mesh)
    if start:
        state, meta = ckpt.restore(start, abstract_like(target, shardings), train_it)
        say(f"resumed from step {start} ({ckpt.directory})")
        changed = changed_keys(with_defaults(meta.get("config", {})), to_dict(cfg))
        if changed:
            say(f"warning: config differs from the checkpoint's in {', '.join(changed)}; "
                "the run will not match an uninterrupted one")
    else:
        state = init_state(build_model, tx, cfg.seed, shardings)
    state = jax.device_put(state, shardings)  # restored scalars may come back uncommitted
    say(f"data: {splits.description}; {plan.accum_steps} micro-batch(es) of "
        f"{global_batch // plan.accum_steps} sequences per step; mesh data={plan.data_parallel} "
        f"fsdp={plan.fsdp} tensor={plan.tensor} over {jax.device_count()} devices, "
        f"{jax.process_count()} process(es)")

    end = cfg.end_step
    if start >= end:
        say(f"nothing to train: the checkpoint is at step {start}, the run ends at {end}")
    device = jax.local_devices()[0]  # this process's (for memory stats and the platform)
    tokens_per_step = cfg.data.global_batch_size * cfg.data.seq_len
    flops_per_step = metrics_lib.flops_per_token(plan.model_config, cfg.data.seq_len) * tokens_per_step
    writer = (metrics_lib.MetricsWriter(run_dir, start, cfg.logging.tensorboard) if primary
              else _NoMetrics())
    progress = metrics_lib.Progress(cfg.steps, start, cfg.logging.progress_bar and primary)
    if primary:
        say = progress.write
    nan = set(cfg.debug.inject_nan_at_steps)
    result = RunResult(start, None, None, int(state["nonfinite_steps"]), False, str(run_dir))
    saved_step = start

    def save(step):
        nonlocal saved_step
        to_save = state
        if device.platform == "cpu":
            # CPU arrays may be shared zero-copy with the writer thread; the next step
            # donates them, so hand the asynchronous save its own copy.
            to_save = jax.tree.map(jnp.copy, state)
        ckpt.save(step, to_save, train_it, {"config": to_dict(cfg), "recipe": plan.phase_at(step).name,
                                            "jax": jax.__version__})
        saved_step = step

    try:
        with _StopSignal() as stop:
            for step in range(start + 1, end + 1):
                if plan.phase_at(step) is not phase:
                    phase = plan.phase_at(step)
                    model = nnx.merge(graphdef, state["params"], state["rest"])
                    graphdef = with_recipe(model, phase)
                    say(f"step {step}: precision -> {phase.name}")
                batch = place_batch(next(train_it), plan.accum_steps, mesh, global_batch)
                poison = jnp.float32(math.nan if step in nan else 1.0)
                t0 = time.perf_counter()
                state, m = train_step(graphdef, spec, state, batch, poison)
                m = jax.device_get(m)
                seconds = time.perf_counter() - t0
                loss = float(m["loss"])
                if not m["finite"]:
                    say(f"step {step}: non-finite loss {loss} or gradient norm "
                        f"{float(m['grad_norm'])}; update skipped")
                    if cfg.optimizer.on_nonfinite == "stop":
                        raise NonFiniteLossError(
                            f"step {step}: loss {loss}, gradient norm {float(m['grad_norm'])} "
                            f"(optimizer.on_nonfinite=stop); the last checkpoint (step "
                            f"{saved_step}) is untouched")
                tflops = flops_per_step / seconds / jax.device_count() / 1e12
                peak = metrics_lib.peak_tflops(device.device_kind, phase.recipe.name)
                values = {"loss": loss, "lr": float(m["lr"]), "grad_norm": float(m["grad_norm"]),
                          "tokens_per_sec": tokens_per_step / seconds,
                          "tflops_per_device": tflops, "step_time_s": seconds,
                          "nonfinite_steps": int(state["nonfinite_steps"])}
                if peak:
                    values["mfu"] = tflops / peak
                memory = metrics_lib.peak_memory_gib(device)
                if memory is not None:
                    values["peak_memory_gib"] = memory
                at_end = step == cfg.steps
                if val_data is not None and (at_end or (cfg.logging.val_every and
                                                        step % cfg.logging.val_every == 0)):
                    values["val_loss"] = result.val_loss = _validate(graphdef, spec, state, val_data,
                                                                     mesh, global_batch)
                if step % cfg.logging.every == 0 or "val_loss" in values or at_end:
                    writer.write(step, values)
                progress.update(values)
                result.step, result.loss = step, loss
                result.nonfinite_steps = values["nonfinite_steps"]
                stop.agree()  # a signal to any process stops all of them after the same step
                if stop.received or step == end or step % cfg.checkpoint.every == 0:
                    save(step)
                if stop.received:
                    say(f"{stop.received}: stopped after step {step}; checkpoint saved, "
                        "re-run the same command to resume")
                    break
        result.stopped_early = result.step < cfg.steps
        if result.stopped_early and not stop.received and start < end:
            say(f"stop_at={cfg.stop_at}: stopped after step {result.step}; checkpoint saved")
    finally:
        progress.close()
        writer.close()
        ckpt.close()
    return result


class _NoMetrics:
    """The metrics sink of processes other than 0 (one writer per run folder)."""

    def write(self, step, values) -> None:
        pass

    def close(self) -> None:
        pass


def _validate(graphdef, spec, state, batches, mesh, global_batch) -> float:
    nll = count = 0.0
    for batch in batches:
        placed = place_batch(batch, spec.accum_steps, mesh, global_batch)
        b_nll, b_count = eval_step(graphdef, spec, state, placed)
        nll, count = nll + float(b_nll), count + float(b_count)
    return nll / max(count, 1.0)
