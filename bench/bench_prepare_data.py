"""prepare_data's throughput against the floor the tokenizer allows: tokens per second per
core of ``python -m lp_jax.data.prepare_data`` (reading zstd JSON lines, tokenizing in a pool
of processes, writing shards) and of the ``tokenizers`` library's own ``encode_batch`` over
the same texts already in memory, with its Rust threads on every core.

    python bench/bench_prepare_data.py [--tokenizer llama3] [--mb 20] [--files 16]

The texts are the Python standard library's ``.py`` files (on every machine), one document
each, written as ``--files`` zstd-compressed JSON lines files. "per core" divides by the
cores this process may use. The ratio column is prepare_data's tokens/s over the floor's.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lp_jax.data import prepare_data  # noqa: E402
from lp_jax.data.tokenizers import HFTokenizer, byte_tokenizer, get_tokenizer  # noqa: E402


def corpus(folder: str, megabytes: float, files: int) -> list[str]:
    """Standard-library sources up to ``megabytes``, as ``files`` .jsonl.zst files; the texts."""
    import pyarrow as pa

    paths, _ = prepare_data.stdlib_files()
    texts, size = [], 0
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if text:
            texts.append(text)
            size += len(text.encode())
        if size >= megabytes * 1e6:
            break
    per_file = -(-len(texts) // files)
    for i in range(files):
        chunk = texts[i * per_file:(i + 1) * per_file]
        with pa.output_stream(os.path.join(folder, f"part{i:03d}.jsonl.zst"), compression="zstd") as f:
            f.write("".join(json.dumps({"text": t}) + "\n" for t in chunk).encode())
    return texts


def rust_encoder(name: str):
    """The tokenizers.Tokenizer behind a data.tokenizer name (bytes: its HF twin)."""
    tokenizer = get_tokenizer(name)
    return tokenizer._tok if isinstance(tokenizer, HFTokenizer) else byte_tokenizer()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default="llama3", help="a data.tokenizer name (default llama3)")
    parser.add_argument("--mb", type=float, default=20, help="megabytes of text (default 20)")
    parser.add_argument("--files", type=int, default=16, help="input files (default 16)")
    args = parser.parse_args(argv)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    work = tempfile.mkdtemp(prefix="bench-prepare-")
    try:
        texts = corpus(work, args.mb, args.files)
        megabytes = sum(len(t.encode()) for t in texts) / 1e6
        encoder = rust_encoder(args.tokenizer)
        encoder.encode_batch(texts[:64], add_special_tokens=False)  # warm-up
        start = time.perf_counter()
        floor_tokens = sum(len(e.ids) for e in encoder.encode_batch(texts, add_special_tokens=False))
        floor_s = time.perf_counter() - start
        rows = [("tokenizers encode_batch (in memory)", floor_tokens, floor_s)]
        for jobs in sorted({1, cores}):
            out = os.path.join(work, f"out{jobs}")
            start = time.perf_counter()
            prepare_data.main([os.path.join(work, "*.jsonl.zst"), "--out", out, "--tokenizer",
                               args.tokenizer, "--val-fraction", "0", "--jobs", str(jobs),
                               "--no-progress"])
            seconds = time.perf_counter() - start
            with open(os.path.join(out, "meta.json")) as f:
                meta = json.load(f)
            # Without the BOS and EOS each document gets, to count what the floor counts.
            tokens = meta["splits"]["train"]["tokens"] - 2 * meta["splits"]["train"]["documents"]
            rows.append((f"prepare_data --jobs {jobs} (.jsonl.zst -> .npy)", tokens, seconds))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{megabytes:.1f} MB of stdlib text, {len(texts):,} documents, tokenizer "
          f"{args.tokenizer}, {cores} core(s)")
    headers = ("what", "tokens", "seconds", "tokens/s", "tokens/s per core", "vs encode_batch")
    floor_rate = floor_tokens / floor_s
    table = [(what, f"{n:,}", f"{s:.2f}", f"{n / s:,.0f}", f"{n / s / cores:,.0f}",
              f"{n / s / floor_rate:.2f}") for what, n, s in rows]
    widths = [max(len(h), *(len(r[i]) for r in table)) for i, h in enumerate(headers)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in table:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    if any(n != floor_tokens for _, n, _ in rows):
        print("token counts differ from encode_batch's: the comparison is not like for like",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
