"""python -m bench.results [--check]: see bench/results/__init__.py."""
from __future__ import annotations

import argparse
import pathlib
import sys

from bench.results.pages import rewrite, stale_tables
from bench.results.records import RecordError
from bench.results.writer import ROOT


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.results",
                                 description="Write the docs' measured tables from bench/records.")
    ap.add_argument("--check", action="store_true",
                    help="rewrite nothing; exit 1 listing every stale table, missing and unused record")
    ap.add_argument("--root", type=pathlib.Path, default=ROOT, help="the repository (default: this one)")
    args = ap.parse_args(argv)
    try:
        if args.check:
            problems = stale_tables(args.root)
            for line in problems:
                print(line)
            if problems:
                print("run `python -m bench.results` to rewrite the stale tables", file=sys.stderr)
                return 1
            print("every table matches its record")
            return 0
        changed, unused = rewrite(args.root)
    except (RecordError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in changed:
        print(f"rewrote {line}")
    for line in unused:
        print(line, file=sys.stderr)
    if not changed:
        print("every table matches its record")
    return 0


if __name__ == "__main__":
    sys.exit(main())
