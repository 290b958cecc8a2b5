"""Request traces (Mooncake JSONL, Azure CSV) and the token ids synthesised for them.

Mooncake traces give one hash id per ``trace_block_size`` (512) prompt tokens, prefix-chained:
equal ids mean equal prefixes. Text is withheld, so each hash id is given ``trace_block_size``
deterministic token ids (a function of the seed, the id and the position in the block): requests
that share ids share token prefixes, and so share engine blocks whenever the engine block size
divides the trace block size. Azure traces carry no prefix information: every request gets
tokens of its own.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import gzip
import io
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

from copse.workers.protocol.tokenizer import RESERVED_IDS, VOCAB_SIZE

TraceFormat = Literal["mooncake", "azure"]
TRACE_FORMATS: tuple[TraceFormat, ...] = ("mooncake", "azure")

#: Hash ids given to Azure requests start here, above any id a Mooncake trace uses.
_AZURE_ID_BASE = 1 << 48


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the file, line and field."""


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace."""

    timestamp_ms: float
    """Arrival, ms after the trace's start."""
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    """One id per ``trace_block_size`` prompt tokens; the last block may be partial."""


def _open_text(path: Path) -> io.TextIOBase:
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    with path.open("rb") as probe:
        gzipped = probe.read(2) == b"\x1f\x8b"
    if gzipped:
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return io.TextIOWrapper(path.open("rb"), encoding="utf-8")


def _int_field(raw: dict[str, object], key: str, where: str, *, minimum: int) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(f"{where}: {key} must be an integer, got {value!r}")
    if value < minimum:
        raise TraceError(f"{where}: {key} must be at least {minimum}, got {value}")
    return value


def _mooncake(path: Path, *, trace_block_size: int) -> Iterator[TraceRequest]:
    with _open_text(path) as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not valid JSON ({exc})") from exc
            if not isinstance(raw, dict):
                raise TraceError(f"{where}: expected a JSON object, got {type(raw).__name__}")
            timestamp = raw.get("timestamp")
            if isinstance(timestamp, bool) or not isinstance(timestamp, int | float) or timestamp < 0:
                raise TraceError(f"{where}: timestamp must be a non-negative number of ms, got {timestamp!r}")
            input_length = _int_field(raw, "input_length", where, minimum=1)
            output_length = _int_field(raw, "output_length", where, minimum=1)
            hash_ids = raw.get("hash_ids")
            if not isinstance(hash_ids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids
            ):
                raise TraceError(f"{where}: hash_ids must be a list of non-negative integers")
            blocks = -(-input_length // trace_block_size)
            if len(hash_ids) != blocks:
                raise TraceError(
                    f"{where}: {len(hash_ids)} hash_ids for input_length {input_length}; with "
                    f"--trace-block-size {trace_block_size} there must be {blocks}"
                )
            yield TraceRequest(
                timestamp_ms=float(timestamp),
                input_length=input_length,
                output_length=output_length,
                hash_ids=tuple(hash_ids),
            )


def _azure(path: Path, *, trace_block_size: int) -> Iterator[TraceRequest]:
    with _open_text(path) as handle:
        reader = csv.DictReader(handle)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
        if missing:
            raise TraceError(f"{path}: missing column(s) {', '.join(sorted(missing))}")
        start: datetime.datetime | None = None
        for index, row in enumerate(reader):
            where = f"{path}:{index + 2}"
            try:
                # Seven fractional digits: keep microseconds.
                stamp = datetime.datetime.fromisoformat(row["TIMESTAMP"].strip()[:26])
                context = int(row["ContextTokens"])
                generated = int(row["GeneratedTokens"])
            except ValueError as exc:
                raise TraceError(f"{where}: {exc}") from exc
            if context < 1:
                raise TraceError(f"{where}: ContextTokens must be at least 1, got {context}")
            start = start or stamp
            base = _AZURE_ID_BASE + index * (1 << 20)
            yield TraceRequest(
                timestamp_ms=(stamp - start).total_seconds() * 1000.0,
                input_length=context,
                output_length=max(1, generated),
                hash_ids=tuple(range(base, base + -(-context // trace_block_size))),
            )


def load_trace(
    path: str | Path, *, fmt: TraceFormat = "mooncake", trace_block_size: int = 512
) -> list[TraceRequest]:
    """Every request of a trace, sorted by arrival (stable). Raises :class:`TraceError`."""
    if trace_block_size < 1:
        raise TraceError(f"trace block size must be at least 1, got {trace_block_size}")
    reader = _mooncake if fmt == "mooncake" else _azure
    requests = list(reader(Path(path), trace_block_size=trace_block_size))
    if not requests:
        raise TraceError(f"{path}: the trace holds no request")
    requests.sort(key=lambda r: r.timestamp_ms)
    return requests


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX = np.uint64(0x94D049BB133111EB)


class TokenSynth:
    """Deterministic token ids for trace hash ids: the same (seed, id, position) always gives the
    same token, in ``[RESERVED_IDS, VOCAB_SIZE)`` like the mocked engines' tokenizer."""

    def __init__(self, *, seed: int, trace_block_size: int) -> None:
        self.trace_block_size = trace_block_size
        self._seed = np.uint64((seed * 0xD1B54A32D192ED03 + 1) & (2**64 - 1))
        self._positions = np.arange(trace_block_size, dtype=np.uint64) * _MIX

    def tokens(self, hash_ids: Sequence[int], length: int) -> npt.NDArray[np.uint32]:
        """The first ``length`` token ids of a prompt made of the blocks ``hash_ids``."""
        ids = np.asarray(hash_ids, dtype=np.uint64)
        with np.errstate(over="ignore"):
            # A multiply-xorshift of (id, position): distinct pairs give unrelated tokens.
            x = ((ids * _GOLDEN + self._seed)[:, None] + self._positions[None, :]).reshape(-1)[:length]
            x = x ^ (x >> np.uint64(31))
            x = x * _GOLDEN
            x = x >> np.uint64(17)
        span = np.uint64(VOCAB_SIZE - RESERVED_IDS)
        out: npt.NDArray[np.uint32] = (x % span + np.uint64(RESERVED_IDS)).astype(np.uint32)
        return out
