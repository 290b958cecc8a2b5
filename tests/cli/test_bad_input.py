"""Bad input on the command line: the error names the option and the value, before any work
(an output file that cannot be written used to end a finished run on a traceback)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from copse.cli import main

MISSING = "/nonexistent/dir"


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["synth", "--trace", "t.jsonl", "--out", f"{MISSING}/x.jsonl"], "--out"),
        (["bench", "moe-workload", "--out", f"{MISSING}/x.jsonl"], "--out"),
        (["planner", "record", "--trace", "t.jsonl", "--out", f"{MISSING}/x.jsonl"], "--out"),
        (["planner", "profile", "--engine", "mock", "--out", f"{MISSING}/p.npz"], "--out"),
        (["planner", "dry-run", "--perf-profile", "p.npz", "--plot", f"{MISSING}/x.png"], "--plot"),
        (["worker", "save-profile", "--out", f"{MISSING}/p.npz"], "--out"),
    ],
)
def test_an_output_in_a_missing_directory_is_refused_before_the_run(args: list[str], option: str) -> None:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}': cannot write {args[-1]}: no directory {MISSING}" in result.output


def test_an_output_that_is_a_directory_is_refused(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["bench", "moe-workload", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert f"Invalid value for '--out': File '{tmp_path}' is a directory" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bench", "replay", "--trace", "t.jsonl", "--limit", "0"], "Invalid value for '--limit'"),
        (["bench", "replay", "--trace", "t.jsonl", "--limit", "-3"], "Invalid value for '--limit'"),
        (["bench", "moe-workload", "--out", "w.jsonl", "--requests", "0"], "Invalid value for '--requests'"),
        (["bench", "moe-workload", "--out", "w.jsonl", "--rate", "0"], "Invalid value for '--rate'"),
        (
            ["bench", "moe-workload", "--out", "w.jsonl", "--prefix-blocks", "0"],
            "Invalid value for '--prefix-blocks'",
        ),
        (["bench", "moe-workload", "--out", "w.jsonl", "--class-weights", "1,x"], "--class-weights '1,x': "),
        (
            ["bench", "moe-workload", "--out", "w.jsonl", "--class-weights", "1,-1"],
            "--class-weights '1,-1': ",
        ),
    ],
)
def test_bad_numbers_name_their_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, args)
    assert not (tmp_path / "w.jsonl").exists(), "nothing written"
    assert result.exit_code == 2, result.output
    assert message in result.output
