"""The pages that show measured tables (README.md and docs/**/*.md): where their marker
pairs stand, what belongs between them, and where pages and records disagree."""
from __future__ import annotations

import dataclasses
import pathlib
import re

from bench.results.records import NAME, RecordError, load, record_path, records_dir, render

OPEN = re.compile(r"<!-- results: (\S*) -->")
CLOSE = "<!-- /results -->"
FENCE = re.compile(r"(`{3,}|~{3,})")


@dataclasses.dataclass(frozen=True)
class Marker:
    name: str
    open_line: int   # 0-based index of `<!-- results: name -->`
    close_line: int  # 0-based index of `<!-- /results -->`


def pages(root: pathlib.Path) -> list[pathlib.Path]:
    root = pathlib.Path(root)
    readme = [root / "README.md"] if (root / "README.md").is_file() else []
    return readme + sorted((root / "docs").rglob("*.md"))


def markers(lines: list[str], rel: str) -> list[Marker]:
    """The marker pairs of a page's lines; a marker inside a fenced code block is an
    example, not a table."""
    found, opened, fence = [], None, None
    for i, line in enumerate(lines):
        text = line.strip()
        if m := FENCE.match(text):
            if fence is None:
                fence = m.group(1)
            elif text.startswith(fence) and not text.lstrip(fence[0]):
                fence = None
            continue
        if fence is not None:
            continue
        if text.startswith("<!-- results:"):
            m = OPEN.fullmatch(text)
            if not m or not NAME.fullmatch(m.group(1)):
                raise RecordError(f"{rel}:{i + 1}: {text!r} is no marker: write <!-- results: NAME --> "
                                  "with NAME lowercase words joined by '-'")
            if opened is not None:
                raise RecordError(f"{rel}:{opened[1] + 1}: <!-- results: {opened[0]} --> has no "
                                  f"{CLOSE} before the next marker")
            opened = (m.group(1), i)
        elif text == CLOSE:
            if opened is None:
                raise RecordError(f"{rel}:{i + 1}: {CLOSE} without a <!-- results: NAME --> above it")
            found.append(Marker(opened[0], opened[1], i))
            opened = None
    if opened is not None:
        raise RecordError(f"{rel}:{opened[1] + 1}: <!-- results: {opened[0]} --> has no {CLOSE}")
    return found


def _scan(root: pathlib.Path):
    """Per page: (path, rel, lines, {marker: (record, rendered block)}); `missing` lists the
    markers whose record does not exist, `used` every name a marker gives."""
    root = pathlib.Path(root)
    cache, scanned, missing, used = {}, [], [], set()
    for path in pages(root):
        rel = path.relative_to(root).as_posix()
        lines = path.read_text(encoding="utf-8").split("\n")
        blocks = {}
        for marker in markers(lines, rel):
            used.add(marker.name)
            if not record_path(root, marker.name).is_file():
                missing.append(f"missing record: {rel}:{marker.open_line + 1}: "
                               f"bench/records/{marker.name}.json does not exist")
                continue
            if marker.name not in cache:
                record = load(root, marker.name)
                cache[marker.name] = (record, render(marker.name, record))
            blocks[marker] = cache[marker.name]
        scanned.append((path, rel, lines, blocks))
    return scanned, missing, used


def _unused(root: pathlib.Path, used: set[str]) -> list[str]:
    """The records no marker names, each checked all the same: a record waiting for its page
    is still a record."""
    folder = records_dir(root)
    unused = [p.stem for p in sorted(folder.glob("*.json")) if p.stem not in used] if folder.is_dir() else []
    for name in unused:
        load(root, name)
    return [f"unused record: bench/records/{n}.json (no page has <!-- results: {n} -->)" for n in unused]


def stale_tables(root: pathlib.Path) -> list[str]:
    """Every table that differs from what its record renders to, every marker whose record
    is missing, every record no page shows: one line each, empty when all agree."""
    scanned, missing, used = _scan(root)
    stale = [f"stale: {rel}:{m.open_line + 1}: {m.name}"
             for _, rel, lines, blocks in scanned for m, (_, block) in blocks.items()
             if lines[m.open_line + 1:m.close_line] != block]
    return stale + missing + _unused(root, used)


def rewrite(root: pathlib.Path) -> tuple[list[str], list[str]]:
    """Rewrites every stale table; returns (the tables it changed, with their titles; the
    unused records). Writes nothing when a marker names a missing record or a record is
    malformed."""
    scanned, missing, used = _scan(root)
    if missing:
        raise RecordError(missing[0] + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    unused = _unused(root, used)  # checks them: an error writes nothing
    changed = []
    for path, rel, lines, blocks in scanned:
        stale = [m for m, (_, block) in blocks.items() if lines[m.open_line + 1:m.close_line] != block]
        if not stale:
            continue
        new = list(lines)
        # bottom up, so that a table's new length does not move the markers above it
        for m in reversed(stale):
            new[m.open_line + 1:m.close_line] = blocks[m][1]
        path.write_text("\n".join(new), encoding="utf-8")
        changed += [f"{rel}:{m.open_line + 1}: {m.name} ({blocks[m][0]['title']})" for m in stale]
    return changed, unused
