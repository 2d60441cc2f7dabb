"""The grain input pipeline: packed sequences with document boundaries, seeded shuffle.

Sequence ``i`` of a shard is its ``seq_len + 1`` tokens from token ``i * seq_len``; each
example carries ``tokens``, ``targets``, ``positions``, ``loss_mask`` and, with
``data.reset_attention_mask``, ``segment_ids`` (docs/training.md, "Data"). The order is
``MapDataset.source -> shuffle(seed) -> repeat``, cut into batches by ``BatchStream``:
random access, so the iterator state is a position, in sequences, and a resumed run reads
exactly the sequences it would have read, at any batch size. Global batch ``b`` is the
same sequences whatever the process count; each process reads only the rows its own
devices hold (``host_rows``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import grain
import jax
import numpy as np

from lp_jax.data import megatron, shards
from lp_jax.data.batch_stream import BatchStream
from lp_jax.data.fingerprint import common_root, file_entries
from lp_jax.data.prepare_data import invalid_utf8_note, text_shards
from lp_jax.errors import UserError
from lp_jax.parallel.partitioning import batch_sharding

# An example's keys with every DocumentRules switch on (segment_ids only with reset_attention_mask).
EXAMPLE_KEYS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")


@dataclasses.dataclass(frozen=True)
class DocumentRules:
    """Megatron's packing switches (``data.reset_attention_mask`` ...; schema.DataConfig)."""

    reset_attention_mask: bool = True
    reset_position_ids: bool = True
    eod_mask_loss: bool = True

    @classmethod
    def from_config(cls, data_cfg) -> "DocumentRules":
        return cls(data_cfg.reset_attention_mask, data_cfg.reset_position_ids,
                   data_cfg.eod_mask_loss)


def pack_window(window: np.ndarray, starts: np.ndarray, rules: DocumentRules) -> dict[str, np.ndarray]:
    """The example for one ``seq_len + 1``-token window whose token ``t`` begins a document
    where ``starts[t]``. Without ``rules.reset_attention_mask`` it has no ``segment_ids``:
    the model then attends causally over the whole row, as Megatron does with that switch
    off (and cuDNN runs its plain causal kernel)."""
    window = np.asarray(window, np.int64)
    starts = np.asarray(starts, bool)
    index = np.arange(len(window))
    example = {"tokens": window[:-1].astype(np.int32), "targets": window[1:].astype(np.int32)}
    if rules.reset_attention_mask:
        # Segment ids start at 1 (0 is what attention masks often reserve for padding).
        example["segment_ids"] = (np.cumsum(starts) + 1)[:-1].astype(np.int32)
    if rules.reset_position_ids:
        doc_start = np.maximum.accumulate(np.where(starts, index, 0))
        example["positions"] = (index - doc_start)[:-1].astype(np.int32)
    else:
        example["positions"] = index[:-1].astype(np.int32)
    # Target t is token t + 1: masked when that token begins a document.
    example["loss_mask"] = ~starts[1:] if rules.eod_mask_loss else np.ones(len(window) - 1, bool)
    return example


def pack_sequence(window: np.ndarray, bos_id: int,
                  rules: DocumentRules = DocumentRules()) -> dict[str, np.ndarray]:
    """The example for one window of a shard whose documents each begin with ``bos_id``."""
    window = np.asarray(window)
    return pack_window(window, window == bos_id, rules)


def pack_eod_sequence(window: np.ndarray, eod_id: int,
                      rules: DocumentRules = DocumentRules()) -> dict[str, np.ndarray]:
    """The example for one window of a stream whose documents each end with ``eod_id``
    (Megatron's layout): a document begins after each EOD."""
    window = np.asarray(window)
    return pack_window(window, np.concatenate([[False], window[:-1] == eod_id]), rules)


class PackedSequences:
    """Random-access source of packed sequences over token shards (grain's source protocol).

    With ``vocab_size``, every sequence read is checked for ids outside ``[0, vocab_size)``
    (a shard made with another tokenizer): the embedding lookup would turn them into NaN,
    and every step would be skipped. Checking as sequences are read costs one min/max per
    sequence, where scanning every shard up front would read the whole data set first;
    the first sequence of each shard is checked at once, so a shard from another
    tokenizer is refused before the run writes anything."""

    def __init__(self, arrays: Sequence[np.ndarray], seq_len: int, bos_id: int,
                 vocab_size: int | None = None, names: Sequence[str] | None = None,
                 rules: DocumentRules = DocumentRules(),
                 document_starts: Sequence[np.ndarray] | None = None):
        """``document_starts[i]``, when given, holds the ascending token offsets at which
        documents begin in ``arrays[i]`` (a Megatron index's): then those, not BOS ids, mark
        the documents."""
        self.arrays, self.seq_len, self.bos_id, self.rules = list(arrays), seq_len, bos_id, rules
        self.document_starts = None if document_starts is None else [
            np.asarray(s, np.int64) for s in document_starts]
        self.vocab_size = vocab_size
        self.names = list(names) if names is not None else [f"#{i}" for i in range(len(self.arrays))]
        counts = [max(0, (len(a) - 1) // seq_len) for a in self.arrays]
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if vocab_size is not None:
            for shard, array in enumerate(self.arrays):
                if len(array):
                    self._check_ids(array[:seq_len + 1], shard, 0)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        shard = int(np.searchsorted(self.offsets, index, side="right")) - 1
        start = (int(index) - int(self.offsets[shard])) * self.seq_len
        window = self.arrays[shard][start:start + self.seq_len + 1]
        if self.vocab_size is not None:
            self._check_ids(window, shard, start)
        if self.document_starts is None:
            return pack_sequence(window, self.bos_id, self.rules)
        offsets = self.document_starts[shard]
        first, last = np.searchsorted(offsets, [start, start + len(window)])
        starts = np.zeros(len(window), bool)
        starts[offsets[first:last] - start] = True
        return pack_window(window, starts, self.rules)

    def _check_ids(self, window: np.ndarray, shard: int, start: int) -> None:
        low, high = int(window.min()), int(window.max())
        if low >= 0 and high < self.vocab_size:
            return
        bad = low if low < 0 else high
        at = start + int(np.argmax(window == bad))
        raise UserError(
            f"token shard {self.names[shard]!r} holds id {bad} at token {at:,}, outside the "
            f"model's vocabulary of {self.vocab_size} ids (made with another tokenizer than "
            "data.tokenizer? model.vocab_size too small?)")


class MockSequences:
    """Deterministic uniform random tokens, one document per sequence (``data.source=
    mock_uniform``: shapes for benchmarks, nothing to learn).

    Sequence ``i`` depends only on (seed, i), so it needs no files and resumes exactly.
    """

    shuffles_itself = True  # already random per index: train_iterator adds no shuffle

    def __init__(self, vocab_size: int, seq_len: int, seed: int, length: int = 1 << 40,
                 rules: DocumentRules = DocumentRules()):
        self.vocab_size, self.seq_len, self.seed, self.length = vocab_size, seq_len, seed, length
        self.rules = rules

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng((self.seed, int(index)))
        window = rng.integers(0, self.vocab_size, self.seq_len + 1, dtype=np.int64)
        return pack_window(window, np.zeros(len(window), bool), self.rules)


BLEND_RESOLUTION = 10_000  # blend weights are honoured to one part in this


class BlendedSequences:
    """Megatron's blend of datasets (``data.paths=[w1, prefix1, w2, prefix2, ...]``): the
    sequences of several sources interleaved so that every stretch of the stream holds
    them in the weights' proportions, as Megatron's BlendedDataset does.

    The weights, rounded to ``BLEND_RESOLUTION``, become integer counts per period; each slot
    of the period goes to the source furthest behind its weight (Megatron's rule in
    build_blending_indices), so sequence ``i`` is found without a table of the whole run.
    Each source is read in its own seeded shuffle, reshuffled on each of its passes; a
    source with a large weight and few sequences repeats within one pass of another. The
    blend's length is the sequences it takes for every source to be read whole once.
    """

    shuffles_itself = True  # the order is the blend's: train_iterator adds no shuffle

    def __init__(self, sources: Sequence[Any], weights: Sequence[float], seed: int):
        counts = [max(1, round(w / sum(weights) * BLEND_RESOLUTION)) for w in weights]
        common = math.gcd(*counts)
        self.counts = [c // common for c in counts]
        period = sum(self.counts)
        taken = [0] * len(sources)
        self._slot_source, self._slot_rank = [], []
        for slot in range(period):
            behind = [c * (slot + 1) / period - t for c, t in zip(self.counts, taken)]
            source = int(np.argmax(behind))
            self._slot_source.append(source)
            self._slot_rank.append(taken[source])
            taken[source] += 1
        self.period = period
        self.sources = [grain.MapDataset.source(s).shuffle(seed=(seed + 7919 * i) % 2**32)
                        for i, s in enumerate(sources)]
        self.length = max(-(-len(s) * period // c) for s, c in zip(sources, self.counts))

    def __len__(self) -> int:
        return self.length

    def source_of(self, index: int) -> tuple[int, int]:
        """(source, its sequence number) of blended sequence ``index``."""
        cycle, slot = divmod(int(index), self.period)
        source = self._slot_source[slot]
        return source, cycle * self.counts[source] + self._slot_rank[slot]

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        source, key = self.source_of(index)
        return self.sources[source][key]


# Megatron's MockGPTLowLevelDataset (megatron/core/datasets/gpt_dataset.py): a fixed set of
# documents whose lengths come from a generator of its own hard-coded seed.
MEGATRON_MOCK_DOCUMENTS = 100_000
MEGATRON_MOCK_MAX_LENGTH = 4096  # lengths are drawn from [1, 4096)
MEGATRON_MOCK_LENGTH_SEED = 0
# Megatron Bridge's dataset split "9999,8,2" of those documents, by Megatron's rounding
# (train, validation; the last 20 are its test split).
MEGATRON_MOCK_SPLITS = {"train": (0, 99_900), "validation": (99_900, 99_980)}


def megatron_mock_lengths() -> np.ndarray:
    """The token count (EOD included) of each of Megatron's mock documents."""
    rng = np.random.default_rng(MEGATRON_MOCK_LENGTH_SEED)
    return rng.integers(1, MEGATRON_MOCK_MAX_LENGTH, size=MEGATRON_MOCK_DOCUMENTS, dtype=np.int32)


class MegatronMockSequences:
    """Megatron's mock pretraining data (``data.source=mock``), as Megatron Bridge trains
    on it: learnable, since each document counts up.

    Document ``d`` of ``megatron_mock_lengths()`` is the ids 1, 2, ..., length - 1 and EOD.
    As Megatron's GPTDataset builds one epoch, the split's documents are shuffled with
    ``numpy.random.RandomState(seed)``, concatenated, cut into sequences of ``seq_len + 1``
    tokens every ``seq_len`` (the partial last one dropped), and the sequences shuffled with
    the same generator. Megatron shuffles the documents of all the epochs a run needs
    together, so the rows are Megatron's while a run stays within one epoch (about 205M
    training tokens); later epochs repeat the first.

    EOD is the model's last id, as Megatron's NullTokenizer puts EOD after its ids. A
    vocabulary of fewer than 4,096 ids cannot hold the counts: they wrap around to 1
    after ``vocab_size - 2``.
    """

    shuffles_itself = True  # the order is Megatron's: train_iterator adds no shuffle

    def __init__(self, split: str, vocab_size: int, seq_len: int, seed: int,
                 rules: DocumentRules = DocumentRules()):
        if vocab_size < 3:
            raise UserError(f"model.vocab_size={vocab_size} is too small for data.source=mock: "
                            "Megatron's mock documents need EOD and two counting ids")
        self.split, self.vocab_size, self.seq_len, self.seed = split, vocab_size, seq_len, seed
        self.rules, self.eod_id = rules, vocab_size - 1
        first, end = MEGATRON_MOCK_SPLITS[split]
        random = np.random.RandomState(seed)
        documents = np.arange(first, end, dtype=np.int32)
        random.shuffle(documents)
        self._random_after_documents = random.get_state()  # where the sample shuffle starts
        self.documents = documents
        self.lengths = megatron_mock_lengths()[documents].astype(np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)])  # each document's first token
        # Each sequence reads one token past its seq_len (its last target).
        self.length = int((self.starts[-1] - 1) // seq_len)
        if self.length == 0:
            raise UserError(f"data.seq_len={seq_len} is longer than the {int(self.starts[-1]):,} "
                            f"tokens of Megatron's mock {split} documents")
        self._order = None  # built on first read (millions of entries at short seq_len)

    def __len__(self) -> int:
        return self.length

    @property
    def order(self) -> np.ndarray:
        """Megatron's sample shuffle: the sequence read at each index."""
        if self._order is None:  # grain's threads may race here: each builds the same order
            random = np.random.RandomState()
            random.set_state(self._random_after_documents)
            order = np.arange(self.length, dtype=np.int64)
            random.shuffle(order)
            self._order = order
        return self._order

    def tokens(self, first: int, count: int) -> np.ndarray:
        """Tokens ``first .. first + count - 1`` of the concatenated documents."""
        at = np.arange(first, first + count, dtype=np.int64)
        document = np.searchsorted(self.starts, at, side="right") - 1
        offset = at - self.starts[document]
        count_up = 1 + offset % (self.vocab_size - 2)
        return np.where(offset == self.lengths[document] - 1, self.eod_id, count_up)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        sequence = int(self.order[int(index)])
        window = self.tokens(sequence * self.seq_len, self.seq_len + 1)
        return pack_eod_sequence(window, self.eod_id, self.rules)


@dataclasses.dataclass
class Splits:
    """The train and validation sources of a run (val None: no validation)."""

    train: Any
    val: Any | None
    description: str
    # What the splits read, for the checkpoints' data fingerprint (lp_jax/data/fingerprint.py):
    # split -> {path relative to the data's folder: size and hash}; None: no files (mock).
    files: dict | None = None


def open_splits(data_cfg, tokenizer, vocab_size: int, seed: int, progress: bool = True) -> Splits:
    """The sources named by a DataConfig (text is tokenized into the cache on first use)."""
    rules = DocumentRules.from_config(data_cfg)
    if data_cfg.source == "mock":
        train, val = (MegatronMockSequences(split, vocab_size, data_cfg.seq_len, seed, rules)
                      for split in ("train", "validation"))
        return Splits(train, val, f"Megatron's mock documents ({len(train):,} training "
                                  f"sequences, EOD {train.eod_id})")
    if data_cfg.source == "mock_uniform":
        val = MockSequences(vocab_size, data_cfg.seq_len, seed=seed + 0x5EED, rules=rules)
        return Splits(MockSequences(vocab_size, data_cfg.seq_len, seed=seed, rules=rules), val,
                      f"uniform random tokens (vocab {vocab_size})")
    if data_cfg.source == "megatron":
        return open_megatron_splits(data_cfg, tokenizer, vocab_size, seed, rules)
    binary: list[str] = []
    invalid: dict[str, int] = {}
    if data_cfg.source == "text":
        try:
            text = text_shards(data_cfg.paths, data_cfg.val_paths, data_cfg.val_fraction,
                               tokenizer, data_cfg.cache_dir, progress=progress)
        except ValueError as e:
            raise UserError(f"data.paths: {e}") from None
        train_paths, val_paths, binary = text.train, text.val, text.binary
        invalid = text.invalid_utf8
        files = {"train": file_entries(text.train_files, text.root, text.digests),
                 "val": file_entries(text.val_files, text.root, text.digests)}
        what = ", ".join(data_cfg.paths) or "the Python standard library"
    else:  # tokens
        train_paths = shards.expand_globs(data_cfg.paths)
        val_paths = shards.expand_globs(data_cfg.val_paths)
        root = common_root(train_paths + val_paths)
        files = {"train": file_entries(train_paths, root), "val": file_entries(val_paths, root)}
        what = ", ".join(data_cfg.paths)

    def packed(paths, key):
        try:
            arrays = shards.open_shards(paths, data_cfg.token_dtype)
        except ValueError as e:
            raise UserError(f"{key}: {e}") from None
        return PackedSequences(arrays, data_cfg.seq_len, tokenizer.bos_id, vocab_size, paths,
                               rules)

    train = packed(train_paths, "data.paths")
    tokens = int(sum(len(a) for a in train.arrays))
    if len(train) == 0:
        raise UserError(f"data.paths: {what} hold(s) {tokens:,} training tokens, fewer than one "
                        f"sequence of data.seq_len + 1 = {data_cfg.seq_len + 1}; give more data "
                        "or a smaller data.seq_len")
    val = None
    if val_paths:
        val = packed(val_paths, "data.val_paths")
        if len(val) == 0:
            val = None
    skipped = f"; skipped {len(binary)} binary file(s), e.g. {binary[0]}" if binary else ""
    if invalid:
        skipped += "; " + invalid_utf8_note(invalid)
    return Splits(train, val, f"{what}: {tokens:,} training tokens ({tokenizer.name}), "
                              f"{0 if val is None else len(val):,} validation sequences{skipped}",
                  files)


def open_megatron_splits(data_cfg, tokenizer, vocab_size: int, seed: int,
                         rules: DocumentRules) -> Splits:
    """Megatron-LM indexed datasets read in place (``data.source=megatron``). Without
    ``data.val_paths``, the last ``data.val_fraction`` of each dataset's documents is the
    validation split, as Megatron's ``split`` puts validation after training."""

    def opened(entries, key):
        try:
            prefixes, weights = megatron.parse_blend(entries)
            return [megatron.open_indexed(p) for p in prefixes], weights
        except ValueError as e:
            raise UserError(f"{key}: {e}") from None

    train_sets, weights = opened(data_cfg.paths, "data.paths")
    parts = {"train": [], "val": []}  # (name, tokens, document starts) per dataset
    for dataset in train_sets:
        starts, docs = dataset.document_starts, dataset.documents
        held = 0
        if not data_cfg.val_paths and data_cfg.val_fraction > 0 and docs >= 2:
            held = max(1, round(data_cfg.val_fraction * docs))
        cut = int(starts[docs - held])
        parts["train"].append((dataset.prefix, dataset.tokens[:cut], starts[:docs - held + 1]))
        if held:
            parts["val"].append((dataset.prefix, dataset.tokens[cut:], starts[docs - held:] - cut))
    val_weights, val_sets = weights, []
    if data_cfg.val_paths:
        val_sets, val_weights = opened(data_cfg.val_paths, "data.val_paths")
        parts["val"] = [(d.prefix, d.tokens, d.document_starts) for d in val_sets]

    def packed(entries):
        return PackedSequences([e[1] for e in entries], data_cfg.seq_len, tokenizer.bos_id,
                               vocab_size, [e[0] for e in entries], rules, [e[2] for e in entries])

    def source(entries, blend_weights, key):
        if blend_weights is None:
            return packed(entries)
        sources = [packed([e]) for e in entries]
        empty = [e[0] for e, s in zip(entries, sources) if len(s) == 0]
        if empty:
            raise UserError(f"{key}: blended dataset {empty[0]!r} holds fewer than one sequence "
                            f"of data.seq_len + 1 = {data_cfg.seq_len + 1} tokens")
        return BlendedSequences(sources, blend_weights, seed)

    train = source(parts["train"], weights, "data.paths")
    tokens = int(sum(len(e[1]) for e in parts["train"]))
    if len(train) == 0:
        raise UserError(f"data.paths: the Megatron datasets hold {tokens:,} training tokens, fewer "
                        f"than one sequence of data.seq_len + 1 = {data_cfg.seq_len + 1}")
    val = None
    # Held-out documents too short for a sequence (a tiny data.val_fraction) mean no validation,
    # as for the other sources; named data.val_paths must each hold one.
    if parts["val"] and (data_cfg.val_paths or val_weights is None
                         or all(len(e[1]) > data_cfg.seq_len for e in parts["val"])):
        val = source(parts["val"], val_weights, "data.val_paths")
        if len(val) == 0:
            val = None
    blend = "" if weights is None else " blended " + ", ".join(
        f"{w:.3g}" for w in weights)
    return Splits(train, val, f"{len(train_sets)} Megatron dataset(s){blend}: {tokens:,} "
                              f"training tokens, {0 if val is None else len(val):,} validation "
                              "sequences", _megatron_files(train_sets, val_sets))


def _megatron_files(train_sets, val_sets) -> dict:
    """The .bin and .idx files of the Megatron datasets, for the data fingerprint (a split
    held out of a training dataset is in its files)."""
    def paths(sets):
        return [d.prefix + suffix for d in sets for suffix in (".bin", ".idx")]

    root = common_root(paths(train_sets) + paths(val_sets))
    return {"train": file_entries(paths(train_sets), root), "val": file_entries(paths(val_sets), root)}


def host_rows(mesh, global_batch_size: int, accum_steps: int) -> np.ndarray | None:
    """Rows of each global batch (0 .. G-1, ascending) that this process's devices hold, or
    None when they hold all of them (one process, or every process sees every row).

    A step's batch is [accum, G/accum, L] with the second axis split over (data, fsdp)
    (partitioning.batch_sharding); micro-batch ``a`` is rows a*G/accum ... of the batch.
    """

    per_micro = global_batch_size // accum_steps
    shape = (accum_steps, per_micro)
    indices = batch_sharding(mesh).addressable_devices_indices_map(shape)
    mine = set()
    for index in indices.values():
        mine.update(range(*index[1].indices(per_micro)))
    if len(mine) == per_micro or jax.process_count() == 1:
        return None
    local = np.array(sorted(mine))
    if local[-1] - local[0] + 1 != len(local):
        raise ValueError(f"process {jax.process_index()} holds batch rows that are not "
                         f"contiguous ({local.tolist()}); build the mesh in process order")
    return np.concatenate([a * per_micro + local for a in range(accum_steps)])


def train_iterator(source, seed: int, global_batch_size: int, read_threads: int = 1,
                   rows: np.ndarray | None = None) -> BatchStream:
    """An endless, seeded, checkpointable iterator of global batches (dicts of arrays), or,
    with ``rows`` (from host_rows), of those rows of each global batch only; its position
    is in sequences (lp_jax/data/batch_stream.py)."""
    ds = grain.MapDataset.source(source)
    if not getattr(source, "shuffles_itself", False):
        ds = ds.shuffle(seed=seed)  # reshuffled differently each epoch by repeat()
    options = grain.ReadOptions(num_threads=read_threads,
                                prefetch_buffer_size=2 * read_threads if read_threads else 0)
    return BatchStream(ds.repeat(None), global_batch_size, options, rows)


def validation_batches(source, global_batch_size: int, num_batches: int,
                       rows: np.ndarray | None = None) -> list[dict]:
    """The same first ``num_batches`` batches of the validation split every time
    (unshuffled; a split smaller than that wraps around); with ``rows``, only those rows
    of each batch (this process's, from host_rows)."""
    out = []
    rows = range(global_batch_size) if rows is None else rows
    for b in range(num_batches):
        items = [source[(b * global_batch_size + int(i)) % len(source)] for i in rows]
        out.append({k: np.stack([it[k] for it in items]) for k in items[0]})
    return out
