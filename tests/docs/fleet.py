"""A router in front of mocked engines, as processes on free ports of 127.0.0.1, for the docs tests."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from copse.workers.testing import free_port, free_port_range

COPSE = str(Path(sys.executable).parent / "copse")


@dataclass(frozen=True)
class LocalFleet:
    router_url: str
    engine_urls: list[str]


def wait_ready(url: str, processes: list[subprocess.Popen[bytes]], *, timeout_s: float = 60.0) -> None:
    """Until the router's ``/ready`` answers 200; an error when a process died or time ran out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for process in processes:
            if process.poll() is not None:
                raise RuntimeError(f"{process.args!r} exited {process.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} was not ready after {timeout_s} s")


@contextmanager
def local_fleet(*, model: str, engines: int = 1) -> Iterator[LocalFleet]:
    """``copse worker mock`` (one process, ``engines`` engines) behind ``copse router run``, ready."""
    base, router_port = free_port_range(engines), free_port()
    fleet = LocalFleet(
        router_url=f"http://127.0.0.1:{router_port}",
        engine_urls=[f"http://127.0.0.1:{base + index}" for index in range(engines)],
    )
    processes = [
        subprocess.Popen(
            [COPSE, "worker", "mock", "--engines", str(engines), "--port-base", str(base), "--model", model],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    router = [COPSE, "router", "run", "--engine", "mock", "--model", model, "--port", str(router_port)]
    router += [arg for url in fleet.engine_urls for arg in ("--worker", url)]
    try:
        processes.append(
            subprocess.Popen(
                router,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        wait_ready(fleet.router_url, processes)
        yield fleet
    finally:
        for process in reversed(processes):
            process.terminate()
            process.wait(timeout=30)
