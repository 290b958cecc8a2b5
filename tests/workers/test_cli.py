"""``copse worker``: invalid input exits 2 naming the option; ``mock`` serves until signalled."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from copse.workers.cli import worker
from copse.workers.perf import PolynomialPerfModel, load_profile


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["mock", "--engines", "0"], "--engines"),
        (["mock", "--role", "both"], "--role"),
        (["mock", "--perf-profile", "/nonexistent/profile.npz"], "/nonexistent/profile.npz"),
        (["mock", "--namespace", "a b"], "--namespace"),
        (["mock", "--port-base", "65000", "--engines", "1000"], "65535"),
        (["mock", "--speedup-ratio", "0"], "--speedup-ratio"),
        (["kv-relay", "--nats", "nats://127.0.0.1:4222", "--deployment", "d"], "--engine"),
        (["save-profile"], "--out"),
    ],
)
def test_invalid_input_exits_2_naming_it(args: list[str], fragment: str) -> None:
    result = CliRunner().invoke(worker, args)
    assert result.exit_code == 2, result.output
    assert fragment in result.output


def test_save_profile_writes_a_loadable_profile(tmp_path: Path) -> None:
    out = tmp_path / "poly.json"
    result = CliRunner().invoke(
        worker, ["save-profile", "--out", str(out), "--points", "20", "--gpus-per-engine", "4"]
    )
    assert result.exit_code == 0, result.output
    loaded = load_profile(out)
    assert loaded.gpus_per_engine == 4
    assert loaded.prefill_curve_ms(loaded.prefill_isl[3]) == pytest.approx(
        PolynomialPerfModel().prefill_curve_ms(loaded.prefill_isl[3])
    )


@pytest.mark.timeout(120)
def test_mock_serves_several_engines_until_sigterm() -> None:
    command = [sys.executable, "-c", "from copse.cli import main; main()", "worker", "mock"]
    process = subprocess.Popen(
        [*command, "--engines", "3", "--port-base", "0", "--virtual-clock"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    try:
        urls: list[str] = []
        for line in process.stdout:
            found = re.search(r"3 engine\(s\) on (http://\S+) \.\. (http://\S+)", line)
            if found:
                urls = [found.group(1), found.group(2)]
                break
        assert urls, "mock never reported its engines"
        for url in urls:
            assert httpx.get(f"{url}/health").status_code == 200
            reply = httpx.post(
                f"{url}/v1/completions", json={"model": "m", "prompt": "hello world", "max_tokens": 2}
            )
            assert reply.json()["usage"]["completion_tokens"] == 2
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()
