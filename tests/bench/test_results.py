"""python -m bench.results: the committed pages are what their records render to, and the
script renders, checks and refuses as bench/results/__init__.py says."""
from __future__ import annotations

import json
import pathlib
import subprocess

import pytest

from bench.results import RecordError, render, rewrite, stale_tables, validate, write_record
from bench.results.__main__ import main
from bench.results.writer import dumps

ROOT = pathlib.Path(__file__).resolve().parents[2]

RECORD = {
    "title": "Quantize + dequantize, 4096x4096 bf16",
    "command": "python bench/bench_quantize.py --size 4096",
    "commit": "abc1234",
    "jax": "0.12.1",
    "where": "2-core CPU machine",
    "estimate": False,
    "columns": ["format", "ms", "x plain"],
    "rows": [["mxfp8", "16.48", "**1.42**"], ["nvfp4", "20.10", "1.73"]],
}
# The temporary repositories' pages and records, named in parts: tests/test_repo_paths.py
# reads a whole name as a path this repository must hold.
A, B, RECS = "docs/" + "a.md", "docs/" + "sub/b.md", "bench/records/"
PAGE = "# Page\n\nText above.\n\n<!-- results: quantize-cpu -->\n<!-- /results -->\n\nText below.\n"


def test_the_committed_pages_are_what_their_records_render_to():
    problems = stale_tables(ROOT)
    assert not problems, "\n".join([*problems, "run `python -m bench.results` and commit the pages"])


def _repo(tmp_path, pages=None, records=None):
    for rel, text in (pages if pages is not None else {A: PAGE}).items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "bench/records").mkdir(parents=True, exist_ok=True)
    for name, record in (records if records is not None else {"quantize-cpu": RECORD}).items():
        text = record if isinstance(record, str) else json.dumps(record)
        (tmp_path / f"bench/records/{name}.json").write_text(text)
    return tmp_path


def test_a_table_renders_between_its_markers_and_then_checks_clean(tmp_path):
    root = _repo(tmp_path, pages={"README.md": PAGE, B: PAGE})
    assert stale_tables(root) == ["stale: README.md:5: quantize-cpu", f"stale: {B}:5: quantize-cpu"]
    changed, unused = rewrite(root)
    table = f"quantize-cpu ({RECORD['title']})"
    assert changed == [f"README.md:5: {table}", f"{B}:5: {table}"] and unused == []
    text = (root / "README.md").read_text()
    assert text.startswith("# Page\n\nText above.\n\n<!-- results: quantize-cpu -->\n\n")
    assert text.endswith("\n\n<!-- /results -->\n\nText below.\n")
    table = "| format | ms | x plain |\n|---|---|---|\n| mxfp8 | 16.48 | **1.42** |\n| nvfp4 | 20.10 | 1.73 |\n"
    assert f"<!-- results: quantize-cpu -->\n\n{table}\n<sub>Measured" in text
    assert ("<sub>Measured with `python bench/bench_quantize.py --size 4096` at commit `abc1234` "
            "(JAX 0.12.1; 2-core CPU machine). Written by `python -m bench.results` from "
            f"`{RECS}quantize-cpu.json`.</sub>\n") in text
    assert (root / B).read_text() == text
    assert stale_tables(root) == []


def test_rewriting_twice_changes_nothing(tmp_path):
    root = _repo(tmp_path, records={"quantize-cpu": {**RECORD, "note": "One sentence."}})
    rewrite(root)
    first = (root / A).read_bytes()
    assert rewrite(root) == ([], [])
    assert (root / A).read_bytes() == first
    assert first.decode().count("One sentence.") == 1


def test_a_table_edited_by_hand_is_stale_and_rewritten(tmp_path):
    root = _repo(tmp_path)
    rewrite(root)
    page = root / A
    page.write_text(page.read_text().replace("16.48", "15.00"))
    assert stale_tables(root) == [f"stale: {A}:5: quantize-cpu"]
    assert main(["--check", "--root", str(root)]) == 1
    assert main(["--root", str(root)]) == 0
    assert "16.48" in page.read_text() and "15.00" not in page.read_text()


def test_estimates_are_labelled_in_the_stamp_and_their_columns():
    lines = render("plan-8b", {**RECORD, "estimate": True, "estimate_columns": ["ms"], "jax": None})
    assert "| format | ms (est.) | x plain |" in lines
    stamp = next(line for line in lines if line.startswith("<sub>"))
    assert stamp.startswith("<sub>**Estimates, not GPU measurements**: computed with `python bench/")
    assert "(JAX version not recorded; 2-core CPU machine)" in stamp
    assert "Measured" not in "\n".join(lines)


def test_a_marker_without_its_record(tmp_path):
    other = PAGE.replace("quantize-cpu", "no-such-table")
    root = _repo(tmp_path, pages={"README.md": PAGE, A: other})
    assert stale_tables(root) == [
        "stale: README.md:5: quantize-cpu",
        f"missing record: {A}:5: {RECS}no-such-table.json does not exist"]
    with pytest.raises(RecordError, match="no-such-table.json does not exist"):
        rewrite(root)
    assert (root / "README.md").read_text() == PAGE  # nothing written
    assert main(["--root", str(root)]) == 2


def test_a_record_no_page_uses(tmp_path, capsys):
    root = _repo(tmp_path, records={"quantize-cpu": RECORD, "old-table": RECORD})
    rewrite(root)
    assert stale_tables(root) == [
        f"unused record: {RECS}old-table.json (no page has <!-- results: old-table -->)"]
    assert main(["--check", "--root", str(root)]) == 1
    assert f"unused record: {RECS}old-table.json" in capsys.readouterr().out


@pytest.mark.parametrize("record, problem", [
    ({k: v for k, v in RECORD.items() if k != "commit"}, "missing key commit"),
    ({**RECORD, "figures": []}, "unknown key figures"),
    ({**RECORD, "rows": [["mxfp8", "16.48"]]}, "row 0 has 2 cells for 3 columns"),
    ({**RECORD, "rows": [["mxfp8", 16.48, "1.42"]]}, "row 0, column 'ms': 16.48 is float, not a string"),
    ({**RECORD, "estimate": "yes"}, "'estimate' is str, not true or false"),
    ({**RECORD, "commit": "today"}, "'commit' 'today' is not a short commit hash"),
    ({**RECORD, "estimate_columns": ["ms"]}, "'estimate_columns' needs \"estimate\": true"),
    ({**RECORD, "estimate": True, "estimate_columns": ["s"]}, "names 's', not in 'columns'"),
    ({**RECORD, "rows": [["a|b", "1", "2"]]}, "unescaped '|'"),
    ({**RECORD, "note": "two\nlines"}, "'note' holds a newline"),
    ('{"title": ', f"{RECS}quantize-cpu.json: Expecting value"),
])
def test_a_malformed_record_is_one_line_naming_the_file(tmp_path, capsys, record, problem):
    root = _repo(tmp_path, records={"quantize-cpu": record})
    with pytest.raises(RecordError) as err:
        stale_tables(root)
    message = str(err.value)
    assert message.startswith(f"{RECS}quantize-cpu.json: ") and problem in message
    assert "\n" not in message
    assert main(["--check", "--root", str(root)]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_an_unused_record_is_checked_too(tmp_path):
    root = _repo(tmp_path, records={"quantize-cpu": RECORD, "old-table": {**RECORD, "rows": [["1"]]}})
    with pytest.raises(RecordError, match="old-table.json: row 0 has 1 cells for 3 columns"):
        stale_tables(root)


@pytest.mark.parametrize("page, problem", [
    ("<!-- results: a -->\n", f"{A}:1: <!-- results: a --> has no <!-- /results -->"),
    ("<!-- /results -->\n", f"{A}:1: <!-- /results --> without"),
    ("<!-- results: A_b -->\n<!-- /results -->\n", f"{A}:1: '<!-- results: A_b -->' is no marker"),
])
def test_a_broken_marker_pair_is_an_error(tmp_path, page, problem):
    root = _repo(tmp_path, pages={A: page}, records={})
    with pytest.raises(RecordError, match=problem.replace("(", r"\(")):
        stale_tables(root)


def test_a_marker_in_a_code_block_is_an_example(tmp_path):
    page = "```\n<!-- results: quantize-cpu -->\n<!-- /results -->\n```\n"
    root = _repo(tmp_path, pages={A: page}, records={})
    assert stale_tables(root) == [] and rewrite(root) == ([], [])


def _git(root, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root,
                   check=True, capture_output=True)


def test_write_record_stamps_the_commit_and_jax(tmp_path):
    _repo(tmp_path, records={})
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", A)
    _git(tmp_path, "commit", "-q", "-m", "page")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                          text=True, check=True).stdout.strip()
    path = write_record("quantize-cpu", RECORD["title"], RECORD["command"], RECORD["columns"],
                        [tuple(r) for r in RECORD["rows"]], "2-core CPU machine", root=tmp_path)
    record = json.loads(path.read_text())
    assert path == tmp_path / RECS / "quantize-cpu.json"
    assert record["commit"] == head and record["jax"] and record["rows"] == RECORD["rows"]
    assert validate(record, "x") == record and path.read_text() == dumps(record)
    assert rewrite(tmp_path)[0] == [f"{A}:5: quantize-cpu ({RECORD['title']})"]  # the page is now edited
    write_record("quantize-cpu", "t", "c", ["a"], [["1"]], "w", estimate=True, estimate_columns=["a"],
                 note="n.", root=tmp_path)
    record = json.loads(path.read_text())
    assert record["commit"] == f"{head}-dirty" and record["estimate_columns"] == ["a"]
    with pytest.raises(RecordError, match="not a string"):
        write_record("quantize-cpu", "t", "c", ["a"], [[1.0]], "w", root=tmp_path)
    with pytest.raises(RecordError, match="lowercase words"):
        write_record("Quantize_CPU", "t", "c", ["a"], [["1"]], "w", root=tmp_path)
