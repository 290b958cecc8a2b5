"""``copse planner``: profile, dry-run (table, JSON, plot) and the errors a user sees."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import numpy as np
import pytest
import respx
from click.testing import CliRunner

from copse.cli import main
from copse.planner.recording import read_metrics
from copse.workers.perf import load_profile

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("profile") / "mock.npz"
    result = CliRunner().invoke(
        main, ["planner", "profile", "--engine", "mock", "--out", str(path), "--points", "40"]
    )
    assert result.exit_code == 0, result.output
    return path


def metrics_file(path: Path, rates: list[float], interval: float = 60.0) -> Path:
    lines = [
        json.dumps({"timestamp": i * interval, "num_requests": rate * interval, "isl": 2000, "osl": 150})
        for i, rate in enumerate(rates)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def dry_run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["planner", "dry-run", *args])
    return result.exit_code, result.stdout, result.stderr


def test_profile_is_loadable_and_matches_the_mock(profile: Path) -> None:
    model = load_profile(profile)
    assert len(model.prefill_isl) == 40
    assert model.gpus_per_engine == 1
    # The polynomial default: a 4k prefill is ~85 ms.
    assert model.prefill_ms(new_tokens=4096) == pytest.approx(85.8, rel=0.05)


def test_dry_run_json(tmp_path: Path, profile: Path) -> None:
    metrics = metrics_file(tmp_path / "m.jsonl", [5.0] * 10 + [20.0] * 10)
    code, out, _ = dry_run(
        "--metrics",
        str(metrics),
        "--perf-profile",
        str(profile),
        "--ttft-ms",
        "500",
        "--itl-ms",
        "40",
        "--predictor",
        "constant",
        "-o",
        "json",
    )
    assert code == 0
    document = json.loads(out)
    assert len(document["intervals"]) == 20
    summary = document["summary"]
    assert 0.0 <= summary["slo_attainment"] <= 1.0
    assert summary["static_peak_gpu_hours"] > 0
    # The step up is seen after interval 10; the replicas added then serve 120 s later.
    assert document["intervals"][15]["prefill_replicas"] > document["intervals"][5]["prefill_replicas"]


def test_dry_run_table_and_plot(tmp_path: Path, profile: Path) -> None:
    metrics = metrics_file(tmp_path / "m.jsonl", [5.0, 6.0, 20.0, 20.0, 5.0])
    plot = tmp_path / "plot.png"
    code, out, _ = dry_run(
        "--metrics",
        str(metrics),
        "--perf-profile",
        str(profile),
        "--ttft-ms",
        "500",
        "--itl-ms",
        "40",
        "--predictor",
        "kalman",
        "--plot",
        str(plot),
        "--gpu-budget",
        "6",
    )
    assert code == 0
    assert out.splitlines()[0].split()[:4] == ["time", "requests", "predicted", "prefill"]
    assert "analytic estimate" in out
    assert "estimated SLO attainment:" in out
    assert "GPU-hours:" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dry_run_on_a_trace_with_a_deployment(tmp_path: Path, profile: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        + "".join(
            f"2023-11-16 18:{minute:02d}:{second:02d}.0,1500,120\n"
            for minute in range(10)
            for second in range(0, 60, 2)
        )
    )
    deployment = REPO / "examples" / "seed-inferencedeployment.yaml"
    code, out, err = dry_run(
        "--trace",
        str(trace),
        "--perf-profile",
        str(profile),
        "--deployment",
        str(deployment),
        "--interval",
        "120",
        "--predictor",
        "moving_average",
        "-o",
        "json",
    )
    assert code == 0, err
    rows = json.loads(out)["intervals"]
    assert len(rows) == 5
    assert rows[0]["num_requests"] == 60
    # Aggregated deployment: both columns show the worker count.
    assert all(row["prefill_replicas"] == row["decode_replicas"] for row in rows)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"timestamp": 0, "num_requests": 1, "isl": 5}\n', r"m\.jsonl:1: missing osl"),
        ("", r"m\.jsonl: empty file"),
        (
            '{"timestamp": 60, "num_requests": 1, "isl": 5, "osl": 1}\n'
            '{"timestamp": 0, "num_requests": 1, "isl": 5, "osl": 1}\n',
            r"m\.jsonl:2: timestamp 0 is not after",
        ),
    ],
)
def test_bad_metrics_exit_1_naming_the_line(
    tmp_path: Path, profile: Path, content: str, message: str
) -> None:
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(content)
    code, _, err = dry_run(
        "--metrics", str(metrics), "--perf-profile", str(profile), "--ttft-ms", "500", "--itl-ms", "40"
    )
    assert code == 1
    assert err.startswith("error: ")
    assert re.search(message, err)


def test_profile_without_an_array_exits_1(tmp_path: Path) -> None:
    bad = tmp_path / "bad.npz"
    np.savez(bad, prefill_isl=np.array([1.0, 2.0]), prefill_ttft_ms=np.array([1.0, 2.0]))
    metrics = metrics_file(tmp_path / "m.jsonl", [1.0, 1.0])
    code, _, err = dry_run(
        "--metrics", str(metrics), "--perf-profile", str(bad), "--ttft-ms", "500", "--itl-ms", "40"
    )
    assert code == 1
    assert f"{bad}: missing array 'decode_active_kv_tokens'" in err


def test_targets_are_required_without_a_deployment(tmp_path: Path, profile: Path) -> None:
    metrics = metrics_file(tmp_path / "m.jsonl", [1.0, 1.0])
    code, _, err = dry_run("--metrics", str(metrics), "--perf-profile", str(profile))
    assert code == 2
    assert "--ttft-ms and --itl-ms are required" in err


def test_metrics_or_trace_not_both(tmp_path: Path, profile: Path) -> None:
    metrics = metrics_file(tmp_path / "m.jsonl", [1.0, 1.0])
    code, _, err = dry_run(
        "--metrics",
        str(metrics),
        "--trace",
        str(metrics),
        "--perf-profile",
        str(profile),
        "--ttft-ms",
        "1",
        "--itl-ms",
        "1",
    )
    assert code == 2
    assert "exactly one of --metrics FILE or --trace FILE" in err


def test_impossible_bounds_exit_1(tmp_path: Path, profile: Path) -> None:
    metrics = metrics_file(tmp_path / "m.jsonl", [1.0, 1.0])
    code, _, err = dry_run(
        "--metrics",
        str(metrics),
        "--perf-profile",
        str(profile),
        "--ttft-ms",
        "500",
        "--itl-ms",
        "40",
        "--min-replicas",
        "3",
        "--gpu-budget",
        "4",
    )
    assert code == 1
    assert "GPU budget (4) cannot hold min_replicas (3)" in err


def test_interval_must_be_a_multiple_of_the_recording(tmp_path: Path, profile: Path) -> None:
    metrics = metrics_file(tmp_path / "m.jsonl", [1.0, 1.0, 1.0])
    code, _, err = dry_run(
        "--metrics",
        str(metrics),
        "--perf-profile",
        str(profile),
        "--ttft-ms",
        "500",
        "--itl-ms",
        "40",
        "--interval",
        "90",
    )
    assert code == 1
    assert "--interval 90s is not a whole multiple of the recording's interval (60s)" in err


def test_record_buckets_a_trace_into_the_metrics_format(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": 1000 * i, "input_length": 600, "output_length": 20, "hash_ids": [0, i]})
            + "\n"
            for i in range(120)
        )
    )
    out = tmp_path / "m.jsonl"
    result = CliRunner().invoke(
        main, ["planner", "record", "--trace", str(trace), "--interval", "30", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert result.stdout == f"wrote {out}: 4 intervals of 30s\n"
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [record["num_requests"] for record in records] == [30, 30, 30, 30]
    assert records[1]["kv_hit_rate"] == pytest.approx(512 / 600)  # block 0 is shared by all


@respx.mock
def test_record_exports_from_prometheus(tmp_path: Path) -> None:
    def reply(request: httpx.Request) -> httpx.Response:
        values = [[1000.0 + 60 * i, "120"] for i in range(1, 4)]
        body = {
            "status": "success",
            "data": {"resultType": "matrix", "result": [{"metric": {}, "values": values}]},
        }
        return httpx.Response(200, json=body)

    route = respx.get("http://127.0.0.1:9090/api/v1/query_range").mock(side_effect=reply)
    out = tmp_path / "export.json"
    result = CliRunner().invoke(
        main,
        [
            "planner", "record", "llama", "--prometheus", "http://127.0.0.1:9090", "-n", "serving",
            "--since", "3m", "--interval", "60", "--out", str(out),
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert 'deployment="llama"' in route.calls[0].request.url.params["query"]
    assert [obs.num_requests for obs in read_metrics(out)] == [120.0, 120.0, 120.0]


def test_record_needs_one_source(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["planner", "record", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2
    assert "exactly one of --trace FILE or --prometheus URL" in result.stderr


def test_record_refuses_a_config_it_would_not_read(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    request = {"timestamp": 0, "input_length": 600, "output_length": 20, "hash_ids": [0]}
    trace.write_text(json.dumps(request) + "\n")
    result = CliRunner().invoke(
        main,
        ["planner", "record", "--trace", str(trace), "--config", str(tmp_path / "planner.yaml"),
         "--out", str(tmp_path / "m.jsonl")],
    )  # fmt: skip
    assert result.exit_code == 2
    assert "--config holds the Prometheus queries" in result.stderr
    assert not (tmp_path / "m.jsonl").exists()


def test_run_argument_errors_exit_2_and_an_invalid_config_1(tmp_path: Path) -> None:
    metrics = metrics_file(tmp_path / "m.jsonl", [1.0, 1.0])
    both = CliRunner().invoke(main, ["planner", "run", "llama", "-n", "a", "-n", "b"])
    assert both.exit_code == 2
    assert "NAME takes one --namespace" in both.stderr
    nameless = CliRunner().invoke(main, ["planner", "run", "--metrics", str(metrics)])
    assert nameless.exit_code == 2
    assert "--metrics replays a recording for one deployment: give its NAME" in nameless.stderr
    config = tmp_path / "planner.yaml"
    config.write_text("predictor: prophet\n")
    bad = CliRunner().invoke(main, ["planner", "run", "llama", "--config", str(config)])
    assert bad.exit_code == 1
    assert (
        f"{config}: invalid planner config: predictor: Value error, unknown predictor 'prophet'" in bad.stderr
    )
