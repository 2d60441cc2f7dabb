"""Multi-process runs: ``jax.distributed.initialize`` from the config or the environment.

Every process runs the same ``train.py`` command. A value the ``distributed`` config
section leaves unset comes from the environment (``JAX_COORDINATOR_ADDRESS``,
``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``, ``JAX_LOCAL_DEVICE_IDS``) or, under SLURM or
Open MPI, from the launcher's variables (docs/scaling.md, "Several hosts").
``maybe_initialize`` must run before JAX touches a device.
"""
from __future__ import annotations

import os

import jax
import jax._src.distributed  # the runtime client, for the peer watch's key-value store

from lp_jax.config.schema import DistributedConfig
from lp_jax.errors import UserError

_LAUNCHER_SIZE_VARS = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def _env_int(name: str) -> int | None:
    text = os.environ.get(name)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise UserError(f"environment variable {name}={text!r} must be an integer") from None


def resolve_arguments(cfg: DistributedConfig) -> dict | None:
    """The keyword arguments for jax.distributed.initialize, or None for a one-process run."""
    address = cfg.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    count = cfg.num_processes if cfg.num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    index = cfg.process_id if cfg.process_id is not None else _env_int("JAX_PROCESS_ID")
    launched = any((_env_int(v) or 1) > 1 for v in _LAUNCHER_SIZE_VARS)
    wanted = cfg.initialize if cfg.initialize is not None else bool(address or launched)
    if not wanted:
        return None
    if count is not None and count < 1:
        raise UserError(f"distributed.num_processes={count} is invalid: must be at least 1")
    if index is not None and count is not None and not 0 <= index < count:
        raise UserError(f"distributed.process_id={index} is invalid: must be in 0..{count - 1} "
                        f"for num_processes={count}")
    if address and not launched and (count is None or index is None):
        raise UserError("distributed: a coordinator address is set but not the process count "
                        "and index; set distributed.num_processes and distributed.process_id "
                        "(or JAX_NUM_PROCESSES and JAX_PROCESS_ID)")
    kwargs = {"coordinator_address": address, "num_processes": count, "process_id": index}
    if cfg.local_device_ids:
        kwargs["local_device_ids"] = list(cfg.local_device_ids)
    return {k: v for k, v in kwargs.items() if v is not None}


def maybe_initialize(cfg: DistributedConfig) -> bool:
    """Calls jax.distributed.initialize when the config or environment asks for several
    processes (once per process); returns whether this is a multi-process run."""
    kwargs = resolve_arguments(cfg)
    if kwargs is None:
        return False
    if not jax.distributed.is_initialized():
        jax.distributed.initialize(**kwargs)
    return jax.process_count() > 1


def watch_peers(exit_code: int):
    """In a multi-process run, starts the watch that ends this process with one line,
    exiting ``exit_code``, when another process dies (lp_jax.parallel.peer_watch), and
    routes C++'s stderr through lp_jax.parallel.stderr_relay; returns the watch, or None."""
    from lp_jax.parallel import peer_watch, stderr_relay

    state = getattr(jax._src.distributed, "global_state", None)
    client, address = getattr(state, "client", None), getattr(state, "coordinator_address", None)
    if jax.process_count() == 1 or client is None or not address:
        return None
    stderr_relay.install()
    return peer_watch.start(client, jax.process_index(), jax.process_count(),
                            peer_watch.coordinator_host(address), exit_code,
                            before_exit=stderr_relay.drop_rest)


def is_primary() -> bool:
    """Process 0 writes the run folder's files (config, metrics, TensorBoard) and prints."""
    return jax.process_index() == 0
