"""Bad input a user can fix, as one line.

``UserError`` is the one error type for it: a bad config, a folder that is not a run, a
checkpoint that cannot be read, a model that does not fit the data. Library code raises it
with a message that says what and where; only the command-line entry points turn it into
``error: <message>`` and an exit status. ``one_line`` shortens any exception's text for
such a message (Orbax's and TensorStore's run to pages).
"""
from __future__ import annotations

ONE_LINE_LIMIT = 300


class UserError(ValueError):
    """Bad input, reported as one line (exit status 2 at the CLIs)."""


class RunStoppedError(RuntimeError):
    """A run that has to stop on its way (non-finite steps, a checkpoint or metrics file
    that cannot be written, its folder gone), reported as one line (train.py exits 1);
    what was saved before it is untouched."""


def one_line(e: BaseException, limit: int = ONE_LINE_LIMIT, typed: bool = False) -> str:
    """The exception's text on one line (whitespace runs folded), cut at ``limit``
    characters; its type's name when it has no text, or before the text with ``typed``."""
    text = " ".join(str(e).split())
    text = text if len(text) <= limit else text[:limit] + "..."
    if typed:
        return f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text or type(e).__name__

