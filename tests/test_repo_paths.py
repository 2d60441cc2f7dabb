"""The repository stands alone: what its text names exists in it, and it names nothing outside.

- Every repository path that code, comments, docstrings, configs and docs name
  (`lp_jax/numerics/quantize.py`, `docs/numerics.md`, `configs/llama3_8b_*.yaml`, ...)
  exists, and so does every file a Markdown page names by its bare name (`head_gemm.py`)
  or links to (with the heading an `#anchor` points at).
- Every module that a `python -m ...` command or a dotted `lp_jax.*` name refers to can be
  found (after a move, `python -m lp_jax.generate` would fail here).
- No tracked text names a development machine's folders (absolute work or home folders, or
  a sibling folder of notes kept beside the checkout) or an outside document as a source
  (an issue tracker's text, the paper a study reproduces).

The tree is read when the test runs, so a page added on another branch counts once it is
merged; PENDING lists the few names allowed to be missing until then.
"""
from __future__ import annotations

import fnmatch
import importlib
import importlib.util
import itertools
import os
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Top-level folders whose paths the text names (a path must start with one of them).
TOP_DIRS = ("lp_jax", "models", "tests", "bench", "configs", "scripts", "docs", ".ci")
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt", ".json", ".cfg", ".ini"}
TEXT_NAMES = {".gitignore", ".python-version", "run"}  # .ci/run has no suffix

# Named but allowed to be missing, each with its reason. Keep this short.
PENDING: dict[str, str] = {}
# Files where a forbidden-looking string is not what it looks like.
EXEMPT = {
    ".gitignore": "'/tmp/' is a pattern anchored at the repository root, not a machine path",
}
# This file is not scanned at all: its examples name missing paths and outside sources.
SELF = pathlib.Path(__file__).resolve().relative_to(ROOT).as_posix()

# Absolute folders of a development machine, and the sibling folder of outside notes.
MACHINE_PATH = re.compile(r"\.\./shared\b|(?<![\w.$~-])/(?:work|root|home|Users|mnt|scratch|tmp)/"
                          r"|\b[A-Za-z]:\\\\?Users\\")
# An outside document cited as a source.
OUTSIDE_SOURCE = re.compile(
    r"(?i:\bthe issue\b|\bissue \d+\b|\bissue targets?\b|\bseed paper\b|\bdevice (?:tool's )?README\b"
    r"|\bthe seed(?:'s)? (?:paper|study|results?|tables?|figures?|does|do|reports?)\b)"
    r"|\b(?:NUMERICS|DATA|DESIGN|JAX_NOTES)\.md\b")

# A path starting at a top-level folder. Globs (*), {a,b} alternatives and {name}
# placeholders of f-strings are allowed; it ends at anything that cannot be in a path.
REPO_PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w.*{},/-]*)" % "|".join(re.escape(d) for d in TOP_DIRS))
BARE_NAME = re.compile(r"(?<![\w./-])([A-Za-z_][\w-]*\.(?:py|md))\b")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
PYTHON_M = re.compile(r"python3? -m ([A-Za-z_][\w.]*)")
DOTTED = re.compile(r"(?<![\w./-])(lp_jax(?:\.[A-Za-z_]\w*)+)")


def _tracked_files() -> list[str]:
    """Tracked files and new ones git does not ignore, '/'-separated; without git (an
    exported tree), every file outside the ignored folders."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, check=True)
        names = [n for n in out.stdout.decode().split("\0") if n]
        if names:
            return [n for n in names if (ROOT / n).is_file()]  # a deleted, uncommitted file is gone
    except (OSError, subprocess.CalledProcessError):
        pass
    skip = {".git", ".venv", ".venv311", "runs", "__pycache__", ".pytest_cache", "build"}
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in skip and not d.endswith(".egg-info")]
        found += [pathlib.Path(folder, f).relative_to(ROOT).as_posix() for f in files]
    return found


FILES = _tracked_files()
FILE_SET = set(FILES)
DIRS = {"/".join(f.split("/")[:i]) for f in FILES for i in range(1, f.count("/") + 1)}
BASENAMES = {f.rsplit("/", 1)[-1] for f in FILES}


def _text(rel: str) -> str | None:
    path = ROOT / rel
    if path.suffix not in TEXT_SUFFIXES and path.name not in TEXT_NAMES:
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None
    return None if "\0" in text else text


TEXTS = {rel: t for rel in FILES if rel != SELF and (t := _text(rel)) is not None}
# Test fixtures are benchmark documents and model files: data, not the project's prose.
PROSE = {rel: t for rel, t in TEXTS.items() if not rel.startswith("tests/fixtures/")}


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _alternatives(pattern: str) -> list[str]:
    """`a/{b,c}.md` -> [`a/b.md`, `a/c.md`]; `{name}` (an f-string field) -> `*`."""
    parts = re.split(r"(\{[^{}]*\})", pattern)
    choices = []
    for part in parts:
        if part.startswith("{") and part.endswith("}"):
            inner = part[1:-1]
            choices.append(inner.split(",") if "," in inner else ["*"])
        else:
            choices.append([part])
    return ["".join(c) for c in itertools.product(*choices)]


def _exists(path: str) -> bool:
    path = path.rstrip("/")
    if any(ch in path for ch in "*?["):
        return any(fnmatch.fnmatchcase(f, path) for f in FILES) or \
            any(fnmatch.fnmatchcase(d, path) for d in DIRS)
    return path in FILE_SET or path in DIRS or f"{path}.py" in FILE_SET


def _clean(path: str) -> str:
    """Drops what the regex took in but a sentence put there: a trailing dot or comma,
    an unmatched closing brace."""
    path = path.rstrip(".,")
    while path.count("}") > path.count("{"):
        path = path[: path.rindex("}")]
    return path.rstrip(".,")


def test_named_repository_paths_exist():
    missing = []
    for rel, text in PROSE.items():
        for m in REPO_PATH.finditer(text):
            raw = _clean(m.group(1))
            if raw in PENDING:
                continue
            if text[m.end(1):m.end(1) + 1] == "\\":
                raw += "*"  # a regular expression's literal prefix: some path must start so
            if not all(_exists(p) for p in _alternatives(raw)):
                missing.append(f"{rel}:{_line_of(text, m.start())}: {raw}")
    assert not missing, "paths named but not in the repository:\n" + "\n".join(missing)


def test_markdown_names_and_links_lead_somewhere():
    pending_names = {p.rsplit("/", 1)[-1] for p in PENDING}
    missing = []
    for rel, text in PROSE.items():
        if not rel.endswith(".md"):
            continue
        for m in BARE_NAME.finditer(text):
            name = m.group(1)
            if name not in BASENAMES and name not in pending_names:
                missing.append(f"{rel}:{_line_of(text, m.start())}: {name} (no such file)")
        for m in MD_LINK.finditer(text):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (pathlib.PurePosixPath(rel).parent / file_part).as_posix() if file_part else rel
            dest = os.path.normpath(dest).replace(os.sep, "/")
            where = f"{rel}:{_line_of(text, m.start())}: ({target})"
            if dest in PENDING:
                continue
            if dest not in FILE_SET and dest not in DIRS:
                missing.append(f"{where} leads nowhere")
            elif anchor and dest.endswith(".md") and anchor not in _anchors(TEXTS[dest]):
                missing.append(f"{where}: no heading #{anchor} in {dest}")
    assert not missing, "\n".join(missing)


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to '-'."""
    out = set()
    for line in markdown.splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            out.add(slug)
    return out


def test_named_modules_can_be_found():
    """`python -m X` and dotted `lp_jax.*` names resolve to a module, or to an attribute of
    one (lp_jax.apply_recipe)."""
    names = {}
    for rel, text in PROSE.items():
        for m in itertools.chain(PYTHON_M.finditer(text), DOTTED.finditer(text)):
            names.setdefault(m.group(1).rstrip("."), f"{rel}:{_line_of(text, m.start())}")
    bad = [f"{where}: {name}" for name, where in sorted(names.items()) if not _resolves(name)]
    assert not bad, "modules or names that do not exist:\n" + "\n".join(bad)


def _resolves(dotted: str) -> bool:
    if dotted.split(".")[0] not in ("lp_jax", "models", "bench", "tests"):
        return True  # another project's module: not ours to check
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            if importlib.util.find_spec(name) is None:
                continue
        except (ImportError, ValueError):  # a parent is not a package
            continue
        obj = importlib.import_module(name)
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("which", ["machine paths", "outside sources"])
def test_nothing_points_outside_the_repository(which):
    # Machine paths are searched in every text file, fixtures included (a saved config can
    # record where it was written); outside sources in the project's own text only.
    pattern, texts = (MACHINE_PATH, TEXTS) if which == "machine paths" else (OUTSIDE_SOURCE, PROSE)
    found = []
    for rel, text in texts.items():
        if rel in EXEMPT:
            continue
        for m in pattern.finditer(text):
            line = text.splitlines()[_line_of(text, m.start()) - 1].strip()
            found.append(f"{rel}:{_line_of(text, m.start())}: {line[:120]}")
    assert not found, "\n".join(found)


def test_the_checks_catch_what_they_are_for():
    """The patterns themselves: each catches its case and passes its look-alike."""
    # Built from parts, so that this file itself names no machine folder.
    slash = "/"
    assert MACHINE_PATH.search(f"see {slash}work{slash}main/lp_jax")
    assert MACHINE_PATH.search(f"`..{slash}shared{slash}notes.md`")
    assert MACHINE_PATH.search(f"python3.11 -m venv {slash}root{slash}venv")
    assert not MACHINE_PATH.search(f"runs/study{slash}work{slash}x") and not MACHINE_PATH.search("$SHARED_FS/runs/8b")
    for cited in ("Floors from the issue", "the seed paper's", "as eval.py and the seed do",
                  "issue 5's contract", "carry wheels as the device README says"):
        assert OUTSIDE_SOURCE.search(cited), cited
    assert OUTSIDE_SOURCE.search("quoted from NUMERICS.md") and not OUTSIDE_SOURCE.search("docs/numerics.md")
    assert not OUTSIDE_SOURCE.search("seeds 0 to 3 (the seed sets the initial weights)")
    assert REPO_PATH.findall("(`lp_jax/numerics/quantize.py`, docs/numerics.md.)") == \
        ["lp_jax/numerics/quantize.py", "docs/numerics.md."]
    assert _alternatives("docs/{a,b}.md") == ["docs/a.md", "docs/b.md"]
    assert _alternatives("configs/llama3_8b_{recipe}.yaml") == ["configs/llama3_8b_*.yaml"]
    assert _exists("configs/llama3_8b_*.yaml") and _exists("lp_jax/numerics/") and _exists("models/llama")
    assert not _exists("lp_jax/quantize.py") and not _resolves("lp_jax.generate")
    assert _resolves("lp_jax.evaluation.generate") and _resolves("lp_jax.apply_recipe")
    assert {"where-the-weight-gradient-goes", "platform-notes-subnormals-on-cpu"} <= \
        _anchors(TEXTS["docs/numerics.md"])
