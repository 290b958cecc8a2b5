"""Request traces: one reader for the Mooncake JSONL and Azure CSV formats.

Mooncake: one JSON object a line, ``{"timestamp": ms since the trace's start, "input_length",
"output_length", "hash_ids": [...]}``, one prefix-chained hash id per 512 prompt tokens (the last
block may be partial). Azure: CSV with ``TIMESTAMP,ContextTokens,GeneratedTokens``; no prefix
information. Either may be gzipped (recognised by content, not by name). Every problem raises
:class:`TraceError` naming the file and the line.
"""

from __future__ import annotations

import calendar
import csv
import dataclasses
import gzip
import io
import json
import math
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, Literal

TraceFormat = Literal["mooncake", "azure"]
TRACE_FORMATS: tuple[TraceFormat, ...] = ("mooncake", "azure")
#: Tokens per ``hash_ids`` entry in the published Mooncake traces.
MOONCAKE_BLOCK_TOKENS = 512
AZURE_COLUMNS: tuple[str, ...] = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
    """A trace that cannot be used; the message names the file and the line."""


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request as the trace gives it."""

    timestamp_ms: float
    """Arrival, ms after the trace's start (Mooncake: as written; Azure: after the earliest row)."""
    input_length: int
    output_length: int
    """As written; Azure traces hold requests that generated nothing (0)."""
    hash_ids: tuple[int, ...] | None
    """One prefix-chained id per block of prompt tokens; None when the format has none (Azure)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Trace:
    """A whole trace: its records in arrival order (ties in file order)."""

    format: TraceFormat
    records: list[TraceRecord]
    start_unix_s: float
    """POSIX time of ``timestamp_ms == 0`` where the trace gives wall-clock times (Azure, read as
    UTC), else 0: lets a consumer report real dates."""


def open_text(path: Path, *, kind: str = "trace") -> IO[str]:
    """``path`` as UTF-8 text, through gzip when its content is gzip (a ``kind`` file names it in errors)."""
    if not path.is_file():
        raise TraceError(f"{path}: no such {kind} file")
    try:
        with path.open("rb") as probe:
            gzipped = probe.read(2) == b"\x1f\x8b"
        if gzipped:
            return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
        return path.open(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror}") from exc


def text_lines(path: Path, *, kind: str = "trace") -> Iterator[tuple[int, str]]:
    """The non-blank lines of ``path`` with their 1-based numbers."""
    with open_text(path, kind=kind) as handle:
        try:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    yield number, line
        except (OSError, EOFError, UnicodeDecodeError) as exc:
            raise TraceError(f"{path}: cannot read: {exc}") from exc


def read_trace(
    path: str | Path, *, fmt: TraceFormat | None = None, block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> Trace:
    """Every request of a trace, sorted by arrival (stable).

    ``fmt`` None tells the format by the first line (a JSON object: Mooncake). ``block_tokens`` is
    the prompt tokens per Mooncake hash id: each line must have ``ceil(input_length / block_tokens)``.
    """
    path = Path(path)
    if block_tokens < 1:
        raise TraceError(f"{path}: tokens per hash id must be at least 1, got {block_tokens}")
    lines = text_lines(path)
    first = next(lines, None)
    if first is None:
        raise TraceError(f"{path}: empty file: no requests")
    detected = fmt is None
    if fmt is None:
        fmt = "mooncake" if first[1].lstrip().startswith("{") else "azure"
    rows = _prepend(first, lines)
    if fmt == "mooncake":
        records = [_mooncake(f"{path}:{number}", line, block_tokens) for number, line in rows]
        start_unix_s = 0.0
    else:
        records, start_unix_s = _azure(path, rows, detected=detected)
    records.sort(key=lambda r: r.timestamp_ms)
    return Trace(format=fmt, records=records, start_unix_s=start_unix_s)


def _prepend(first: tuple[int, str], rest: Iterator[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    yield first
    yield from rest


def _count(where: str, record: dict[str, Any], key: str, *, minimum: int) -> int:
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(f"{where}: {key} must be an integer, got {value!r}")
    if value < minimum:
        raise TraceError(f"{where}: {key} must be at least {minimum}, got {value}")
    return value


def _mooncake(where: str, line: str, block_tokens: int) -> TraceRecord:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg})") from exc
    if not isinstance(record, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for key in _MOONCAKE_KEYS:
        if key not in record:
            raise TraceError(
                f"{where}: missing {key} (a Mooncake trace line has {', '.join(_MOONCAKE_KEYS)})"
            )
    timestamp = record["timestamp"]
    if (
        isinstance(timestamp, bool)
        or not isinstance(timestamp, int | float)
        or not math.isfinite(timestamp)
        or timestamp < 0
    ):
        raise TraceError(f"{where}: timestamp must be a finite, non-negative number of ms, got {timestamp!r}")
    input_length = _count(where, record, "input_length", minimum=1)
    output_length = _count(where, record, "output_length", minimum=0)
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids
    ):
        raise TraceError(f"{where}: hash_ids must be a list of non-negative integers, got {hash_ids!r}")
    blocks = -(-input_length // block_tokens)
    if len(hash_ids) != blocks:
        raise TraceError(
            f"{where}: {len(hash_ids)} hash_ids for input_length {input_length}; with {block_tokens} "
            f"tokens per hash id there must be {blocks}"
        )
    return TraceRecord(
        timestamp_ms=float(timestamp),
        input_length=input_length,
        output_length=output_length,
        hash_ids=tuple(hash_ids),
    )


def _azure(path: Path, rows: Iterator[tuple[int, str]], *, detected: bool) -> tuple[list[TraceRecord], float]:
    number, header_line = next(rows)
    header = next(csv.reader([header_line]))
    missing = [column for column in AZURE_COLUMNS if column not in header]
    if missing:
        what = (
            "the first line is neither a Mooncake JSON object nor an Azure CSV header"
            if detected
            else "the first line is not an Azure CSV header"
        )
        raise TraceError(
            f"{path}:{number}: not a trace: {what} with {', '.join(AZURE_COLUMNS)} "
            f"(missing column {', '.join(missing)})"
        )
    index = {column: header.index(column) for column in AZURE_COLUMNS}
    parsed: list[tuple[datetime, int, int]] = []
    for number, line in rows:
        where = f"{path}:{number}"
        row = next(csv.reader([line]))
        if len(row) != len(header):
            raise TraceError(f"{where}: {len(row)} columns, the header has {len(header)}")
        text = row[index["TIMESTAMP"]]
        try:
            # Python keeps microseconds of the traces' seven fractional digits.
            stamp = datetime.fromisoformat(text.strip())
        except ValueError as exc:
            raise TraceError(f"{where}: TIMESTAMP {text!r} is not a date-time") from exc
        if stamp.tzinfo is not None:
            stamp = stamp.astimezone(UTC).replace(tzinfo=None)
        tokens = []
        for column in ("ContextTokens", "GeneratedTokens"):
            value = row[index[column]].strip()
            if not value.isdigit():
                raise TraceError(f"{where}: {column} must be a non-negative integer, got {value!r}")
            tokens.append(int(value))
        if tokens[0] < 1:
            raise TraceError(f"{where}: ContextTokens must be at least 1, got {tokens[0]}")
        parsed.append((stamp, tokens[0], tokens[1]))
    if not parsed:
        raise TraceError(f"{path}: no requests after the header")
    start = min(stamp for stamp, _, _ in parsed)
    records = [
        TraceRecord(
            timestamp_ms=(stamp - start).total_seconds() * 1000.0,
            input_length=context,
            output_length=generated,
            hash_ids=None,
        )
        for stamp, context, generated in parsed
    ]
    # Naive date-times as UTC: whole seconds, then the microseconds.
    start_unix_s = calendar.timegm(start.utctimetuple()) + start.microsecond / 1e6
    return records, start_unix_s
