"""The measured tables of README.md and docs/**/*.md, written from JSON records.

    python -m bench.results            # rewrite every stale table, print which changed
    python -m bench.results --check    # rewrite nothing; exit 1 listing stale tables,
                                       # markers without a record, records without a page

A table's figures live in `bench/records/<name>.json` (name: lowercase words joined by
`-`); a page shows it through a marker pair on their own lines,

    <!-- results: <name> -->
    <!-- /results -->

and the script writes between them the markdown table, then a stamp line naming the
command, the commit and the JAX version that produced the figures, then the record's note.
A record's keys:

    title             short string naming the table (in the script's output, not the page)
    command           the exact command that measured it
    commit            short hash of the commit it was measured at (`-dirty`: uncommitted edits)
    jax               the JAX version, or null when unknown
    where             the machine ("2-core CPU machine", "deviceless compile for a GB200")
    estimate          true when the figures are estimated, not measured on a GPU: the stamp
                      then begins "**Estimates, not GPU measurements**"
    columns           the header strings
    rows              lists of cell strings, exactly as they print ("16.48", "**1.42**")
    note              optional: one sentence printed under the stamp
    estimate_columns  optional, with estimate true: the columns whose header gets " (est.)",
                      when a table sets estimates beside measured figures

Adding or refreshing a table:

1. Measure. A benchmark writes its table as a record with `--record NAME`
   (`python bench/bench_quantize.py --record quantize-cpu`); other code calls
   `bench.results.write_record(name, title, command, columns, rows, where, estimate=...)`,
   which fills in the commit (`git rev-parse --short HEAD`) and the installed JAX. A figure
   measured by hand goes into a record written by hand, with the command and commit that
   produced it.
2. Put the marker pair where the table belongs (new tables only).
3. Run `python -m bench.results`, and commit the record and the pages together:
   tests/bench/test_results.py fails while a page differs from what its record renders to.
"""
from bench.results.pages import rewrite, stale_tables
from bench.results.records import RecordError, render, validate
from bench.results.writer import machine, write_record

__all__ = ["RecordError", "machine", "render", "rewrite", "stale_tables", "validate", "write_record"]
