"""``copse worker``: invalid input exits 2 naming the option; ``mock`` serves until signalled."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
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
        (["mock", "--speedup", "0"], "--speedup"),
        (["mock", "--moe", "nosuch"], "not JSON"),
        (
            ["mock", "--moe", "[8]"],
            'expected a JSON object of MoeConfig fields, got list (e.g. {"experts": 256',
        ),
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


def _stops_listening(url: str, *, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/health", timeout=1)
        except httpx.ConnectError:
            return True
        time.sleep(0.05)
    return False


def test_mock_on_sigterm_finishes_the_stream_in_flight_and_takes_nothing_new() -> None:
    """What a worker pod does when it is deleted: the kubelet sends SIGTERM, and the engine lets
    its streams end before it exits (the pod's termination grace bounds the wait)."""
    command = [sys.executable, "-c", "from copse.cli import main; main()", "worker", "mock"]
    process = subprocess.Popen(
        [*command, "--port-base", "0", "--decode-speedup", "0.2", "--drain-timeout", "60"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    try:
        url = ""
        for line in process.stdout:
            found = re.search(r"1 engine\(s\) on (http://\S+) \.\.", line)
            if found:
                url = found.group(1)
                break
        assert url, "mock never reported its engine"
        body = {"model": "m", "prompt": list(range(100, 400)), "max_tokens": 16, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            process.send_signal(signal.SIGTERM)
            assert "SIGTERM" in process.stdout.readline(), "the engine says it is draining"
            assert _stops_listening(url), "a draining engine takes no new connection"
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
        tokens = [json.loads(line[5:])["choices"][0]["text"] for line in rest[:-1]]
        assert len(tokens) == 15, "the stream in flight ran to its end"
        assert process.wait(timeout=20) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()


@pytest.mark.timeout(120)
def test_kv_relay_stops_on_sigterm_while_nats_is_unreachable() -> None:
    """A relay whose NATS never answers still ends when its pod is deleted, and says once per
    outage, in one line, that NATS is away (nats-py alone logs a traceback every second)."""
    refusing = socket.socket()  # bound but not listening: every connection is refused
    refusing.bind(("127.0.0.1", 0))
    nats_url = f"nats://127.0.0.1:{refusing.getsockname()[1]}"
    command = [sys.executable, "-c", "from copse.cli import main; main()", "worker", "kv-relay"]
    process = subprocess.Popen(
        [*command, "--engine", "http://127.0.0.1:1", "--nats", nats_url, "--deployment", "d"],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    try:
        first = next(line for line in process.stderr if nats_url in line)
        assert "WARNING" in first, first
        assert "retrying every" in first, first
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
        rest = process.stderr.read()
        assert "Traceback" not in rest
        assert nats_url not in rest.replace("DEBUG", ""), "one warning per outage, not one per retry"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()
        refusing.close()
