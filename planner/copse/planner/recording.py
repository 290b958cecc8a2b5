"""Reading recorded load: metrics JSON Lines, Prometheus ``query_range`` exports, request traces.

Every reader returns :class:`~copse.planner.observations.Observation` lists in time order and
raises :class:`RecordingError` naming the file and the line (or field) for anything unusable.
Files ending in ``.gz`` are read through gzip.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from copse.planner.observations import UNCACHED_QUANTILES, Observation
from copse.workers.traces import MOONCAKE_BLOCK_TOKENS, TraceError, open_text, text_lines
from copse.workers.traces import read_trace as read_requests

#: The router's per-request SLO counts of an interval (optional keys of a record).
SLO_FIELDS: tuple[str, ...] = ("slo_met", "ttft_missed", "itl_missed", "refused")
#: Keys of a metrics JSON Lines record: required ones, then optional ones.
REQUIRED_FIELDS: tuple[str, ...] = ("timestamp", "num_requests", "isl", "osl")
OPTIONAL_FIELDS: tuple[str, ...] = (
    "isl_p90",
    "osl_p10",
    *UNCACHED_QUANTILES,
    "kv_hit_rate",
    "onboard_ms",
    "ttft_ms",
    "itl_ms",
    "ttft_mean_ms",
    "itl_mean_ms",
    "serving",
    "decode_serving",
    "queue_depth",
    "decode_queue_depth",
    "inflight",
    *SLO_FIELDS,
)
#: Fields a Prometheus export must hold (the others are optional).
EXPORT_REQUIRED: tuple[str, ...] = ("num_requests", "isl", "osl")
#: Relative slack when checking that a recording's spacing is regular.
_SPACING_TOLERANCE = 0.01


class RecordingError(ValueError):
    """A recording or trace that cannot be used; the message names the file and line or field."""


def _read_text(path: Path) -> str:
    try:
        with open_text(path, kind="metrics") as handle:
            return handle.read()
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise RecordingError(f"{path}: cannot read: {exc}") from exc
    except TraceError as exc:
        raise RecordingError(str(exc)) from exc


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """Non-blank lines with their 1-based numbers."""
    try:
        yield from text_lines(path, kind="metrics")
    except TraceError as exc:
        raise RecordingError(str(exc)) from exc


def _number(where: str, key: str, value: Any, *, minimum: float = 0.0, maximum: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RecordingError(f"{where}: {key} must be a finite number, got {value!r}")
    if not minimum <= value <= maximum:
        bounds = f">= {minimum:g}" if maximum == math.inf else f"in [{minimum:g}, {maximum:g}]"
        raise RecordingError(f"{where}: {key} must be {bounds}, got {value!r}")
    return float(value)


def _optional(where: str, record: dict[str, Any], key: str, *, maximum: float = math.inf) -> float | None:
    value = record.get(key)
    return None if value is None else _number(where, key, value, maximum=maximum)


def _spacing(path: Path, timestamps: Sequence[float], where: Sequence[str]) -> float:
    """The regular interval between timestamps; gaps of whole intervals are allowed."""
    gaps = [b - a for a, b in itertools.pairwise(timestamps)]
    interval = min(gaps)
    for gap, place in zip(gaps, where[1:], strict=True):
        ratio = gap / interval
        if abs(ratio - round(ratio)) > _SPACING_TOLERANCE:
            raise RecordingError(
                f"{place}: timestamp is {gap:g}s after the previous one, not a whole multiple of the "
                f"recording's interval ({interval:g}s)"
            )
    return interval


def read_metrics_jsonl(path: Path, *, interval_s: float | None = None) -> list[Observation]:
    """A metrics recording: one JSON object per line and interval (see the module's README section).

    The interval is the spacing of the timestamps; ``interval_s`` is needed only for a single line.
    """
    records: list[tuple[str, dict[str, Any]]] = []
    previous: float | None = None
    for number, line in _lines(path):
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RecordingError(f"{where}: not valid JSON ({exc.msg})") from exc
        if not isinstance(record, dict):
            raise RecordingError(f"{where}: expected a JSON object, got {type(record).__name__}")
        missing = [key for key in REQUIRED_FIELDS if key not in record]
        if missing:
            raise RecordingError(
                f"{where}: missing {', '.join(missing)} (required: {', '.join(REQUIRED_FIELDS)})"
            )
        unknown = sorted(set(record) - set(REQUIRED_FIELDS) - set(OPTIONAL_FIELDS))
        if unknown:
            raise RecordingError(
                f"{where}: unknown field {', '.join(unknown)} "
                f"(known: {', '.join(REQUIRED_FIELDS + OPTIONAL_FIELDS)})"
            )
        timestamp = _number(where, "timestamp", record["timestamp"], minimum=-math.inf)
        if previous is not None and timestamp <= previous:
            raise RecordingError(
                f"{where}: timestamp {timestamp:g} is not after the previous line's ({previous:g}); "
                "timestamps must increase"
            )
        previous = timestamp
        records.append((where, record))
    if not records:
        raise RecordingError(f"{path}: empty file: no metrics records")
    timestamps = [float(record["timestamp"]) for _, record in records]
    if len(records) == 1:
        if interval_s is None:
            raise RecordingError(f"{path}: a single record gives no interval; pass --interval")
        duration = interval_s
    else:
        duration = _spacing(path, timestamps, [where for where, _ in records])
    return [_observation(where, record, duration) for where, record in records]


def _observation(where: str, record: dict[str, Any], duration: float) -> Observation:
    num_requests = _number(where, "num_requests", record["num_requests"])
    lengths: dict[str, float | None] = {}
    for key in ("isl", "osl"):
        value = record[key]
        if value is None and num_requests == 0:
            lengths[key] = None
        elif value is None:
            raise RecordingError(f"{where}: {key} is null but num_requests is {num_requests:g}")
        else:
            lengths[key] = _number(where, key, value)
    return Observation(
        timestamp=float(record["timestamp"]),
        duration_s=duration,
        num_requests=num_requests,
        isl=lengths["isl"],
        osl=lengths["osl"],
        isl_p90=_optional(where, record, "isl_p90"),
        osl_p10=_optional(where, record, "osl_p10"),
        **{key: _optional(where, record, key) for key in UNCACHED_QUANTILES},
        kv_hit_rate=_optional(where, record, "kv_hit_rate", maximum=1.0),
        onboard_ms=_optional(where, record, "onboard_ms"),
        ttft_ms=_optional(where, record, "ttft_ms"),
        itl_ms=_optional(where, record, "itl_ms"),
        ttft_mean_ms=_optional(where, record, "ttft_mean_ms"),
        itl_mean_ms=_optional(where, record, "itl_mean_ms"),
        serving=_optional(where, record, "serving"),
        decode_serving=_optional(where, record, "decode_serving"),
        queue_depth=_optional(where, record, "queue_depth"),
        decode_queue_depth=_optional(where, record, "decode_queue_depth"),
        inflight=_optional(where, record, "inflight"),
        **{key: _optional(where, record, key) for key in SLO_FIELDS},
    )


def write_metrics_jsonl(observations: Sequence[Observation], handle: IO[str]) -> None:
    """Write observations in the format :func:`read_metrics_jsonl` reads (absent fields omitted)."""
    for obs in observations:
        record: dict[str, Any] = {
            "timestamp": obs.timestamp,
            "num_requests": obs.num_requests,
            "isl": obs.isl,
            "osl": obs.osl,
        }
        for key in OPTIONAL_FIELDS:
            value = getattr(obs, key)
            if value is not None:
                record[key] = value
        handle.write(json.dumps(record) + "\n")


# --- Prometheus query_range exports -----------------------------------------------------------


def read_prometheus_export(path: Path) -> list[Observation]:
    """A JSON object mapping field names to Prometheus ``query_range`` responses.

    Each response must hold at most one series (the queries aggregate with ``sum``); a sample at
    time ``t`` covers the window ``[t - step, t)``, so the observation starts at ``t - step``.
    ``NaN`` samples (a ratio over an interval without requests) become missing values.
    """
    try:
        document = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise RecordingError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(document, dict) or not document:
        raise RecordingError(f"{path}: empty export: expected an object of query_range responses by field")
    unknown = sorted(set(document) - set(REQUIRED_FIELDS) - set(OPTIONAL_FIELDS))
    if unknown:
        raise RecordingError(
            f"{path}: unknown field {', '.join(unknown)} "
            f"(known: {', '.join(EXPORT_REQUIRED + OPTIONAL_FIELDS)})"
        )
    missing = [key for key in EXPORT_REQUIRED if key not in document]
    if missing:
        raise RecordingError(
            f"{path}: missing field {', '.join(missing)} (required: {', '.join(EXPORT_REQUIRED)})"
        )
    series = {key: _matrix(path, key, response) for key, response in document.items()}
    timestamps = sorted(series["num_requests"])
    if not timestamps:
        raise RecordingError(f"{path}: num_requests has no samples")
    if len(timestamps) < 2:
        raise RecordingError(f"{path}: num_requests has a single sample; the step cannot be inferred")
    step = _spacing(path, timestamps, [f"{path}: num_requests sample at {t:g}" for t in timestamps])
    observations = []
    for t in timestamps:
        values = {key: samples.get(t) for key, samples in series.items()}
        num_requests = values["num_requests"] or 0.0
        observations.append(
            Observation(
                timestamp=t - step,
                duration_s=step,
                num_requests=max(0.0, num_requests),
                isl=values["isl"] if num_requests > 0 else None,
                osl=values["osl"] if num_requests > 0 else None,
                isl_p90=values.get("isl_p90"),
                osl_p10=values.get("osl_p10"),
                **{key: values.get(key) for key in UNCACHED_QUANTILES},
                kv_hit_rate=values.get("kv_hit_rate"),
                onboard_ms=values.get("onboard_ms"),
                ttft_ms=values.get("ttft_ms"),
                itl_ms=values.get("itl_ms"),
                ttft_mean_ms=values.get("ttft_mean_ms"),
                itl_mean_ms=values.get("itl_mean_ms"),
                serving=values.get("serving"),
                decode_serving=values.get("decode_serving"),
                queue_depth=values.get("queue_depth"),
                decode_queue_depth=values.get("decode_queue_depth"),
                inflight=values.get("inflight"),
                **{key: values.get(key) for key in SLO_FIELDS},
            )
        )
    return observations


def _matrix(path: Path, key: str, response: Any) -> dict[float, float | None]:
    where = f"{path}: {key}"
    if not isinstance(response, dict) or response.get("status") != "success":
        raise RecordingError(
            f"{where}: expected a successful query_range response, got {str(response)[:80]!r}"
        )
    data = response.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "matrix":
        kind = data.get("resultType") if isinstance(data, dict) else None
        raise RecordingError(f"{where}: expected resultType 'matrix' (a query_range result), got {kind!r}")
    result = data.get("result")
    if not isinstance(result, list):
        raise RecordingError(f"{where}: data.result must be a list")
    if len(result) > 1:
        labels = [entry.get("metric") for entry in result[:3] if isinstance(entry, dict)]
        raise RecordingError(
            f"{where}: {len(result)} series (e.g. {labels}); aggregate the query with sum() to one series"
        )
    samples: dict[float, float | None] = {}
    for entry in result:
        values = entry.get("values") if isinstance(entry, dict) else None
        if not isinstance(values, list):
            raise RecordingError(f"{where}: series without 'values'")
        for index, sample in enumerate(values):
            try:
                timestamp, text = float(sample[0]), float(sample[1])
            except (TypeError, ValueError, IndexError) as exc:
                raise RecordingError(f'{where}: values[{index}] is not [time, "number"]: {sample!r}') from exc
            samples[timestamp] = text if math.isfinite(text) else None
    return samples


# --- request traces -------------------------------------------------------------------------


class _Bucketer:
    """Accumulates requests into fixed intervals starting at the first arrival.

    Arrivals are seconds after ``origin_s``; observations are stamped ``origin_s`` plus that.
    """

    def __init__(self, interval_s: float, *, origin_s: float) -> None:
        self.interval_s = interval_s
        self.origin_s = origin_s
        self.start: float | None = None
        self.buckets: dict[int, list[tuple[int, int, int]]] = {}

    def add(self, arrival_s: float, *, isl: int, osl: int, hit_tokens: int) -> None:
        if self.start is None:
            self.start = arrival_s
        index = int((arrival_s - self.start) // self.interval_s)
        self.buckets.setdefault(index, []).append((isl, osl, hit_tokens))

    def observations(self, *, with_hits: bool) -> list[Observation]:
        assert self.start is not None
        out = []
        for index in range(max(self.buckets) + 1):
            requests = self.buckets.get(index, [])
            count = len(requests)
            isl = np.array([r[0] for r in requests], dtype=np.float64)
            osl = np.array([r[1] for r in requests], dtype=np.float64)
            prompt = float(isl.sum())
            spread: dict[str, float] = {}
            if with_hits and count:
                uncached = isl - np.array([r[2] for r in requests], dtype=np.float64)
                spread = {
                    field: float(np.quantile(uncached, level, method="inverted_cdf"))
                    for field, level in UNCACHED_QUANTILES.items()
                }
            out.append(
                Observation(
                    timestamp=self.origin_s + self.start + index * self.interval_s,
                    duration_s=self.interval_s,
                    num_requests=float(count),
                    isl=float(isl.mean()) if count else None,
                    osl=float(osl.mean()) if count else None,
                    isl_p90=float(np.percentile(isl, 90, method="inverted_cdf")) if count else None,
                    osl_p10=float(np.percentile(osl, 10, method="inverted_cdf")) if count else None,
                    kv_hit_rate=sum(r[2] for r in requests) / prompt if with_hits and prompt > 0 else None,
                    **spread,
                )
            )
        return out


def read_trace(path: Path, *, interval_s: float) -> list[Observation]:
    """Bucket a Mooncake JSONL or Azure CSV trace (optionally gzipped) into ``interval_s`` intervals.

    Mooncake traces also give the prefix-cache hit rate: the share of prompt tokens in leading
    blocks whose (prefix-chained) hash id was seen before -- one shared cache of unbounded size,
    so an upper bound on what KV-aware routing can hit -- and, from the same hits, the quantiles
    of each request's uncached tokens.
    """
    if interval_s <= 0:
        raise RecordingError(f"{path}: interval must be positive, got {interval_s:g}")
    try:
        trace = read_requests(path)
    except TraceError as exc:
        raise RecordingError(str(exc)) from exc
    bucketer = _Bucketer(interval_s, origin_s=trace.start_unix_s)
    seen: set[int] = set()
    for record in trace.records:
        hit_tokens = 0
        for position, block in enumerate(record.hash_ids or ()):
            if block not in seen:
                break
            hit_tokens += min(MOONCAKE_BLOCK_TOKENS, record.input_length - position * MOONCAKE_BLOCK_TOKENS)
        seen.update(record.hash_ids or ())
        bucketer.add(
            record.timestamp_ms / 1000.0,
            isl=record.input_length,
            osl=record.output_length,
            hit_tokens=hit_tokens,
        )
    return bucketer.observations(with_hits=trace.format == "mooncake")


def read_metrics(path: Path, *, interval_s: float | None = None) -> list[Observation]:
    """A metrics recording by content: a Prometheus export (one JSON object keyed by field) or JSON Lines."""
    try:
        document = json.loads(_read_text(path))
    except json.JSONDecodeError:
        document = None  # several lines of JSON: the JSON Lines reader reports any bad line
    if isinstance(document, dict) and "timestamp" not in document:
        return read_prometheus_export(path)
    return read_metrics_jsonl(path, interval_s=interval_s)
