"""The first requests the README and the docs show (curl and the ``openai`` client against
``http://127.0.0.1:8080/v1``) run against a real ``copse router run`` in front of a real
``copse worker mock`` process, serving the model the snippet names, on free ports."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from copse.workers.testing import free_port

from .snippets import SHELL_LANGUAGES, Block, all_blocks, commands

SHOWN_URL = "http://127.0.0.1:8080"
REQUESTS = [
    b for b in all_blocks() if f"{SHOWN_URL}/v1" in b.text and b.language in {*SHELL_LANGUAGES, "python"}
]
COPSE = str(Path(sys.executable).parent / "copse")


def model_of(block: Block) -> str:
    found: list[tuple[str, str]] = re.findall(r'"model":\s*"([^"]+)"|model="([^"]+)"', block.text)
    models = {name for pair in found for name in pair if name}
    assert len(models) == 1, f"{block.where}: one model per request block, got {models}"
    return models.pop()


def wait_ready(url: str, processes: list[subprocess.Popen[bytes]], *, timeout_s: float = 60.0) -> None:
    """Until the router's /ready answers 200 (or a process died, or the deadline passed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for process in processes:
            assert process.poll() is None, f"{process.args!r} exited {process.returncode}"
        try:
            if httpx.get(f"{url}/ready", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail(f"{url} was not ready after {timeout_s} s")


@pytest.fixture(scope="module")
def routers() -> Iterator[dict[str, str]]:
    """Model name -> base URL of a router serving it over one mocked engine."""
    started: list[subprocess.Popen[bytes]] = []
    urls: dict[str, str] = {}
    try:
        for model in sorted({model_of(block) for block in REQUESTS}):
            engine_port, router_port = free_port(), free_port()
            engine = subprocess.Popen(
                [
                    COPSE,
                    "worker",
                    "mock",
                    "--engines",
                    "1",
                    "--port-base",
                    str(engine_port),
                    "--model",
                    model,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            router = subprocess.Popen(
                [COPSE, "router", "run", "--engine", "mock", "--model", model, "--port", str(router_port),
                 "--worker", f"http://127.0.0.1:{engine_port}"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
            started += [engine, router]
            urls[model] = f"http://127.0.0.1:{router_port}"
            wait_ready(urls[model], [engine, router])
        yield urls
    finally:
        for process in started:
            process.terminate()
        for process in started:
            process.wait(timeout=30)


def test_the_documents_show_curl_and_openai_requests() -> None:
    languages = {block.language for block in REQUESTS}
    assert "python" in languages
    assert languages & SHELL_LANGUAGES
    assert any(block.path.name == "README.md" for block in REQUESTS)


@pytest.mark.parametrize("block", REQUESTS, ids=lambda block: block.where)
def test_request_runs(block: Block, routers: dict[str, str]) -> None:
    url = routers[model_of(block)]
    if block.language == "python":
        result = subprocess.run(
            [sys.executable, "-c", block.text.replace(SHOWN_URL, url)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert result.returncode == 0, f"{block.where}:\n{result.stderr[-3000:]}"
        assert result.stdout.strip(), f"{block.where}: printed nothing"
        return
    curls = [command for command in commands(block.text) if command[0] == "curl"]
    assert curls, block.where
    for command in curls:
        result = subprocess.run(
            shlex.split(shlex.join(command).replace(SHOWN_URL, url)),
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert result.returncode == 0, f"{block.where}: {result.stderr}"
        answer = json.loads(result.stdout)
        assert answer["choices"][0]["message"]["content"], f"{block.where}: {answer}"
