"""A Hugging Face tokenizer whose Rust code panics, as one line.

The ``tokenizers`` package runs a tokenizer.json's pre-tokenizer regexes with Oniguruma,
which gives up on a regex that backtracks without end ("retry-limit-in-match over") by
panicking. The panic reaches Python as ``pyo3_runtime.PanicException`` (a BaseException,
so nothing that catches Exception stops it), but Rust's panic hook has already printed its
report on the process's stderr: a few lines, a whole backtrace under RUST_BACKTRACE=1.
Neither ``tokenizers`` nor pyo3 offers a way to quiet that hook. So a tokenizer is tried
on probe texts when it is loaded, with file descriptor 2 held in a temporary file for
those few encodes (``probe_panic``): a regex that breaks on them is refused in one line
before any work, and Rust's report of it is dropped. A panic on a later text, one the
probes did not foresee, still becomes one line (``TokenizerPanic``), after Rust's report.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from typing import Callable, Iterator, Sequence

# Runs of one character of each kind, bare and followed by one that ends no run: the texts
# on which nested quantifiers (``(\w+)+$``, ``((a+)+)+b``) backtrack without end. 48
# characters are well past where Oniguruma's retry limit stops such a regex.
_RUN = 48
PROBES: tuple[str, ...] = tuple(
    text for ch in ("a", "Z", "é", "中", "1", " ", "\t", "\n", ".", "'", "-", "_")
    for text in (ch * _RUN, ch * _RUN + "!", ch * _RUN + "a"))


class TokenizerPanic(ValueError):
    """A tokenizer's Rust code panicked on a text (one line)."""


def is_panic(e: BaseException) -> bool:
    # pyo3 makes the class at run time; it is importable only from pyo3_runtime, which
    # exists once a pyo3 module is loaded.
    return type(e).__name__ == "PanicException"


def reason(e: BaseException) -> str:
    """What the panic says, and what it means when it is Oniguruma's retry limit."""
    text = " ".join(str(e).split()) or "no message"
    if "retry-limit-in-match" in text:
        return (f"its pre-tokenizer regex backtracks without end (Rust panicked: {text}); fix "
                "or remove the regex")
    return f"Rust panicked: {text}"


@contextlib.contextmanager
def as_error(path) -> Iterator[None]:
    """A panic of the tokenizer file ``path``'s Rust code inside the block becomes a
    one-line ``TokenizerPanic``; anything else passes as it is."""
    try:
        yield
    except BaseException as e:
        if not is_panic(e):
            raise
        raise TokenizerPanic(f"tokenizer file {str(path)!r} cannot encode a text: "
                             f"{reason(e)}") from None


def probe_panic(encode: Callable[[str], object], probes: Sequence[str] = PROBES) -> str | None:
    """``encode`` on each probe text, with stderr held: None when none panics, else the
    text and the reason, in words. What other threads write meanwhile is written out after,
    unless a probe panicked (then the held text is Rust's report, dropped with it)."""
    with _stderr_held() as held:
        for text in probes:
            try:
                encode(text)
            except BaseException as e:  # PanicException is a BaseException
                if not is_panic(e):
                    raise
                held.clear()
                return f"on {describe(text)}: {reason(e)}"
    return None


def describe(text: str) -> str:
    """A probe text in words: ``'a' 48 times, then '!'``."""
    run = len(text) - len(text.lstrip(text[0]))
    rest = f", then {text[run:]!r}" if run < len(text) else ""
    return f"{text[0]!r} {run} times{rest}"


class _Held:
    def __init__(self):
        self.dropped = False

    def clear(self) -> None:
        self.dropped = True


@contextlib.contextmanager
def _stderr_held() -> Iterator[_Held]:
    """File descriptor 2 goes to a temporary file inside the block; on the way out it is
    restored and what was written there is passed on, unless ``clear`` was called."""
    try:
        if sys.stderr is not None:
            sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no stderr to hold (closed): encode without
        yield _Held()
        return
    with tempfile.TemporaryFile() as file:
        held = _Held()
        os.dup2(file.fileno(), 2)
        try:
            yield held
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            if not held.dropped:
                file.seek(0)
                data = memoryview(file.read())
                while data:
                    data = data[os.write(2, data):]
