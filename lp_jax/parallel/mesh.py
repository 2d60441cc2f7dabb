"""The device mesh: data, FSDP, expert and tensor parallelism over (data, fsdp, expert,
tensor) axes.

``data`` and ``fsdp`` split the batch, ``fsdp`` also shards the state (ZeRO-3), ``expert``
splits the batch too and a mixture of experts' expert weights by expert (tokens travel to
their experts by all-to-all, ``models.moe_dispatch``), ``tensor`` is Megatron tensor
parallelism (docs/scaling.md, docs/moe.md). Devices are laid out in process order, so the
tensor axis (the chattiest) spans neighbouring devices of one host, the expert axis the
next ones, and each process's devices hold a contiguous range of the batch (what
``pipeline.host_rows`` relies on). The axes are ``Auto``: the partitioner places the
collectives, steered by the shardings of ``partitioning``.
"""
from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from lp_jax.errors import UserError

MESH_AXES = ("data", "fsdp", "expert", "tensor")
# All three split the batch; fsdp also shards the state, expert the experts.
BATCH_AXES = ("data", "fsdp", "expert")


def mesh_shape(data: int, fsdp: int, tensor: int, device_count: int,
               expert: int = 1) -> tuple[int, int, int, int]:
    """(data, fsdp, tensor, expert) sizes for ``device_count`` devices; one of them may be
    -1 (the rest). Raises UserError with one line when the sizes cannot tile the devices."""
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    if expert != 1:  # named in messages only where a run sets it
        sizes["expert"] = expert
    for name, size in sizes.items():
        if size == 0 or size < -1:
            raise UserError(f"mesh.{name}={size} is invalid: a mesh size is a positive "
                            "integer, or -1 for the devices left by the others")
    fills = [name for name, size in sizes.items() if size == -1]
    if len(fills) > 1:
        raise UserError(f"mesh.{fills[0]} and mesh.{fills[1]} are both -1: at most one mesh "
                        "size may take the rest of the devices")
    known = math.prod(size for size in sizes.values() if size != -1)
    product = " x ".join(f"{name}={size}" for name, size in sizes.items())
    if fills:
        if device_count % known:
            raise UserError(f"mesh sizes {product} cannot tile the {device_count} devices: "
                            f"{known} does not divide {device_count}")
        sizes[fills[0]] = device_count // known
    elif known != device_count:
        keys = " x ".join(f"mesh.{name}" for name in sizes)
        raise UserError(f"{keys} = {product} = {known} devices, "
                        f"but there are {device_count}; make the product {device_count} "
                        "(one size may be -1: the rest)")
    return sizes["data"], sizes["fsdp"], sizes["tensor"], sizes.get("expert", 1)


def make_mesh(data: int, fsdp: int = 1, tensor: int = 1, expert: int = 1, devices=None):
    """An Auto-typed ``jax.sharding.Mesh`` over the first data*fsdp*expert*tensor devices
    (in process order, so a host's devices are neighbours on every axis)."""
    devices = list(jax.devices() if devices is None else devices)
    devices.sort(key=lambda d: (d.process_index, d.id))
    count = data * fsdp * expert * tensor
    if count > len(devices):
        raise ValueError(f"a {data}x{fsdp}x{expert}x{tensor} (data x fsdp x expert x tensor) mesh "
                         f"needs {count} devices, {len(devices)} are available")
    grid = np.asarray(devices[:count], dtype=object).reshape(data, fsdp, expert, tensor)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
