"""The training run: build or restore, step, log, validate, checkpoint, stop cleanly.

Steps are numbered from 1; the checkpoint of step N holds the state after N steps and
the data iterator positioned at batch N + 1. The run ends at ``steps``, or earlier at
``stop_at`` or on SIGTERM/SIGINT: the step in flight finishes, a checkpoint is written,
and re-running the same command continues as if nothing had happened (same batches,
same stochastic-rounding bits, same schedule).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

import lp_jax
from lp_jax import model_registry
from lp_jax.config.schema import MeshConfig
from lp_jax.config.yaml_io import changed_keys, dump_yaml, to_dict, with_defaults
from lp_jax.data import pipeline as data_lib
from lp_jax.data.fingerprint import changes as data_changes, fingerprint as data_fingerprint
from lp_jax.errors import RunStoppedError, UserError
from lp_jax.parallel.distributed import is_primary
from lp_jax.parallel.expert_dispatch import fp8_dispatch, set_expert_dispatch
from lp_jax.parallel.linear_layout import LinearLayout
from lp_jax.parallel.mesh import make_mesh
from lp_jax.runs import init_weights
from lp_jax.runs.checkpoint import DAMAGED_SUFFIX, Checkpointer, CheckpointWriteError, abstract_like
from lp_jax.runs.run_lock import FolderLocks, RunFolderLostError
from lp_jax.training import metrics as metrics_lib
from lp_jax.training.optimizer import make_optimizer
from lp_jax.training.projection_layout import conversion_message, restore_in_saved_layout
from lp_jax.training.quant_stats import QuantStatsProbe
from lp_jax.training.state import abstract_state, init_state, place_batch, split_model
from lp_jax.training.state_memory import check_state_fits, out_of_memory
from lp_jax.training.step import StepSpec, eval_step, jitted_train_step
from lp_jax.training.stop_signal import StopSignal
from lp_jax.training.validate import Phase, ValidatedRun, checkpoint_dir, model_shape_changes
from models.config import config_to_dict
from models.files import file_written_whole


class NonFiniteLossError(RunStoppedError):
    """A step's loss or gradient norm was not finite and optimizer.on_nonfinite=stop, or
    optimizer.max_nonfinite_in_a_row such steps came in a row."""


@dataclasses.dataclass
class RunResult:
    step: int  # last step trained (the checkpointed one)
    loss: float | None  # loss of that step
    val_loss: float | None  # last validation loss measured
    nonfinite_steps: int
    stopped_early: bool  # stop_at or a signal ended the run before `steps`
    run_dir: str
    preempted_by: str | None = None  # the signal that stopped the run before its end


class _Console:
    """Messages of process 0: printed until the progress bar starts, then written through
    it so that they do not break the bar; the other processes say nothing."""

    def __init__(self, primary: bool):
        self.primary = primary
        self._progress = None

    def attach(self, progress: metrics_lib.Progress) -> None:
        self._progress = progress

    def __call__(self, message: str) -> None:
        if not self.primary:
            return
        if self._progress is None:
            print(message)
        else:
            self._progress.write(message)


@dataclasses.dataclass
class _Run:
    """What a run holds from one step to the next (``build`` makes it)."""

    plan: ValidatedRun
    say: _Console
    mesh: jax.sharding.Mesh
    spec: StepSpec
    step_fn: Any  # the jitted train step, built once for this state's structure
    train_it: Any
    val_data: list | None
    ckpt: Checkpointer
    phase: Phase
    graphdef: nnx.GraphDef
    state: dict
    start: int
    writer: metrics_lib.MetricsWriter
    progress: metrics_lib.Progress
    device: jax.Device  # this process's first device (memory stats, platform, peak table)
    saved_step: int
    lock: FolderLocks | None  # process 0's locks on the run and checkpoint folders
    quant_stats: QuantStatsProbe | None = None  # logging.quant_stats_every > 0
    data_fingerprint: dict | None = None  # what the run reads, saved with each checkpoint

    def close(self, failing: bool) -> None:
        try:
            self.progress.close()
            self.writer.close()
            if self.quant_stats is not None:
                self.quant_stats.close()
            try:
                self.ckpt.close()  # waits for an asynchronous save in flight
            except CheckpointWriteError:
                if not failing:  # the error that is already on its way says more
                    raise
        finally:
            if self.lock is not None:
                self.lock.release()


def build(plan: ValidatedRun) -> _Run:
    """Everything before step 1: data (checked first, so a bad file leaves no run folder
    behind), the run folder, the checkpointer, the state (restored or fresh), the step."""
    cfg = plan.config
    primary = is_primary()  # process 0 writes the run folder's files and prints
    say = _Console(primary)
    mesh = make_mesh(plan.data_parallel, plan.fsdp, plan.tensor, plan.expert)
    spec = StepSpec.from_plan(plan, mesh)
    tx = make_optimizer(spec.optimizer)
    global_batch = cfg.data.global_batch_size

    splits = data_lib.open_splits(cfg.data, plan.tokenizer, plan.model_config.vocab_size,
                                  cfg.seed, progress=cfg.logging.progress_bar)
    rows = data_lib.host_rows(mesh, global_batch, plan.accum_steps)  # None: this process reads all rows
    train_it = data_lib.train_iterator(splits.train, cfg.seed, global_batch,
                                       cfg.data.read_threads, rows=rows)
    reads = data_fingerprint(cfg.data, plan.tokenizer, cfg.seed, splits.files)
    val_data = None
    if splits.val is not None and cfg.logging.val_batches > 0:
        val_data = data_lib.validation_batches(splits.val, global_batch,
                                               cfg.logging.val_batches, rows=rows)

    def build_model():
        return model_registry.build_model(cfg.model.type, plan.model_config, nnx.Rngs(cfg.seed))

    # The state tree does not depend on the recipe, so the restore target is built before
    # the resumed step (and so its recipe) is known.
    abstract_model = nnx.eval_shape(build_model)
    target = abstract_state(split_model(abstract_model), tx, cfg.seed)
    shardings = spec.state_shardings(target)
    check_state_fits(target, shardings, f"model.preset={cfg.model.preset}")

    def target_in_layout(fused: bool):
        """The restore target of a state saved with the other projection layout."""
        model_config = plan.model_config.replace(fused_projections=fused)
        other = abstract_state(split_model(nnx.eval_shape(lambda: model_registry.build_model(
            cfg.model.type, model_config, nnx.Rngs(cfg.seed)))), tx, cfg.seed)
        return abstract_like(other, spec.state_shardings(other))

    # Resolved once, symbolic links and `..` as the kernel takes them, so that config,
    # metrics and checkpoints land where every reader (checkpoint_folder) looks.
    run_dir = pathlib.Path(os.path.realpath(cfg.run_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_dir = checkpoint_dir(cfg)  # made by _lock, once the run folder is locked
    with contextlib.ExitStack() as undo:  # what is opened is closed again if build fails
        lock = _lock(run_dir, ckpt_dir, primary, say)  # before the folders get anything else
        if lock is not None:
            undo.callback(lock.release)
        ckpt = Checkpointer(ckpt_dir, cfg.checkpoint.keep, cfg.checkpoint.async_save)
        undo.callback(ckpt.close)
        start, state = (_resume(plan, ckpt, abstract_like(target, shardings), train_it, say,
                                target_in_layout, reads) if cfg.checkpoint.resume else (0, None))
        if primary:
            # Once the resume is settled: a run refused for another model leaves the config.yaml
            # that describes the checkpoints beside it (eval.py builds the model from it).
            # Written beside and renamed over: a link named config.yaml is replaced, never
            # written through.
            with file_written_whole(run_dir / "config.yaml") as f:
                f.write(dump_yaml(cfg))
        if state is None:
            state = init_state(build_model, tx, cfg.seed, shardings)
            state = init_weights.load(plan, state, say)  # init.hf / init.checkpoint, if set
        state = jax.device_put(state, shardings)  # restored scalars may come back uncommitted
        phase = plan.phase_at(start + 1)
        graphdef = _with_recipe(abstract_model, phase, say, mesh, cfg.mesh,
                                (cfg.data.micro_batch_size, cfg.data.seq_len))
        say(f"data: {splits.description}; {plan.accum_steps} micro-batch(es) of "
            f"{global_batch // plan.accum_steps} sequences per step; mesh data={plan.data_parallel} "
            f"fsdp={plan.fsdp} expert={plan.expert} tensor={plan.tensor} over {jax.device_count()} devices, "
            f"{jax.process_count()} process(es)")
        if start >= cfg.end_step:
            say(f"nothing to train: the checkpoint is at step {start}, the run ends at {cfg.end_step}")

        writer = (metrics_lib.MetricsWriter(run_dir, start, cfg.logging.tensorboard) if primary
                  else _NoMetrics())
        progress = metrics_lib.Progress(cfg.steps, start, cfg.logging.progress_bar and primary)
        say.attach(progress)
        every = cfg.logging.quant_stats_every
        quant_stats = (QuantStatsProbe(run_dir, start, every, cfg.logging.tensorboard, primary)
                       if every else None)
        built = _Run(plan, say, mesh, spec, jitted_train_step(spec, state), train_it, val_data, ckpt,
                     phase, graphdef, state, start, writer, progress, jax.local_devices()[0],
                     saved_step=start, lock=lock, quant_stats=quant_stats,
                     data_fingerprint=reads)
        undo.pop_all()  # built: the run's close() releases them from here on
        return built


def _lock(run_dir: pathlib.Path, ckpt_dir: str, primary: bool, say) -> FolderLocks | None:
    """Process 0's locks on the run folder and the checkpoint folder (two jobs sharing
    either would overwrite each other's files); with several processes, all of them refuse
    together when one is held by another job (so none waits at a collective)."""
    lock, refusal = None, None
    if primary:
        try:
            lock = FolderLocks([("run_dir", run_dir), ("checkpoint.dir", ckpt_dir)], say, run_dir)
        except UserError as e:
            refusal = e
    if jax.process_count() > 1:
        held = multihost_utils.process_allgather(np.int32(refusal is not None))
        if refusal is None and np.any(held):
            refusal = UserError(f"run_dir {str(run_dir)!r} or its checkpoint folder is in use "
                                "by another job (process 0 says by which)")
    if refusal is not None:  # only process 0 takes the lock: a refusal means it holds none
        raise refusal
    return lock


def _resume(plan: ValidatedRun, ckpt: Checkpointer, target, train_it, say,
            target_in_layout, reads: dict) -> tuple[int, dict | None]:
    """(step, state) of the newest checkpoint that restores, or (0, None) when there is
    none yet; a folder whose checkpoints all fail, that holds another model, or whose
    checkpoint was trained on other data or another tokenizer than ``reads`` (the run's
    data fingerprint) is a UserError (one line naming it), never a fresh start over the
    user's checkpoints. A checkpoint of the other projection layout is converted
    (``target_in_layout(fused)`` is the target it restores into)."""
    cfg = plan.config

    def same_model_and_stream(step, meta):
        changes = model_shape_changes(meta.get("config", {}), plan)
        if changes:
            raise UserError(
                f"checkpoint {step} in {ckpt.directory!r} is of another model: "
                f"{', '.join(changes)}; model keys cannot change on resume (precision, mesh "
                "and schedule can): use another run_dir for this model")
        saved_len = _saved_data(meta).get("seq_len", cfg.data.seq_len)
        if saved_len != cfg.data.seq_len:
            # Another length cuts the text into other sequences, shuffled in another order:
            # no position in the new stream is where the run left off.
            raise UserError(
                f"checkpoint {step} in {ckpt.directory!r} was trained at data.seq_len={saved_len}, "
                f"now {cfg.data.seq_len}: the data stream cannot resume at another sequence "
                "length (data.global_batch_size can change); use another run_dir, or "
                "init.checkpoint to start a new run from these weights")
        _check_same_data(step, meta, reads, cfg, ckpt.directory)

    found = ckpt.restore_newest(target, train_it, check=same_model_and_stream,
                                zero_if_missing=("nonfinite_in_a_row",),
                                saved_as=restore_in_saved_layout(plan.model_config, target,
                                                                 target_in_layout))
    for step, why in found.skipped:
        say(f"warning: checkpoint {step} in {ckpt.directory} cannot be restored ({why})"
            + (f"; set aside as {step}{DAMAGED_SUFFIX}" if found.step is not None else ""))
    if found.step is None:
        if found.skipped:
            raise UserError(f"checkpoint.dir: no checkpoint in {ckpt.directory!r} can be "
                            f"restored (steps {', '.join(str(s) for s, _ in found.skipped)}); "
                            "move the folder aside to start afresh")
        return 0, None
    say(f"resumed from step {found.step} ({ckpt.directory})")
    converted = conversion_message(found.step, found.meta, plan.model_config)
    if converted:
        say(converted)
    _check_batch_change(found, cfg, train_it, say)
    _say_data_changes(found, reads, train_it, say)
    changed = changed_keys(with_defaults(found.meta.get("config", {})), to_dict(cfg))
    if changed:
        say(f"warning: config differs from the checkpoint's in {', '.join(changed)}; "
            "the run will not match an uninterrupted one")
    return found.step, found.state


def _check_same_data(step: int, meta: dict, reads: dict, cfg, directory: str) -> None:
    """A checkpoint trained on other data or another tokenizer (its data fingerprint, see
    lp_jax/data/fingerprint.py) is refused, unless data.allow_changed: its position in
    the stream, counted in sequences, would point at other sequences of the new data."""
    saved = meta.get("data_fingerprint")
    if not isinstance(saved, dict) or cfg.data.allow_changed:
        return
    changed = data_changes(saved, reads)
    if changed:
        raise UserError(
            f"checkpoint {step} in {directory!r} was trained on other data: {'; '.join(changed)}; "
            "its data position would read sequences twice or never: restore the data and "
            "tokenizer, use another run_dir (init.checkpoint starts a new run from these "
            "weights), or set data.allow_changed=true to go on at the same position of the "
            "new data's stream")


def _say_data_changes(found, reads: dict, train_it, say) -> None:
    """The line a resume says about its data: nothing when it matches the checkpoint's."""
    saved = found.meta.get("data_fingerprint")
    if not isinstance(saved, dict):
        say(f"note: checkpoint {found.step} records no data fingerprint (saved before "
            "checkpoints did), so a change of data or tokenizer since cannot be detected")
        return
    changed = data_changes(saved, reads)
    if changed:  # only with data.allow_changed=true: _check_same_data refuses it otherwise
        say(f"warning: data.allow_changed=true: {'; '.join(changed)}; the stream goes on at "
            f"sequence {train_it.sequences_read} of the new data's order, so some sequences "
            "are read twice and others never")


def _saved_data(meta: dict) -> dict:
    """The data section of the config a checkpoint was saved with ({} if it has none)."""
    return (meta.get("config") or {}).get("data") or {}


def _check_batch_change(found, cfg, train_it, say) -> None:
    """A changed data.global_batch_size resumes at the next sequence of the stream (the
    data position is counted in sequences), said in one line; a checkpoint whose position
    is a batch index (written before positions were sequences) cannot say where that is."""
    saved = _saved_data(found.meta).get("global_batch_size")
    now = cfg.data.global_batch_size
    if saved is None or saved == now:
        return
    if train_it.legacy_state:
        raise UserError(
            f"checkpoint {found.step} counts its data position in batches of {saved}; "
            f"resume it with data.global_batch_size={saved}, then change the batch size at a "
            "later checkpoint")
    say(f"data.global_batch_size {saved} -> {now}: the data stream goes on at sequence "
        f"{train_it.sequences_read} (nothing skipped or read twice)")


def _with_recipe(model: nnx.Module, phase: Phase, say, mesh: jax.sharding.Mesh,
                 mesh_config: MeshConfig, tokens_shape: tuple[int, int]) -> nnx.GraphDef:
    """Applies the phase's recipe to the model in place (with FSDP gathers of quantized
    bytes where precision.param_gather says so, tensor-parallel reductions in
    mesh.tp_reduce_dtype, the expert-parallel dispatch in mesh.ep_dispatch_dtype) and
    returns its graphdef."""
    layout = LinearLayout(dict(mesh.shape), mesh_config.tp_reduce_dtype)
    report = lp_jax.apply_recipe(model, phase.recipe, layout=layout)
    say(str(report).splitlines()[0])
    # Validation refused fp8 without expert-parallel ranks (mesh_checks.check_dispatch).
    if set_expert_dispatch(model, phase.recipe, mesh_config.ep_dispatch_dtype) and \
            mesh_config.ep_dispatch_dtype == "fp8":
        fmt = fp8_dispatch(phase.recipe).fmt
        say(f"mesh.ep_dispatch_dtype=fp8: the MoE layers dispatch their rows in {fmt}")
    for path, linen in report.bridged.items():
        # A bridged Linen model's GEMMs are known once it runs: trace one call (no FLOPs), so
        # its plan is made (and bad rules refused) before the first step, and say it.
        nnx.eval_shape(lambda m: m(jnp.zeros(tokens_shape, jnp.int32)), model)
        say(f"{path} (Linen): {str(lp_jax.linen_report(linen)).splitlines()[0]}")
    if report.gathered:
        say(f"precision.param_gather: {len(report.gathered)} Linears all-gather their quantized weight bytes over fsdp")
    if report.tensor_reduced:
        say(f"mesh.tp_reduce_dtype=bf16: {len(report.tensor_reduced)} Linears reduce their tensor-parallel "
            "partial sums in BF16")
    if phase.recipe.quantized and not report.quantized and not report.bridged:
        say(f"warning: the layer policy {phase.recipe.policy} leaves no Linear quantized")
    return split_model(model)[0]


def run(plan: ValidatedRun) -> RunResult:
    """Builds the run and trains it to its end; a first SIGINT/SIGTERM stops it after the
    step in flight (saved), a second interrupts it at once (``Interrupted``)."""
    with StopSignal() as stop:
        r = build(plan)
        stop.last_checkpoint = lambda: r.saved_step
        failing = True
        try:
            result = _train(r, stop)
            failing = False
        finally:
            r.close(failing)
    return result


def _train(r: _Run, stop: StopSignal) -> RunResult:
    cfg = r.plan.config
    end = cfg.end_step
    result = RunResult(r.start, None, None, int(r.state["nonfinite_steps"]), False,
                       str(pathlib.Path(cfg.run_dir)))
    for step in range(r.start + 1, end + 1):
        values = _train_one_step(r, step)
        stop.check()
        if r.val_data is not None and _validation_due(cfg, step):
            values["val_loss"], stderr = _validate(r)
            result.val_loss = values["val_loss"]
            if stderr is not None:
                values["val_loss_stderr"] = stderr
        _record(r, step, values)
        result.step, result.loss = step, values["loss"]
        result.nonfinite_steps = values["nonfinite_steps"]
        # A signal to any process stops all of them after the same step.
        lost = r.lock.lost() if r.lock is not None else None  # the RunLock whose file went
        if stop.agree(folder_lost=lost is not None):
            if lost is not None and lost.key != "run_dir":
                raise RunFolderLostError(os.path.dirname(lost.path), "checkpoint folder")
            raise RunFolderLostError(cfg.run_dir)
        stop.check()  # never save once a second signal came
        # A step whose update was skipped is no step to resume from: the periodic save
        # waits for a finite one, so a rerun after a stop on the streak replays it whole.
        # The last save (end, stop_at, signal) is written anyway: the state holds the
        # streak, and the resume goes on counting it.
        periodic = step % cfg.checkpoint.every == 0 and not int(r.state["nonfinite_in_a_row"])
        if stop.received or step == end or periodic:
            _save(r, step)
        if stop.received:
            r.say(f"{stop.received}: stopped after step {step}; checkpoint saved, "
                  "re-run the same command to resume (a second signal interrupts at once)")
            if step < end:  # a signal on the last step found the run finished
                result.preempted_by = stop.received
            break
    result.stopped_early = result.step < cfg.steps
    if result.stopped_early and not stop.received and r.start < end:
        r.say(f"stop_at={cfg.stop_at}: stopped after step {result.step}; checkpoint saved")
    return result


def _train_one_step(r: _Run, step: int) -> dict:
    """Trains ``step`` and returns its metrics; NonFiniteLossError when the non-finite
    guard says stop."""
    cfg = r.plan.config
    if r.plan.phase_at(step) is not r.phase:
        r.phase = r.plan.phase_at(step)
        model = nnx.merge(r.graphdef, r.state["params"], r.state["rest"])
        r.graphdef = _with_recipe(model, r.phase, r.say, r.mesh, cfg.mesh,
                                  (cfg.data.micro_batch_size, cfg.data.seq_len))
        r.say(f"step {step}: precision -> {r.phase.name}")
    host = next(r.train_it)
    if step in cfg.debug.inject_nan_at_steps:
        host = _out_of_vocabulary(host, r.plan.model_config.vocab_size)
    batch = place_batch(host, r.plan.accum_steps, r.mesh, cfg.data.global_batch_size)
    if r.quant_stats is not None and r.quant_stats.due(step):  # a separate probe, not timed
        r.quant_stats.measure(step, r.graphdef, r.phase.recipe, r.mesh, r.state, batch)
    t0 = time.perf_counter()
    try:
        r.state, m = r.step_fn(r.graphdef, r.spec, r.state, batch)
        m = jax.device_get(m)
    except jax.errors.JaxRuntimeError as e:
        oom = out_of_memory(e, f"step {step}")
        if oom is None:
            raise
        raise oom from None
    seconds = time.perf_counter() - t0
    _guard_nonfinite(r, step, m)
    tokens_per_step = cfg.data.global_batch_size * cfg.data.seq_len
    flops = model_registry.flops_per_token(cfg.model.type, r.plan.model_config, cfg.data.seq_len) * tokens_per_step
    tflops = flops / seconds / jax.device_count() / 1e12
    values = {"loss": float(m["loss"]), "lr": float(m["lr"]), "grad_norm": float(m["grad_norm"]),
              "tokens_per_sec": tokens_per_step / seconds, "tflops_per_device": tflops,
              "step_time_s": seconds, "nonfinite_steps": int(r.state["nonfinite_steps"])}
    values.update({k: float(v) for k, v in m["extras"].items()})  # the model's extra_metrics
    peak = metrics_lib.peak_tflops(r.device.device_kind, r.phase.recipe.name)
    if peak:
        values["mfu"] = tflops / peak
    memory = metrics_lib.peak_memory_gib(r.device)
    if memory is not None:
        values["peak_memory_gib"] = memory
    return values


def _out_of_vocabulary(batch: dict, vocab_size: int) -> dict:
    """debug.inject_nan_at_steps: inputs that are an id with no embedding row, as a shard
    from another tokenizer would feed them. The lookup fills such rows with NaN
    (jnp.take), so loss and gradients are NaN and the guard is tried end to end on the
    production step, with no test-only argument in it."""
    return dict(batch, tokens=np.full_like(batch["tokens"], vocab_size))


def _guard_nonfinite(r: _Run, step: int, m: dict) -> None:
    if m["finite"]:
        return
    loss, norm = float(m["loss"]), float(m["grad_norm"])
    what = (f"zero gradient norm at loss {loss:.6g} (activations overflowed: every token equally "
            "likely)" if norm == 0 else f"non-finite loss {loss} or gradient norm {norm}")
    r.say(f"step {step}: {what}; update skipped")
    untouched = (f"the last checkpoint (step {r.saved_step}) is untouched" if r.saved_step
                 else "no checkpoint was written")
    o = r.plan.config.optimizer
    if o.on_nonfinite == "stop":
        raise NonFiniteLossError(f"step {step}: loss {loss}, gradient norm {norm} "
                                 f"(optimizer.on_nonfinite=stop); {untouched}")
    n = int(r.state["nonfinite_in_a_row"])  # checkpointed: a resume goes on counting
    if o.max_nonfinite_in_a_row and n >= o.max_nonfinite_in_a_row:
        raise NonFiniteLossError(
            f"steps {step - n + 1}-{step}: {n} non-finite steps in a row "
            f"(optimizer.max_nonfinite_in_a_row={o.max_nonfinite_in_a_row}), so nothing is "
            f"being learned: the data or the weights are broken; {untouched}")


def _validation_due(cfg, step: int) -> bool:
    every = cfg.logging.val_every
    return step == cfg.steps or bool(every and step % every == 0)


def _record(r: _Run, step: int, values: dict) -> None:
    cfg = r.plan.config
    if step % cfg.logging.every == 0 or "val_loss" in values or step == cfg.steps:
        r.writer.write(step, values)
    r.progress.update(values)


def _save(r: _Run, step: int) -> None:
    to_save = r.state
    if r.device.platform == "cpu":
        # CPU arrays may be shared zero-copy with the writer thread; the next step
        # donates them, so hand the asynchronous save its own copy.
        to_save = jax.tree.map(jnp.copy, r.state)
    r.ckpt.save(step, to_save, r.train_it, {"config": to_dict(r.plan.config),
                                            "recipe": r.plan.phase_at(step).name,
                                            "model": config_to_dict(r.plan.model_config),
                                            "data_fingerprint": r.data_fingerprint,
                                            "jax": jax.__version__})
    r.saved_step = step


class _NoMetrics:
    """The metrics sink of processes other than 0 (one writer per run folder)."""

    def write(self, step, values) -> None:
        pass

    def close(self) -> None:
        pass


def _validate(r: _Run) -> tuple[float, float | None]:
    """(mean NLL per token over the validation batches, its standard error).

    The standard error treats the batches' own means as the samples (their spread over
    sqrt(batches)): how much the estimate would move with other held-out text of the same
    size, which says whether a gap between two runs is larger than the validation set can
    resolve. None with a single batch."""
    nll = count = 0.0
    means = []
    for batch in r.val_data:
        placed = place_batch(batch, r.spec.accum_steps, r.mesh, r.plan.config.data.global_batch_size)
        b_nll, b_count = eval_step(r.graphdef, r.spec, r.state, placed)
        nll, count = nll + float(b_nll), count + float(b_count)
        means.append(float(b_nll) / max(float(b_count), 1.0))
    stderr = float(np.std(means, ddof=1) / np.sqrt(len(means))) if len(means) > 1 else None
    return nll / max(count, 1.0), stderr
