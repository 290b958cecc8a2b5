"""``copse demo``: bad options and missing input files stop it before the cluster starts."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from copse.cli import demo as demo_module


@pytest.fixture
def no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails the test if the demo gets as far as starting the control plane."""

    def start() -> None:
        raise AssertionError("the demo started the cluster before checking its input")

    monkeypatch.setattr(demo_module, "_cluster_env", start)


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--requests", "-3"], "--requests"),
        (["--requests", "0"], "--requests"),
        (["--workers", "0"], "--workers"),
        (["--speedup", "0"], "--speedup"),
        (["--speedup", "-1"], "--speedup"),
    ],
)
@pytest.mark.usefixtures("no_cluster")
def test_bad_options_exit_2_naming_them(args: list[str], option: str) -> None:
    result = CliRunner().invoke(demo_module.demo, args)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}'" in result.output


@pytest.mark.usefixtures("no_cluster")
def test_a_missing_trace_is_named_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "shared" / "traces" / "mooncake.jsonl.gz"
    monkeypatch.setattr(demo_module, "TRACE", missing)
    result = CliRunner().invoke(demo_module.demo, ["--out", str(tmp_path / "out")])
    assert result.exit_code == 1, result.output
    assert f"the demo reads files that are not there: {missing} " in result.output
    assert not (tmp_path / "out").exists(), "nothing written either"


@pytest.mark.usefixtures("no_cluster")
def test_an_out_that_cannot_be_a_directory_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo_module, "_missing_inputs", list)
    taken = tmp_path / "file"
    taken.write_text("")
    result = CliRunner().invoke(demo_module.demo, ["--out", str(taken / "demo")])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for --out: cannot create directory {taken / 'demo'}: " in result.output


def test_the_cluster_build_reports_its_progress_on_the_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cold cache builds for 8-30 minutes: `copse cluster build` runs first with its stderr (the
    per-component progress and heartbeat) left on the terminal; `cluster up`, read for its exports,
    then finds everything cached."""
    calls: list[tuple[list[str], dict[str, object]]] = []
    kubectl = tmp_path / "kubectl"
    kubectl.write_text("#!/bin/sh\n")
    kubectl.chmod(0o755)

    def run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append((argv[3:], kwargs))
        exports = f"export KUBECONFIG={tmp_path}/kubeconfig\nexport PATH={tmp_path}:$PATH\n"
        return subprocess.CompletedProcess(argv, 0, stdout=exports if argv[3:] == ["cluster", "up"] else "")

    monkeypatch.setattr(subprocess, "run", run)
    env, found = demo_module._cluster_env()
    assert [argv for argv, _ in calls] == [["cluster", "build"], ["cluster", "up"]]
    build = calls[0][1]
    assert "capture_output" not in build, "the progress reaches the terminal"
    assert build.get("stderr") is None
    assert build["stdout"] == subprocess.DEVNULL
    assert (env["KUBECONFIG"], found) == (f"{tmp_path}/kubeconfig", str(kubectl))
