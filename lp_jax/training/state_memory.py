"""Does the training state fit this machine? Checked before anything is allocated.

The state's bytes per device are read off its abstract tree and shardings (each device
holds its shard of every leaf, a replicated leaf whole), plus a gradient of the
parameters' size, which every step holds beside them. That is a floor: activations and
the step's temporaries come on top (``python -m lp_jax.plan`` measures those for a GPU).
A run whose floor exceeds the memory is refused in one line, where otherwise it would
allocate for half a minute and end in an out-of-memory traceback.

Memory is a device's own (``bytes_limit``) on accelerators; CPU devices share the host's
RAM, so there the floors of all local devices add up against it. A step that passes
this check and still does not fit (XLA's out-of-memory error, at its compile or its run)
is one line too (``out_of_memory``).
"""
from __future__ import annotations

import os
import re
from typing import Any

import jax
import numpy as np

from lp_jax.errors import RunStoppedError, UserError


def _shard_bytes(leaf: jax.ShapeDtypeStruct, sharding) -> int:
    shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize


def state_bytes_per_device(target: dict, shardings: dict) -> int:
    """The state's bytes on one device, plus a gradient the size of its parameters."""
    total = 0
    for key in target:
        leaves = jax.tree.leaves(target[key])
        shards = jax.tree.leaves(shardings[key], is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
        per_leaf = [_shard_bytes(leaf, s) for leaf, s in zip(leaves, shards)]
        total += sum(per_leaf) * (2 if key == "params" else 1)
    return total


def _host_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _device_memory(device) -> int | None:
    try:
        stats = device.memory_stats()
    except Exception:  # CPU backends may raise instead of returning None
        return None
    return (stats or {}).get("bytes_limit")


def check_state_fits(target: dict, shardings: dict, what: str,
                     devices: list[Any] | None = None) -> None:
    """UserError, with the figures, when the state's floor exceeds the memory it would
    live in; nothing when the memory cannot be read."""
    devices = devices or jax.local_devices()
    per_device = state_bytes_per_device(target, shardings)
    params = sum(leaf.size for leaf in jax.tree.leaves(target["params"]))
    if devices[0].platform == "cpu":
        need, have = per_device * len(devices), _host_memory()
        where = f"this machine's {have / 1e9:.1f} GB of RAM" if have else ""
    else:
        need, have = per_device, _device_memory(devices[0])
        where = f"the {have / 1e9:.1f} GB of one {devices[0].device_kind}" if have else ""
    if have is None or need <= have:
        return
    raise UserError(
        f"{what} cannot train here: its state alone needs {need / 1e9:.1f} GB "
        f"({params / 1e9:.2f}B parameters: FP32 weights, gradients and AdamW moments"
        f"{f', over {len(devices)} devices' if len(devices) > 1 else ''}), more than {where}; "
        "use a smaller model, or more devices (python -m lp_jax.plan sizes a GPU run)")


class DeviceMemoryError(RunStoppedError):
    """The step itself (activations, temporaries) does not fit the device: XLA's
    out-of-memory error, as one line."""


# XLA's figure in its out-of-memory messages: "... allocate 123.45GiB ..." or "12345 bytes".
_NEEDED = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]i?B|bytes)\b")


def out_of_memory(e: Exception, what: str) -> DeviceMemoryError | None:
    """The one-line error for XLA's RESOURCE_EXHAUSTED (at compile or run time), or None
    when ``e`` is another error."""
    text = " ".join(str(e).split())
    if not isinstance(e, jax.errors.JaxRuntimeError) or not (
            "RESOURCE_EXHAUSTED" in text or "Out of memory" in text):
        return None
    m = _NEEDED.search(text)
    figure = f" (XLA: {m.group(1)} {m.group(2)})" if m else ""
    return DeviceMemoryError(
        f"{what}: the step does not fit the device's memory{figure}; lower "
        "data.micro_batch_size, set model.remat=mlp, elementwise or full, or shard further "
        "(python -m lp_jax.plan finds a setting that fits)")
