"""The fenced code blocks of README.md and docs/, as the docs tests read them.

A block runs as it is unless the line before its fence is ``<!-- not-run: REASON -->`` (it needs a
real cluster, GPUs, Docker, the whole public traces the benchmarks read, or it serves until
stopped); such a block is still checked: its shell syntax, every ``copse`` command's options (none
may be an old spelling), its manifests. A line ``<!-- file: NAME -->`` before a block says the
block is the file NAME that later commands use; ``<!-- output-of: COMMAND -->`` that the block is
what COMMAND prints (``...`` elides list items); ``<!-- excerpt-of: FILE -->`` that the block is
part of the repository file FILE (a manifest's fields, as the file has them).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)")
_MARK = re.compile(r"^\s*<!--\s*(?P<kind>not-run|file|output-of|excerpt-of):\s*(?P<value>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced code block."""

    path: Path
    line: int
    """1-based line of the opening fence."""
    language: str
    text: str
    not_run: str | None
    """Why the block is not run (None: it runs)."""
    file_name: str | None
    """The file this block is, for the commands after it."""
    output_of: str | None = None
    """The command whose output this block shows (the docs tests run it and compare)."""
    excerpt_of: str | None = None
    """The repository file (relative to the root) this block is part of."""

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def documents() -> list[Path]:
    """README.md and every Markdown page of the docs site."""
    return [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "hooks" not in p.parts)]


def blocks(path: Path) -> Iterator[Block]:
    lines = path.read_text().splitlines()
    index = 0
    while index < len(lines):
        match = _FENCE.match(lines[index])
        if not match:
            index += 1
            continue
        start, indent = index, match.group("indent")
        marks = {}
        back = start - 1
        while back >= 0 and (mark := _MARK.match(lines[back])):
            marks[mark.group("kind")] = mark.group("value")
            back -= 1
        body = []
        index += 1
        while index < len(lines) and lines[index].strip() != "```":
            body.append(lines[index][len(indent) :] if lines[index].startswith(indent) else lines[index])
            index += 1
        index += 1
        yield Block(
            path=path,
            line=start + 1,
            language=match.group("lang").lower(),
            text="\n".join(body) + "\n",
            not_run=marks.get("not-run"),
            file_name=marks.get("file"),
            output_of=marks.get("output-of"),
            excerpt_of=marks.get("excerpt-of"),
        )


def all_blocks() -> list[Block]:
    return [block for path in documents() for block in blocks(path)]


def commands(shell: str) -> list[list[str]]:
    """The simple commands of a shell block: lines joined at ``\\``, comments dropped, split at
    ``&&``, ``||``, ``;``, ``|`` and ``&``; ``eval``, ``time`` and ``nice`` prefixes removed."""
    logical = shell.replace("\\\n", " ")
    found: list[list[str]] = []
    for line in logical.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        current: list[str] = []
        for token in lexer:
            if token and set(token) <= set(";&|"):
                if current:
                    found.append(current)
                current = []
            else:
                current.append(token)
        if current:
            found.append(current)
    return found


def copse_args(command: list[str]) -> list[str] | None:
    """The arguments after ``copse`` (or ``.venv/bin/copse``), None for another program."""
    words = list(command)
    while words:
        if words[0] == "nice" and words[1:2] == ["-n"]:
            words = words[3:]
        elif words[0] in {"time", "nice"} or ("=" in words[0] and not words[0].startswith("-")):
            words = words[1:]  # prefixes, VAR=value assignments
        else:
            break
    if words and Path(words[0]).name == "copse":
        return words[1:]
    return None
