"""The one reader of request traces (Mooncake JSONL, Azure CSV) and the errors a user sees."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from copse.workers.traces import TraceError, read_trace

SLICE = (
    Path(__file__).resolve().parents[2] / "examples" / "traces" / "mooncake-conversation-first-20min.jsonl.gz"
)
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
GOOD = {"timestamp": 0, "input_length": 5, "output_length": 3, "hash_ids": [0]}


def _jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_mooncake_records_sorted_by_arrival_from_gzip_or_plain(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 50, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]},
        {"timestamp": 10, "input_length": 512, "output_length": 0, "hash_ids": [0]},
        {"timestamp": 50, "input_length": 1, "output_length": 1, "hash_ids": [7]},
    ]
    plain = _jsonl(tmp_path / "t.jsonl", rows)
    gz = tmp_path / "t.data"  # gzip is told by content, not by name
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    for path in (plain, gz):
        trace = read_trace(path)
        assert trace.format == "mooncake"
        assert trace.start_unix_s == 0.0
        assert [r.timestamp_ms for r in trace.records] == [10.0, 50.0, 50.0]
        assert [r.hash_ids for r in trace.records] == [(0,), (0, 1), (7,)]  # ties keep file order
        assert trace.records[0].output_length == 0


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {"input_length": 600, "hash_ids": [0]},
            "1 hash_ids for input_length 600; with 512 tokens per hash id",
        ),
        ({"timestamp": -1}, "timestamp must be a finite, non-negative number of ms, got -1"),
        ({"timestamp": float("nan")}, "timestamp must be a finite"),
        ({"input_length": "5"}, "input_length must be an integer, got '5'"),
        ({"input_length": 0, "hash_ids": []}, "input_length must be at least 1, got 0"),
        ({"output_length": -1}, "output_length must be at least 0, got -1"),
        ({"hash_ids": ["a"]}, "hash_ids must be a list of non-negative integers"),
        ({"hash_ids": [True]}, "hash_ids must be a list of non-negative integers"),
    ],
)
def test_bad_mooncake_lines_name_file_line_and_field(
    tmp_path: Path, row: dict[str, object], message: str
) -> None:
    path = _jsonl(tmp_path / "bad.jsonl", [GOOD, {**GOOD, **row}])
    with pytest.raises(TraceError, match=rf"^{path}:2: {message}"):
        read_trace(path)


def test_mooncake_structure_errors(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "t.jsonl", [GOOD, {"timestamp": 1, "input_length": 1, "hash_ids": [0]}])
    with pytest.raises(TraceError, match=rf"^{path}:2: missing output_length \(a Mooncake trace line has"):
        read_trace(path)
    path.write_text(json.dumps(GOOD) + "\n\n[1, 2]\n")
    with pytest.raises(TraceError, match=rf"^{path}:3: expected a JSON object, got list"):
        read_trace(path)
    path.write_text(json.dumps(GOOD) + "\n{nope\n")
    with pytest.raises(TraceError, match=rf"^{path}:2: not valid JSON"):
        read_trace(path)
    path.write_text(json.dumps({**GOOD, "input_length": 1000, "hash_ids": [0, 1]}) + "\n")
    assert len(read_trace(path).records) == 1
    with pytest.raises(
        TraceError, match="2 hash_ids for input_length 1000; with 256 tokens per hash id there must be 4"
    ):
        read_trace(path, block_tokens=256)


def test_azure_records_are_ms_after_the_earliest_row_without_hash_ids(tmp_path: Path) -> None:
    path = tmp_path / "az.csv"
    path.write_text(
        AZURE_HEADER + "2023-11-16 18:15:47.1805900,10,0\n" + "\n" + "2023-11-16 18:15:46.6805900,1000,44\n"
    )
    trace = read_trace(path)
    assert trace.format == "azure"
    assert [r.timestamp_ms for r in trace.records] == pytest.approx([0.0, 500.0])
    assert [(r.input_length, r.output_length, r.hash_ids) for r in trace.records] == [
        (1000, 44, None),
        (10, 0, None),
    ]
    # 2023-11-16 18:15:46.680590 UTC
    assert trace.start_unix_s == pytest.approx(1700158546.68059)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("2023-11-16 18:15:46,3,x", ":2: GeneratedTokens must be a non-negative integer, got 'x'"),
        ("2023-11-16 18:15:46,-3,1", ":2: ContextTokens must be a non-negative integer, got '-3'"),
        ("2023-11-16 18:15:46,0,1", ":2: ContextTokens must be at least 1, got 0"),
        ("yesterday,3,1", ":2: TIMESTAMP 'yesterday' is not a date-time"),
        ("2023-11-16 18:15:46,3", ":2: 2 columns, the header has 3"),
    ],
)
def test_bad_azure_rows_name_file_line_and_column(tmp_path: Path, row: str, message: str) -> None:
    path = tmp_path / "az.csv"
    path.write_text(AZURE_HEADER + row + "\n")
    with pytest.raises(TraceError, match=rf"^{path}{message}"):
        read_trace(path, fmt="azure")


def test_file_level_errors(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("time,tokens\n1,2\n")
    with pytest.raises(
        TraceError, match=rf"^{path}:1: not a trace: the first line is neither .*missing column TIMESTAMP"
    ):
        read_trace(path)
    with pytest.raises(
        TraceError, match=rf"^{path}:1: not a trace: the first line is not an Azure CSV header"
    ):
        read_trace(path, fmt="azure")
    path.write_text(AZURE_HEADER)
    with pytest.raises(TraceError, match=rf"^{path}: no requests after the header"):
        read_trace(path)
    path.write_text("\n")
    with pytest.raises(TraceError, match=rf"^{path}: empty file: no requests"):
        read_trace(path)
    with pytest.raises(TraceError, match=rf"^{tmp_path / 'none.jsonl'}: no such trace file"):
        read_trace(tmp_path / "none.jsonl")
    broken = tmp_path / "t.jsonl.gz"
    broken.write_bytes(gzip.compress(json.dumps(GOOD).encode() * 50)[:40])
    with pytest.raises(TraceError, match=rf"^{broken}: cannot read"):
        read_trace(broken)
    with pytest.raises(TraceError, match="tokens per hash id must be at least 1, got 0"):
        read_trace(broken, block_tokens=0)


def test_the_shipped_slice_reads() -> None:
    conversation = read_trace(SLICE)
    assert (conversation.format, len(conversation.records)) == ("mooncake", 3658)
    assert all(r.hash_ids for r in conversation.records)
    assert max(r.timestamp_ms for r in conversation.records) < 1_200_000  # the first 20 minutes
