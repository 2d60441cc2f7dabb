"""Orbax checkpoints of a whole run: model, optimizer, step, RNG and data iterator together.

One checkpoint is a Composite of ``state`` (the train-state tree, the same for every
precision recipe), ``data`` (grain's iterator state, one file per process) and ``meta``
(JSON: the config, the recipe in force, the model). Restores go into an abstract target,
whose shardings may come from another mesh or process count; every process calls save and
restore. A save that cannot be written is a ``CheckpointWriteError`` at once; a resume
takes the newest checkpoint that restores completely (``restore_newest``) and sets newer
damaged ones aside (docs/training.md, "Checkpoints"; docs/scaling.md, "Several hosts").
"""
from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import pathlib
import shutil
from typing import Any, Callable

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from lp_jax.errors import RunStoppedError, one_line
from lp_jax.runs.writable import write_problem
from models.files import os_reason
from models.orbax_quiet import (
    SaveThreadErrorsHushed,
    abandoned_reads_hushed,
    failed_writes_hushed,
    orbax_logs,
)


class PoisonedStateError(RuntimeError):
    """Raised instead of writing a checkpoint whose parameters or moments are not finite."""


class CheckpointWriteError(RunStoppedError):
    """A checkpoint could not be written (the folder went away, turned read-only, filled
    up). The message is one line; the checkpoints written before it are untouched."""


DAMAGED_SUFFIX = ".damaged"


@jax.jit
def _all_finite(tree) -> jax.Array:
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    if not leaves:
        return jnp.array(True)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


class Checkpointer:
    """A CheckpointManager over ``directory`` keeping the last ``keep`` checkpoints."""

    def __init__(self, directory: str | os.PathLike, keep: int, async_save: bool = True):
        self._ocp = ocp
        # Step folders are made before save() returns: made in the background, a folder
        # that cannot be made leaves the writer waiting for a signal that never comes.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save,
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
        # Resolved as the kernel does (links, then ".."), as checkpoint_folder names it for
        # the readers; a textual abspath would put "L/../r" elsewhere when L is a link.
        self.directory = os.path.realpath(directory)
        self._pending = None  # the step of an asynchronous save that may still be writing
        self._abandoned = False  # an interrupt cut a save (or the wait for one) short
        # A save that fails in Orbax's background threads is logged there, tracebacks and
        # all, several times over; the error this class raises for it says it once.
        self._hush = SaveThreadErrorsHushed()
        with orbax_logs(logging.ERROR):  # an empty step folder is reported by restore_newest
            self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, data_iterator: Any, meta: dict) -> None:
        """Saves (asynchronously if enabled); never a non-finite state."""
        if not bool(_all_finite(state)):
            raise PoisonedStateError(
                f"refusing to save step {step}: the train state holds NaN or inf "
                "(the non-finite-step guard should have prevented this)")
        problem = write_problem(self.directory)
        if problem:
            raise CheckpointWriteError(f"cannot save step {step}: {problem}")
        self.wait()  # an earlier save that failed is reported as that step's
        ocp = self._ocp
        items = {"state": ocp.args.StandardSave(state),
                 "meta": ocp.args.JsonSave(meta)}
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
        # force: our loop decides when to save (every N, end, stop_at, signals). Orbax
        # raises ValueError, OSError, TimeoutError or a bare Exception.
        try:
            self._pending = step
            with failed_writes_hushed():
                self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:
            raise self._write_error(e) from e
        except BaseException:  # a second signal's Interrupted, raised inside Orbax's save
            self._abandon()
            raise

    def restore(self, step: int, abstract_state: Any, data_iterator: Any,
                zero_if_missing: tuple[str, ...] = ()) -> tuple[Any, dict]:
        """(state, meta) of ``step``; the data iterator is restored in place.
        ``zero_if_missing``: entries of the state dict added after some checkpoints were
        written; a checkpoint without one restores it as zeros of the target's shape."""
        ocp = self._ocp
        full, missing = abstract_state, []
        if zero_if_missing:
            saved = ocp.StandardCheckpointHandler().metadata(
                pathlib.Path(self.directory, str(step), "state"))
            missing = [k for k in zero_if_missing if k not in saved.tree]
            abstract_state = {k: v for k, v in abstract_state.items() if k not in missing}
        items = {"state": ocp.args.StandardRestore(abstract_state),
                 "meta": ocp.args.JsonRestore()}
        data_dir = os.path.join(self.directory, str(step), "data")
        own = os.path.join(data_dir, f"process_{jax.process_index()}-of-{jax.process_count()}.json")
        other = None
        if data_iterator is not None:
            if os.path.exists(own):
                items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
            else:  # saved by another number of processes: all were at the same position
                other = sorted(glob.glob(os.path.join(data_dir, "process_0-of-*.json")))
                if not other:
                    raise FileNotFoundError(f"checkpoint {step} in {self.directory} has no data "
                                            f"iterator state ({own} is missing)")
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        if other:
            with open(other[0]) as f:
                data_iterator.set_state(json.load(f))
        state = restored["state"]
        if missing:
            state = dict(state, **{k: jax.device_put(jnp.zeros(full[k].shape, full[k].dtype),
                                                     getattr(full[k], "sharding", None))
                                   for k in missing})
        return state, restored["meta"]

    def read_meta(self, step: int) -> dict:
        """The ``meta`` item of ``step`` alone (the config it was saved with)."""
        ocp = self._ocp
        meta = self._manager.restore(
            step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        if not isinstance(meta, dict):
            raise ValueError(f"item 'meta' holds {type(meta).__name__}, not a JSON object")
        return meta

    def restore_newest(self, abstract_state: Any, data_iterator: Any,
                       check: Callable[[int, dict], None] | None = None,
                       saved_as: Callable[[int, dict], tuple[Any, Callable] | None] | None = None,
                       zero_if_missing: tuple[str, ...] = ()) -> Resumed:
        """The newest checkpoint that restores completely.

        Newer ones that do not (a truncated array file, garbled metadata, a missing item,
        an empty step folder) are listed in ``skipped`` with the reason and, once an older
        one has restored, renamed ``<step>.damaged`` (kept for a look, out of Orbax's
        sight) so the run can save those steps again. ``check(step, meta)`` runs before a
        step's state is read, and what it raises propagates: a checkpoint of another model
        is not damaged and must not be set aside. ``saved_as(step, meta)`` gives (the target
        of the tree the step holds, a function from that tree to ``abstract_state``'s) for a
        step saved in another layout, None otherwise; a failed conversion propagates (the
        checkpoint is not damaged). With no usable checkpoint, ``step`` is None and nothing
        is renamed. ``zero_if_missing`` as for ``restore``."""
        def attempt(step: int) -> tuple[Any, str | None]:
            meta, reason = _attempt(lambda: self.read_meta(step))
            if reason is None and check is not None:
                check(step, meta)
            restored, (target, convert) = None, (abstract_state, None)
            if reason is None and saved_as is not None:
                target, convert = saved_as(step, meta) or (target, convert)
            if reason is None:
                restored, reason = _attempt(lambda: self.restore(step, target, data_iterator,
                                                                    zero_if_missing))
            if not _on_every_process(reason is None):  # all resume from the same step
                return None, reason or "another process could not restore it"
            if convert is not None:
                restored = (convert(restored[0]), restored[1])
            return restored, None

        step, restored, skipped = newest_that_restores(self.all_steps(), attempt)
        if step is None:
            return Resumed(None, None, None, skipped)
        for bad, _ in skipped:
            self._set_aside(bad)
        return Resumed(step, *restored, skipped)

    def _set_aside(self, step: int) -> None:
        if jax.process_index() == 0:
            source = os.path.join(self.directory, str(step))
            target, n = source + DAMAGED_SUFFIX, 1
            while os.path.lexists(target):
                n += 1
                target = f"{source}{DAMAGED_SUFFIX}-{n}"
            os.rename(source, target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"lp_jax set aside checkpoint {step}")
        self._manager.reload()

    def wait(self) -> None:
        """Blocks until asynchronous saves are written; CheckpointWriteError if one failed.
        After an interrupted save there is nothing to wait for: the run stops at once."""
        if self._abandoned:
            return
        try:
            with failed_writes_hushed():
                self._manager.wait_until_finished()
        except Exception as e:
            raise self._write_error(e) from e
        except BaseException:  # a second signal's Interrupted, while the save writes on
            self._abandon()
            raise
        self._pending = None

    def _abandon(self) -> None:
        """An interrupt left a save to Orbax's threads, which go on with nobody to report
        to and fail as the interpreter shuts down under them, tracebacks and all, after the
        run's one line: they are hushed to the end of the process. The checkpoints saved
        before are whole (Orbax writes a step under a temporary name until it is complete)."""
        self._abandoned = True
        self._hush.for_good()

    def _write_error(self, e: Exception) -> CheckpointWriteError:
        """The one-line error for the pending save's failure, once its partial folder is
        removed (Orbax writes a step under a temporary name until it is complete, so the
        checkpoints already saved are untouched and a full disk gets its space back)."""
        step, self._pending = self._pending, None
        for partial in glob.glob(os.path.join(self.directory, f"{step}.orbax-checkpoint-tmp*")):
            shutil.rmtree(partial, ignore_errors=True)
        try:
            saved = [s for s in self.all_steps() if s != step]
        except Exception:  # the folder itself may be what failed: claim nothing then
            saved = []
        kept = f"; the checkpoints saved before it (steps up to {max(saved)}) are untouched" if saved else ""
        reason = os_reason(e) or one_line(e, 200, typed=True)
        return CheckpointWriteError(f"saving step {step} in {self.directory} failed: {reason}{kept}")

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if not self._abandoned:  # the manager's close would wait for the save after all
                self._manager.close()
            self._hush.close()


@dataclasses.dataclass
class Resumed:
    """What ``restore_newest`` found: the step (None: no usable checkpoint), its state and
    meta, and the newer checkpoints skipped as (step, why)."""

    step: int | None
    state: Any
    meta: dict | None
    skipped: list[tuple[int, str]]


def newest_that_restores(steps, attempt: Callable[[int], tuple[Any, str | None]]
                         ) -> tuple[int | None, Any, list[tuple[int, str]]]:
    """Tries ``attempt(step)`` -> (result, None) or (None, why it failed) on ``steps``, newest
    first; returns (the first step that restored or None, its result, the newer steps skipped
    as (step, why)). The trainer's resume and the run-folder readers both walk this way."""
    skipped = []
    for step in sorted(steps, reverse=True):
        result, why = attempt(step)
        if why is None:
            return step, result, skipped
        skipped.append((step, why))
    return None, None, skipped


def _attempt(read: Callable[[], Any]) -> tuple[Any, str | None]:
    """(what ``read`` returns, None), or (None, why it failed). Any failure means the
    checkpoint is unusable, whatever Orbax, JSON, TensorStore or the file system raised;
    Orbax's own logs of it (tracebacks included) are held back, since the caller reports
    the reason with the step."""
    try:
        with orbax_logs(logging.CRITICAL), abandoned_reads_hushed():
            return read(), None
    except Exception as e:
        return None, one_line(e, 200, typed=True)


def _on_every_process(ok: bool) -> bool:
    if jax.process_count() == 1:
        return ok

    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))



def abstract_like(tree: Any, shardings: Any = None) -> Any:
    """ShapeDtypeStructs of a tree (with shardings, if given) as a restore target."""
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)
