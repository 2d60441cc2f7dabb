"""Global batches cut from one seeded stream of sequences, positioned by sequences read.

The stream is the shuffled, endlessly repeated sequence dataset; batch ``k`` of a run is
the next ``global_batch_size`` sequences after the ones already read. The checkpointed
state is that count of sequences (not a batch index), so a resume with another
``data.global_batch_size`` goes on at the very next sequence: nothing skipped, nothing read
twice. Each process reads only its ``rows`` of every global batch, and all processes keep
the same position.

The state is JSON bytes, the form grain's checkpoint handler stores for an iterator that
is not one of its own; ``set_state`` also takes the dict that handler's JSON holds and the
``{"next_index": batches}`` of the earlier grain batch iterator (counted in the current
batch size, which the caller checks against the checkpoint's).
"""
from __future__ import annotations

import json
from typing import Any

import grain
import numpy as np

STATE_KEY = "sequences_read"


class BatchStream:
    """An iterator of global batches (or of ``rows`` of each) over ``stream``."""

    def __init__(self, stream: grain.MapDataset, global_batch_size: int,
                 read_options: grain.ReadOptions, rows: np.ndarray | None = None):
        self.stream = stream
        self.global_batch_size = global_batch_size
        self.rows = np.arange(global_batch_size) if rows is None else np.asarray(rows, np.int64)
        self._read_options = read_options
        self.sequences_read = 0
        self.legacy_state = False  # restored from a batch-index state (see set_state)
        self._it = None

    def _open(self):
        stream, start, size, rows = self.stream, self.sequences_read, self.global_batch_size, self.rows
        local = len(rows)
        batches = (len(stream) - start) // size
        # Element i: row rows[i % local] of the (i // local)-th batch from the position.
        ds = grain.MapDataset.range(0, batches * local).map(
            lambda i: stream[start + (i // local) * size + int(rows[i % local])])
        return iter(ds.batch(local, drop_remainder=True).to_iter_dataset(read_options=self._read_options))

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._it is None:
            self._it = self._open()
        batch = next(self._it)
        self.sequences_read += self.global_batch_size
        return batch

    def start_prefetch(self) -> None:
        """Called by grain's checkpoint handler after a restore; reading starts on next()."""

    def get_state(self) -> bytes:
        return json.dumps({STATE_KEY: self.sequences_read}).encode()

    def set_state(self, state: bytes | str | dict[str, Any]) -> None:
        if isinstance(state, (bytes, str)):
            state = json.loads(state)
        if STATE_KEY in state:
            self.sequences_read, self.legacy_state = int(state[STATE_KEY]), False
        elif "next_index" in state:
            self.sequences_read = int(state["next_index"]) * self.global_batch_size
            self.legacy_state = True
        else:
            raise ValueError(f"data iterator state {state!r} holds no position")
        self._it = None  # reopened at the new position
