"""Reading recordings and traces, and the errors a user sees for bad ones."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path
from typing import Any

import pytest

from copse.planner.observations import Observation, resample
from copse.planner.recording import (
    RecordingError,
    read_metrics,
    read_metrics_jsonl,
    read_prometheus_export,
    read_trace,
    write_metrics_jsonl,
)


def jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def record(t: float, n: int = 10, **extra: Any) -> dict[str, Any]:
    return {"timestamp": t, "num_requests": n, "isl": 1000.0, "osl": 100.0, **extra}


def test_jsonl_round_trip(tmp_path: Path) -> None:
    path = jsonl(
        tmp_path / "m.jsonl",
        [
            record(
                0,
                ttft_ms=120.0,
                itl_ms=20.0,
                kv_hit_rate=0.4,
                isl_p90=3000.0,
                uncached_p50=500.0,
                uncached_p90=2000.0,
                uncached_p99=4000.0,
                uncached_max=4096.0,
            ),
            record(60),
            record(120, n=0),
        ],
    )
    observations = read_metrics_jsonl(path)
    assert [obs.timestamp for obs in observations] == [0.0, 60.0, 120.0]
    assert {obs.duration_s for obs in observations} == {60.0}
    assert observations[0].ttft_ms == 120.0
    assert observations[0].kv_hit_rate == 0.4
    assert observations[0].isl_p90 == 3000.0
    assert observations[0].uncached_quantiles == (500.0, 2000.0, 4000.0, 4096.0)
    assert observations[1].uncached_quantiles is None
    assert observations[1].ttft_ms is None
    buffer = io.StringIO()
    write_metrics_jsonl(observations, buffer)
    again = jsonl(tmp_path / "again.jsonl", [json.loads(line) for line in buffer.getvalue().splitlines()])
    assert read_metrics_jsonl(again) == observations


def test_missing_column_names_file_and_line(tmp_path: Path) -> None:
    path = jsonl(tmp_path / "m.jsonl", [record(0), {"timestamp": 60, "num_requests": 3, "isl": 10.0}])
    with pytest.raises(RecordingError, match=rf"^{path}:2: missing osl \(required: timestamp, num_requests"):
        read_metrics_jsonl(path)


def test_non_monotonic_timestamps(tmp_path: Path) -> None:
    path = jsonl(tmp_path / "m.jsonl", [record(0), record(60), record(30)])
    with pytest.raises(
        RecordingError, match=rf"^{path}:3: timestamp 30 is not after the previous line's \(60\)"
    ):
        read_metrics_jsonl(path)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text("\n\n")
    with pytest.raises(RecordingError, match=rf"^{path}: empty file"):
        read_metrics(path)


def test_unknown_field_is_a_typo(tmp_path: Path) -> None:
    path = jsonl(tmp_path / "m.jsonl", [record(0, ttft=3.0)])
    with pytest.raises(RecordingError, match=rf"^{path}:1: unknown field ttft"):
        read_metrics_jsonl(path, interval_s=60)


def test_bad_values_name_the_field(tmp_path: Path) -> None:
    cases = [
        (record(0, n=-1), "num_requests must be >= 0, got -1"),
        (record(0, kv_hit_rate=1.5), r"kv_hit_rate must be in \[0, 1\], got 1.5"),
        ({**record(0), "isl": "long"}, "isl must be a finite number, got 'long'"),
        ({**record(0), "isl": None}, "isl is null but num_requests is 10"),
    ]
    for index, (bad, message) in enumerate(cases):
        path = jsonl(tmp_path / f"m{index}.jsonl", [bad])
        with pytest.raises(RecordingError, match=rf"^{path}:1: {message}"):
            read_metrics_jsonl(path, interval_s=60)


def test_idle_intervals_may_have_null_lengths(tmp_path: Path) -> None:
    path = jsonl(
        tmp_path / "m.jsonl", [record(0), {"timestamp": 60, "num_requests": 0, "isl": None, "osl": None}]
    )
    assert read_metrics_jsonl(path)[1].isl is None


def test_not_json(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(record(0)) + "\n{oops\n")
    with pytest.raises(RecordingError, match=rf"^{path}:2: not valid JSON"):
        read_metrics(path)


def test_irregular_spacing(tmp_path: Path) -> None:
    path = jsonl(tmp_path / "m.jsonl", [record(0), record(60), record(150)])
    with pytest.raises(RecordingError, match=rf"^{path}:3: timestamp is 90s after the previous one"):
        read_metrics_jsonl(path)


def test_gaps_of_whole_intervals_are_allowed(tmp_path: Path) -> None:
    path = jsonl(tmp_path / "m.jsonl", [record(0), record(60), record(180)])
    assert len(read_metrics_jsonl(path)) == 3


def test_a_single_record_needs_an_interval(tmp_path: Path) -> None:
    path = jsonl(tmp_path / "m.jsonl", [record(0)])
    with pytest.raises(RecordingError, match="pass --interval"):
        read_metrics_jsonl(path)
    assert read_metrics_jsonl(path, interval_s=30.0)[0].duration_s == 30.0


def test_gzipped_recording(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl.gz"
    path.write_bytes(gzip.compress(b"".join(json.dumps(record(t)).encode() + b"\n" for t in (0, 60))))
    assert len(read_metrics(path)) == 2


# --- Prometheus exports -------------------------------------------------------------------


def matrix(values: list[tuple[float, str]], series: int = 1) -> dict[str, Any]:
    return {
        "status": "success",
        "data": {
            "resultType": "matrix",
            "result": [
                {"metric": {"pod": f"p{i}"}, "values": [[t, v] for t, v in values]} for i in range(series)
            ],
        },
    }


def test_prometheus_export(tmp_path: Path) -> None:
    export = {
        "num_requests": matrix([(600, "120"), (660, "0"), (720, "60")]),
        "isl": matrix([(600, "2000"), (660, "NaN"), (720, "1000")]),
        "osl": matrix([(600, "100"), (660, "NaN"), (720, "50")]),
        "ttft_ms": matrix([(600, "240.5"), (720, "180")]),
    }
    path = tmp_path / "export.json"
    path.write_text(json.dumps(export))
    observations = read_metrics(path)
    assert observations == read_prometheus_export(path)
    assert [obs.timestamp for obs in observations] == [540.0, 600.0, 660.0]
    assert observations[0] == Observation(
        timestamp=540.0, duration_s=60.0, num_requests=120.0, isl=2000.0, osl=100.0, ttft_ms=240.5
    )
    assert observations[1].isl is None
    assert observations[1].ttft_ms is None


def test_prometheus_export_errors(tmp_path: Path) -> None:
    path = tmp_path / "export.json"
    good = matrix([(600, "1"), (660, "2")])
    cases: list[tuple[dict[str, Any], str]] = [
        ({"num_requests": good, "isl": good}, "missing field osl"),
        ({"num_requests": good, "isl": good, "osl": matrix([(600, "1")], series=2)}, "osl: 2 series"),
        ({"num_requests": good, "isl": good, "osl": good, "latency": good}, "unknown field latency"),
        (
            {
                "num_requests": {"status": "success", "data": {"resultType": "vector", "result": []}},
                "isl": good,
                "osl": good,
            },
            "num_requests: expected resultType 'matrix'",
        ),
    ]
    for export, message in cases:
        path.write_text(json.dumps(export))
        with pytest.raises(RecordingError, match=message):
            read_prometheus_export(path)


# --- traces -------------------------------------------------------------------------------


def test_mooncake_trace_buckets_with_prefix_hits(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]},
        {"timestamp": 500, "input_length": 1500, "output_length": 30, "hash_ids": [1, 2, 3]},
        {"timestamp": 61_000, "input_length": 700, "output_length": 20, "hash_ids": [1, 4]},
        {"timestamp": 185_000, "input_length": 100, "output_length": 5, "hash_ids": [9]},
    ]
    path = jsonl(tmp_path / "t.jsonl", lines)
    observations = read_trace(path, interval_s=60.0)
    assert [obs.num_requests for obs in observations] == [2, 1, 0, 1]
    first = observations[0]
    assert (first.isl, first.osl, first.isl_p90, first.osl_p10) == (1262.0, 20.0, 1500.0, 10.0)
    # Request 2 finds blocks 1 and 2 (1024 of 2524 prompt tokens in the bucket).
    assert first.kv_hit_rate == pytest.approx(1024 / 2524)
    # Request 3 finds block 1 (512 of 700 tokens), then misses 4.
    assert observations[1].kv_hit_rate == pytest.approx(512 / 700)
    assert observations[2].isl is None
    assert observations[3].kv_hit_rate == 0.0


def test_azure_trace(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-16 18:16:50.0000000,1000,1\n"
    )
    observations = read_trace(path, interval_s=60.0)
    assert [obs.num_requests for obs in observations] == [2, 1]
    assert observations[0].isl == 385.0
    assert observations[0].kv_hit_rate is None


def test_trace_errors_are_recording_errors_naming_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("time,tokens\n1,2\n")
    with pytest.raises(RecordingError, match=rf"^{path}:1: not a trace.*missing column TIMESTAMP"):
        read_trace(path, interval_s=60)
    moon = jsonl(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": [0]},
            {"timestamp": 1, "input_length": 1},
        ],
    )
    with pytest.raises(RecordingError, match=rf"^{moon}:2: missing output_length"):
        read_trace(moon, interval_s=60)
    with pytest.raises(RecordingError, match=rf"^{moon}: interval must be positive"):
        read_trace(moon, interval_s=0)


def test_trace_lines_out_of_order_are_bucketed_by_arrival(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 70_000, "input_length": 512, "output_length": 2, "hash_ids": [1]},
        {"timestamp": 1_000, "input_length": 512, "output_length": 4, "hash_ids": [1]},
    ]
    observations = read_trace(jsonl(tmp_path / "t.jsonl", rows), interval_s=60.0)
    assert [(obs.timestamp, obs.osl) for obs in observations] == [(1.0, 4.0), (61.0, 2.0)]
    # The earlier request is the first to see block 1; the later one hits it.
    assert [obs.kv_hit_rate for obs in observations] == [0.0, 1.0]


def test_the_shipped_slice_buckets() -> None:
    trace = (
        Path(__file__).resolve().parents[2]
        / "examples"
        / "traces"
        / "mooncake-conversation-first-20min.jsonl.gz"
    )
    conversation = read_trace(trace, interval_s=300.0)
    assert len(conversation) == 4  # 20 minutes in 5-minute buckets
    assert sum(obs.num_requests for obs in conversation) == 3658
    hits = [obs.kv_hit_rate for obs in conversation if obs.kv_hit_rate is not None]
    assert 0.2 < sum(hits) / len(hits) < 0.6
    for obs in conversation:  # each request's uncached tokens, from the same hits
        assert obs.uncached_quantiles is not None
        assert list(obs.uncached_quantiles) == sorted(obs.uncached_quantiles)
        assert obs.isl is not None
        assert obs.uncached_quantiles[0] < obs.isl  # a hit takes tokens off the long and the short


def test_resample_merges_whole_multiples() -> None:
    base = [
        Observation(
            timestamp=60.0 * i,
            duration_s=60.0,
            num_requests=n,
            isl=isl,
            osl=10.0,
            ttft_ms=t,
            kv_hit_rate=h,
            onboard_ms=o,
            uncached_p50=u and u / 4,
            uncached_p90=u and u / 2,
            uncached_p99=u,
            uncached_max=u and u * 2,
        )
        for i, (n, isl, t, h, o, u) in enumerate(
            [(10, 100, 50, 0.5, 2.0, 80.0), (30, 200, 90, 0.0, 6.0, 160.0), (0, None, None, None, None, None)]
        )
    ]
    merged = resample(base, interval_s=120.0, source="m.jsonl")
    assert len(merged) == 2
    assert merged[0].num_requests == 40
    assert merged[0].isl == pytest.approx((10 * 100 + 30 * 200) / 40)
    assert merged[0].ttft_ms == 90  # the worse p99
    assert merged[0].kv_hit_rate == pytest.approx(0.5 * 1000 / 7000)  # weighted by prompt tokens
    assert merged[0].onboard_ms == pytest.approx((10 * 2.0 + 30 * 6.0) / 40)  # a mean per request
    # the median weighs by requests, the tail takes the worse interval's
    assert merged[0].uncached_quantiles == pytest.approx(((10 * 20 + 30 * 40) / 40, 80.0, 160.0, 320.0))
    with pytest.raises(ValueError, match=r"m\.jsonl: --interval 90s is not a whole multiple"):
        resample(base, interval_s=90.0, source="m.jsonl")
