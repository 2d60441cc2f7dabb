"""Small corpus files of every format prepare_data reads, written here (no downloads), and
the token stream a tokenizer gives their documents when applied by hand."""
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lp_jax.data import shards

DOCUMENTS = ["The quick brown fox.", "héllo wörld, ünïcode", "line one\nline two\n",
             "a" * 300, "último documento"]


def documents(tag: str, n: int = 5) -> list[str]:
    """n distinct documents for a file (the tag keeps files apart)."""
    return [f"{tag} #{i}: {DOCUMENTS[i % len(DOCUMENTS)]}" for i in range(n)]


def write_jsonl(path, records, compression=None):
    """JSON lines, compressed by pyarrow's gzip or zstd stream when asked (as the zstd and
    gzip command-line tools write them: one frame or member)."""
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    if compression is None:
        with open(path, "wb") as f:
            f.write(data)
    else:
        with pa.output_stream(str(path), compression=compression) as f:
            f.write(data)
    return path


def write_parquet(path, texts, field="text", row_group_size=2):
    table = pa.table({field: pa.array(texts, pa.string()),
                      "id": pa.array(range(len(texts)), pa.int64())})
    pq.write_table(table, str(path), row_group_size=row_group_size)
    return path


def write_arrow(path, texts, field="text", stream=True):
    """An Arrow IPC stream (what Hugging Face datasets writes) or file, two rows a batch."""
    table = pa.table({field: pa.array(texts, pa.string())})
    with pa.OSFile(str(path), "wb") as sink:
        opener = pa.ipc.new_stream if stream else pa.ipc.new_file
        with opener(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=2):
                writer.write_batch(batch)
    return path


def write_hf_dataset(folder, chunks, field="text"):
    """A ``Dataset.save_to_disk`` folder as datasets 2.x-4.x writes it: Arrow stream files
    ``data-0000i-of-0000n.arrow``, ``state.json`` listing them in order, ``dataset_info.json``."""
    os.makedirs(folder, exist_ok=True)
    names = [f"data-{i:05d}-of-{len(chunks):05d}.arrow" for i in range(len(chunks))]
    for name, texts in zip(names, chunks):
        write_arrow(os.path.join(folder, name), texts, field)
    with open(os.path.join(folder, "state.json"), "w") as f:
        json.dump({"_data_files": [{"filename": n} for n in names], "_fingerprint": "0" * 16,
                   "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
                   "_output_all_columns": False, "_split": None}, f)
    with open(os.path.join(folder, "dataset_info.json"), "w") as f:
        json.dump({"features": {field: {"dtype": "string", "_type": "Value"}}}, f)
    return folder


def expected_stream(tokenizer, texts) -> np.ndarray:
    """[BOS] encode(text) [EOS] for each document, one text at a time."""
    tail = [tokenizer.eos_id] if tokenizer.eos_id != tokenizer.bos_id else []
    out = []
    for text in texts:
        out += [tokenizer.bos_id, *tokenizer.encode(text), *tail]
    return np.array(out, np.int64)


def split_stream(out_dir, split="train", meta_name=shards.META) -> np.ndarray:
    """The split's shards read back in meta.json's order, as one stream."""
    meta = json.loads((out_dir / meta_name).read_text())
    paths = [str(out_dir / p) for p in meta["splits"][split]["shards"]]
    if meta["format"] == "megatron":
        from lp_jax.data import megatron

        arrays = [megatron.open_indexed(p).tokens for p in paths]
    else:
        arrays = shards.open_shards(paths, meta["dtype"])
    return np.concatenate(arrays).astype(np.int64) if arrays else np.zeros(0, np.int64)
