"""Abuse of the serving path, on loopback: real processes (``copse worker mock``, ``copse router
run`` and, with NATS, ``copse worker kv-relay``) under a normal streaming load with malformed, huge,
slow and abandoned requests mixed in.

:func:`serving` starts the processes and reads their resident memory (RSS and its peak, from
``/proc``);
:func:`soak` runs the mix for a bounded time and count and reports what it tried, which good
requests failed (none may) and each process's peak RSS. The abuse suite in the tests and
``benchmarks/abuse_soak.py`` both run it, with different sizes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import multiprocessing
import multiprocessing.queues
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import yaml

from copse.router.clients import CLIENT_KEEPALIVE_S
from copse.workers.testing import free_port

MODEL = "mock-model"
ABUSES = ("malformed", "malformed", "huge", "slow", "abandoned")
"""The abusive requests, drawn at random (malformed ones twice as often)."""
MIB = 1024 * 1024
GOOD_CHAT = [{"role": "user", "content": "Say something about trees."}]


def rss_bytes(pid: int, *, peak: bool = False) -> int:
    """Resident memory of process ``pid`` (Linux ``/proc``), now or (``peak``) its high-water mark
    since it started, which no sampling can miss; 0 once it is gone."""
    field = "VmHWM:" if peak else "VmRSS:"
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


@dataclasses.dataclass
class Served:
    """The processes under test: their URLs and peak RSS so far (read by :meth:`sample`)."""

    router_url: str
    engine_url: str
    relay_url: str | None
    processes: dict[str, subprocess.Popen[bytes]]
    peak_rss: dict[str, int] = dataclasses.field(default_factory=dict)

    def sample(self) -> dict[str, int]:
        """Sample every process's RSS now (and keep the peaks); raises if one has exited."""
        now = {}
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode} under abuse")
            now[name] = rss_bytes(process.pid)
            self.peak_rss[name] = rss_bytes(process.pid, peak=True)
        return now

    async def sample_every(self, period_s: float) -> None:
        while True:
            self.sample()
            await asyncio.sleep(period_s)


def _wait_http(url: str, process: subprocess.Popen[bytes], *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited with {process.returncode} at start-up")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer 200 within {timeout_s} s")
        time.sleep(0.1)


@contextlib.contextmanager
def serving(
    *,
    workdir: Path,
    router_settings: dict[str, Any] | None = None,
    engine_args: tuple[str, ...] = (),
    nats_url: str | None = None,
    start_timeout_s: float = 60.0,
) -> Iterator[Served]:
    """Run a mocked engine, a router in front of it and (with ``nats_url``) a KV relay draining the
    engine, each its own process on 127.0.0.1; stopped (by pid) on exit."""
    copse = str(Path(sys.executable).parent / "copse")
    processes: dict[str, subprocess.Popen[bytes]] = {}
    logs = {name: (workdir / f"{name}.log").open("wb") for name in ("engine", "router", "relay")}
    try:
        engine_port, router_port = free_port(), free_port()
        engine_url = f"http://127.0.0.1:{engine_port}"
        processes["engine"] = subprocess.Popen(
            [copse, "worker", "mock", "--engines", "1", "--port-base", str(engine_port), *engine_args],
            stdout=logs["engine"],
            stderr=subprocess.STDOUT,
        )
        _wait_http(f"{engine_url}/health", processes["engine"], timeout_s=start_timeout_s)
        config = {
            "model": MODEL,
            "engine": "mock",
            "port": router_port,
            "discovery": {"kind": "static", "workers": [{"url": engine_url}]},
            **(router_settings or {}),
        }
        config_path = workdir / "router.yaml"
        config_path.write_text(yaml.safe_dump(config))
        processes["router"] = subprocess.Popen(
            [copse, "router", "run", "--config", str(config_path)],
            stdout=logs["router"],
            stderr=subprocess.STDOUT,
        )
        router_url = f"http://127.0.0.1:{router_port}"
        _wait_http(f"{router_url}/health", processes["router"], timeout_s=start_timeout_s)
        relay_url = None
        if nats_url is not None:
            relay_port = free_port()
            processes["relay"] = subprocess.Popen(
                [
                    copse,
                    "worker",
                    "kv-relay",
                    "--engine",
                    engine_url,
                    "--nats",
                    nats_url,
                    "--deployment",
                    "abuse",
                    "--worker-id",
                    "abused",
                    "--metrics-port",
                    str(relay_port),
                ],
                stdout=logs["relay"],
                stderr=subprocess.STDOUT,
            )
            relay_url = f"http://127.0.0.1:{relay_port}"
            _wait_http(f"{relay_url}/metrics", processes["relay"], timeout_s=start_timeout_s)
        served = Served(
            router_url=router_url, engine_url=engine_url, relay_url=relay_url, processes=processes
        )
        served.sample()
        yield served
    finally:
        for process in processes.values():
            if process.poll() is None:
                os.kill(process.pid, signal.SIGTERM)
        for process in processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for log in logs.values():
            log.close()


@dataclasses.dataclass
class SoakReport:
    """What a soak tried and what came of it."""

    tried: Counter[str] = dataclasses.field(default_factory=Counter)
    """Requests (or connections) tried, by kind."""
    statuses: Counter[str] = dataclasses.field(default_factory=Counter)
    """``kind status`` of every answer the abusive requests got."""
    good_failed: list[str] = dataclasses.field(default_factory=list)
    """Why each failed good request failed."""
    server_errors: list[str] = dataclasses.field(default_factory=list)
    """Abusive requests answered with a 5xx or a dropped connection (none may be)."""

    @property
    def total(self) -> int:
        return sum(self.tried.values())


async def _good_stream(http: aiohttp.ClientSession, url: str, *, client: int, max_tokens: int) -> str | None:
    """One normal streamed chat; the reason it failed, or ``None``."""
    body = {"model": MODEL, "messages": GOOD_CHAT, "max_tokens": max_tokens, "stream": True}
    headers = {"x-gateway-inference-fairness-id": f"good-{client}"}
    try:
        async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as response:
            if response.status != 200:
                return f"status {response.status}: {(await response.text())[:200]}"
            last = b""
            async for line in response.content:
                if line.startswith(b"data:"):
                    if b'"error"' in line:
                        return f"error event: {line[:200]!r}"
                    last = line.strip()
            return None if last == b"data: [DONE]" else f"stream ended without [DONE] (last {last[:80]!r})"
    except (aiohttp.ClientError, TimeoutError) as exc:
        return repr(exc)


def malformed_bodies() -> list[bytes]:
    """Bodies a client should get a 4xx for (built once: some are megabytes, and building them per
    request would load the soak's own event loop, which also runs the good clients)."""
    chat = {"model": MODEL, "messages": GOOD_CHAT}
    return [
        b"{" * 5000,
        b"[" * 5000 + b"]" * 5000,
        b'{"model": "mock-model", "messages": [{"role": "alien", "content": "x"}]}',
        json.dumps({**chat, "max_tokens": 10**12}).encode(),
        json.dumps({**chat, "n": 10**9}).encode(),
        json.dumps({**chat, "stop": ["x"] * 100_000}).encode(),
        json.dumps({**chat, "logit_bias": {str(i): 1 for i in range(50_000)}}).encode(),
        json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 100_000}).encode(),
        json.dumps({"model": MODEL, "messages": [[]] * 200_000}).encode(),
        json.dumps({"model": MODEL, "prompt": [2**40]}).encode(),
        b'{"model": "mock-model", "messages": "\xff\xfe"}',
    ]


async def _abusive(
    http: aiohttp.ClientSession,
    url: str,
    *,
    kind: str,
    rng: random.Random,
    report: SoakReport,
    slow_s: float,
    malformed: list[bytes],
    huge: list[bytes],
) -> None:
    """One abusive request of ``kind``; a 5xx or a dropped connection goes to ``server_errors``."""
    host, port = url.removeprefix("http://").split(":")
    report.tried[kind] += 1
    try:
        if kind == "malformed":
            path = rng.choice(["/v1/chat/completions", "/v1/completions"])
            headers = {"Content-Type": "application/json", "x-gateway-inference-fairness-id": "abuser"}
            which = rng.randrange(len(malformed) + 2)  # random bytes as often as two of the others
            body = malformed[which] if which < len(malformed) else rng.randbytes(rng.randint(1, 2000))
            kind = f"malformed[{which if which < len(malformed) else 'random'}]"
            async with http.post(f"{url}{path}", data=body, headers=headers) as response:
                await response.read()
                status = response.status
        elif kind == "huge":
            body = rng.choice(huge)
            async with http.post(
                f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
            ) as r:
                await r.read()
                status = r.status
        elif kind == "abandoned":
            chat = {"model": MODEL, "messages": GOOD_CHAT, "max_tokens": 5000, "stream": True}
            headers = {"x-gateway-inference-fairness-id": "abuser"}
            response = await http.post(f"{url}/v1/chat/completions", json=chat, headers=headers)
            status = response.status
            if status == 200:
                await response.content.readline()
            response.close()
        else:  # slow: a request head that never ends, or a body that never comes
            reader, writer = await asyncio.open_connection(host, int(port))
            head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            if rng.random() < 0.5:
                writer.write(head)
            else:
                writer.write(head + b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")
            await writer.drain()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(reader.read(1024), slow_s)
            writer.close()
            status = 0
    except (aiohttp.ClientError, ConnectionError) as exc:
        if kind == "huge":  # the router may close after answering 413 before the upload ended
            report.statuses[f"{kind} closed"] += 1
            return
        report.server_errors.append(f"{kind}: {exc!r}")
        return
    if status >= 500:
        report.server_errors.append(f"{kind}: status {status}")
    report.statuses[f"{kind.split('[')[0]} {status}"] += 1


async def soak(
    served: Served,
    *,
    duration_s: float,
    good_clients: int,
    abusers: int,
    max_requests: int,
    max_tokens: int = 16,
    seed: int = 0,
    kinds: tuple[str, ...] = ABUSES,
) -> SoakReport:
    """``good_clients`` loops of normal streams here and ``abusers`` loops of abusive requests
    (drawn from ``kinds``, :data:`ABUSES` by default) in another process, so that building and
    uploading abusive bodies does not slow the good clients' own event loop; each side stops after
    ``duration_s`` or ``max_requests`` requests. RSS is sampled meanwhile."""
    report = SoakReport()
    deadline = time.time() + duration_s
    url = served.router_url
    results: multiprocessing.queues.Queue[SoakReport] = _SPAWN.Queue()
    attack = _SPAWN.Process(
        target=_abuse_process,
        kwargs={
            "url": url, "abusers": abusers, "deadline": deadline, "max_requests": max_requests,
            "seed": seed, "kinds": kinds, "results": results,
        },
    )  # fmt: skip
    if abusers:
        attack.start()

    async def good(client: int, http: aiohttp.ClientSession) -> None:
        while time.time() < deadline and report.tried["good"] < max_requests:
            report.tried["good"] += 1
            failure = await _good_stream(http, url, client=client, max_tokens=max_tokens)
            if failure is not None:
                report.good_failed.append(failure)

    sampler = asyncio.create_task(served.sample_every(0.2))
    try:
        async with _session() as http:
            await asyncio.gather(*(good(i, http) for i in range(good_clients)))
        if abusers:
            abused = await asyncio.to_thread(results.get, timeout=duration_s + 120)
            await asyncio.to_thread(attack.join)
            report.tried.update(abused.tried)
            report.statuses.update(abused.statuses)
            report.server_errors.extend(abused.server_errors)
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        if attack.is_alive():
            attack.kill()
    served.sample()
    return report


_SPAWN = multiprocessing.get_context("spawn")


def _abuse_process(
    *,
    url: str,
    abusers: int,
    deadline: float,
    max_requests: int,
    seed: int,
    kinds: tuple[str, ...],
    results: multiprocessing.queues.Queue[SoakReport],
) -> None:
    """The abusers' side of :func:`soak` (its own process and event loop)."""
    report = SoakReport()
    rng = random.Random(seed)
    bodies = malformed_bodies()
    huge = [b'{"model": "mock-model", "prompt": "' + b"a" * size + b'"}' for size in (8 * MIB, 70 * MIB)]

    async def bad(http: aiohttp.ClientSession) -> None:
        local = random.Random(rng.random())
        while time.time() < deadline and report.total < max_requests:
            kind = kinds[local.randrange(len(kinds))]
            await _abusive(
                http, url, kind=kind, rng=local, report=report, slow_s=2.0, malformed=bodies, huge=huge
            )

    async def attack() -> None:
        async with _session() as http:
            await asyncio.gather(*(bad(http) for _ in range(abusers)))

    asyncio.run(attack())
    results.put(report)


@contextlib.asynccontextmanager
async def _session() -> AsyncIterator[aiohttp.ClientSession]:
    timeout = aiohttp.ClientTimeout(total=120)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        yield http
