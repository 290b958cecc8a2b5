"""Reading component logs for error messages and failed-test reports."""

from __future__ import annotations

from collections import deque
from pathlib import Path


def tail(path: Path, *, lines: int = 40) -> str:
    """The last ``lines`` lines of a text file, or a note saying it does not exist."""
    if not path.is_file():
        return f"(no log at {path})"
    with path.open("r", errors="replace") as handle:
        return "".join(deque(handle, maxlen=lines))
