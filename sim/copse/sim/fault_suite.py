"""Running the fault suite (:mod:`copse.sim.faults` describes it): the processes of a scenario,
its clients and the fault injection."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from copse.router import metrics as router_metrics
from copse.sim.faults import (
    DEPLOYMENT,
    MODEL,
    SCENARIOS,
    FaultSettings,
    ScenarioResult,
    StreamOutcome,
    prompts,
)
from copse.workers.testing import free_port_range, nats_server_binary


class _Process:
    """A child process of the suite, with its log file."""

    def __init__(self, name: str, process: asyncio.subprocess.Process, log: Path) -> None:
        self.name = name
        self.process = process
        self.log = log

    def signal(self, signum: int) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signum)

    async def kill(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        await self.process.wait()


class _Deployment:
    """NATS, engines and routers of one scenario (see the module documentation)."""

    def __init__(self, settings: FaultSettings, workdir: Path) -> None:
        self.settings = settings
        self.workdir = workdir
        self.nats: _Process | None = None
        self.nats_port = free_port_range(1)
        self.engines: list[_Process] = []
        self.engine_urls: list[str] = []
        self.routers: list[_Process] = []
        self.router_urls: list[str] = []

    @property
    def nats_url(self) -> str:
        return f"nats://127.0.0.1:{self.nats_port}"

    async def _spawn(self, name: str, *args: str, stdout: bool = False) -> _Process:
        """Start a child; its stderr goes to ``<name>.log``, its stdout to a pipe when asked."""
        log = self.workdir / f"{name}.log"
        with log.open("ab") as sink:
            process = await asyncio.create_subprocess_exec(
                *args,
                stdout=asyncio.subprocess.PIPE if stdout else asyncio.subprocess.DEVNULL,
                stderr=sink,
                start_new_session=True,
            )
        return _Process(name, process, log)

    async def start_nats(self) -> None:
        self.nats = await self._spawn(
            "nats", nats_server_binary(), "--addr", "127.0.0.1", "--port", str(self.nats_port)
        )
        await _until(lambda: _listening(self.nats_port), what="nats-server to listen", timeout_s=15)

    async def start_engines(self) -> None:
        settings = self.settings
        base = free_port_range(settings.engines)
        starting = []
        for index in range(settings.engines):
            port = base + index
            args = [
                sys.executable, "-m", "copse.cli", "worker", "mock",
                "--engines", "1",
                "--port-base", str(port),
                "--model", MODEL,
                "--decode-speedup", str(settings.decode_speedup),
                "--nats", self.nats_url,
                "--deployment", DEPLOYMENT,
            ]  # fmt: skip
            starting.append(self._spawn(f"engine-{index}", *args, stdout=True))
            self.engine_urls.append(f"http://127.0.0.1:{port}")
        self.engines = list(await asyncio.gather(*starting))
        for engine in self.engines:
            assert engine.process.stdout is not None
            line = await asyncio.wait_for(engine.process.stdout.readline(), timeout=90)
            if not line:
                raise RuntimeError(f"{engine.name} exited before serving; see {engine.log}")

    async def start_router(self, index: int) -> None:
        port = free_port_range(1)
        config = {
            "model": MODEL,
            "engine": "mock",
            "port": port,
            "block_size": 32,
            "nats_url": self.nats_url,
            "deployment": DEPLOYMENT,
            "discovery": {"kind": "static", "workers": [{"url": url} for url in self.engine_urls]},
        }
        path = self.workdir / f"router-{index}.json"
        path.write_text(json.dumps(config))
        router = await self._spawn(
            f"router-{index}", sys.executable, "-m", "copse.cli", "router", "run", "--config", str(path)
        )
        url = f"http://127.0.0.1:{port}"
        self.routers.append(router)
        self.router_urls.append(url)
        await _until(lambda: _ready(url), what=f"router {index} to be ready (log {router.log})", timeout_s=90)

    async def close(self) -> None:
        for process in [*self.routers, *self.engines, *([self.nats] if self.nats else [])]:
            await process.kill()


async def _listening(port: int) -> bool:
    try:
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    return True


async def _ready(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as http, http.get(f"{url}/ready") as response:
            return response.status == 200
    except aiohttp.ClientError:
        return False


async def _until(condition: Callable[[], Awaitable[bool]], *, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"waited {timeout_s:g} s for {what}")
        await asyncio.sleep(0.1)


async def _metrics(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Every sample of a router's ``/metrics``: name -> labels -> value."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as response:
        text = await response.text()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


class _Client:
    """The load: one task per stream, retrying on the next replica as a Service client would."""

    def __init__(self, settings: FaultSettings, urls: list[str]) -> None:
        self.settings = settings
        self.urls = urls
        self.received = 0
        """Output tokens received by every stream so far."""

    async def run(self, http: aiohttp.ClientSession, index: int, prompt: list[int]) -> StreamOutcome:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": self.settings.max_tokens, "stream": True}
        outcome = StreamOutcome(ids=[], completed=False)
        for attempt in range(2 * len(self.urls) + 1):
            url = self.urls[(index + attempt) % len(self.urls)]
            outcome.ids = []
            try:
                if await self._stream(http, url, body, outcome):
                    return outcome
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                outcome.error = f"connection: {exc!r}"
                if outcome.ids:
                    outcome.broken += 1
                    self.received -= len(outcome.ids)
                continue
            if outcome.error:
                return outcome
        return outcome

    async def _stream(
        self, http: aiohttp.ClientSession, url: str, body: dict[str, Any], outcome: StreamOutcome
    ) -> bool:
        """Read one attempt; ``True`` when it completed, ``False`` with ``outcome.error`` when it
        failed for good; connection errors propagate (the caller retries)."""
        async with http.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                outcome.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return False
            last = time.monotonic()
            async for line in response.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    outcome.completed = True
                    outcome.error = ""
                    return True
                event = json.loads(data)
                if "error" in event:
                    outcome.error = f"error event: {event['error'].get('message')}"
                    return False
                for choice in event.get("choices") or ():
                    ids = choice.get("token_ids") or []
                    if ids:
                        now = time.monotonic()
                        outcome.max_gap_s = max(outcome.max_gap_s, now - last)
                        last = now
                        outcome.ids.extend(ids)
                        self.received += len(ids)
        raise aiohttp.ClientPayloadError("the stream ended without [DONE]")


async def _inject(name: str, deployment: _Deployment) -> None:
    """Inject the fault of scenario ``name``."""
    if name == "engine-kill":
        deployment.engines[0].signal(signal.SIGKILL)
    elif name == "two-engines-kill":
        deployment.engines[0].signal(signal.SIGKILL)
        deployment.engines[1].signal(signal.SIGKILL)
    elif name == "nats-restart":
        assert deployment.nats is not None
        await deployment.nats.kill()
        await asyncio.sleep(1.0)
        await deployment.start_nats()
    elif name == "router-kill":
        deployment.routers[0].signal(signal.SIGKILL)
    elif name == "router-drain":
        deployment.routers[0].signal(signal.SIGTERM)
    elif name == "engine-hang":
        deployment.engines[0].signal(signal.SIGSTOP)


async def run_scenario(
    name: str, settings: FaultSettings, *, reference: Sequence[list[int]] | None = None
) -> tuple[ScenarioResult, list[StreamOutcome]]:
    """Run one scenario from scratch; ``reference``: the no-fault run's ids per stream."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    with tempfile.TemporaryDirectory(prefix=f"copse-faults-{name}-") as scratch:
        deployment = _Deployment(settings, Path(scratch))
        try:
            await deployment.start_nats()
            await deployment.start_engines()
            replicas = 2 if name.startswith("router-") else 1
            for index in range(replicas):
                await deployment.start_router(index)
            if replicas == 2:  # both know each other before the load starts
                await asyncio.sleep(2.5)
            return await _drive(name, settings, deployment, reference)
        finally:
            await deployment.close()


async def _drive(
    name: str, settings: FaultSettings, deployment: _Deployment, reference: Sequence[list[int]] | None
) -> tuple[ScenarioResult, list[StreamOutcome]]:
    client = _Client(settings, deployment.router_urls)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=settings.deadline_s, sock_connect=5)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        started = time.monotonic()
        tasks = [asyncio.create_task(client.run(http, i, p)) for i, p in enumerate(prompts(settings))]
        note = ""
        if name != "none":
            target = settings.streams * settings.max_tokens / 3
            await _until(
                _reached(client, target), what="a third of the tokens", timeout_s=settings.deadline_s
            )
            await _inject(name, deployment)
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), timeout=settings.deadline_s)
        wall = time.monotonic() - started
        if name == "nats-restart":
            note = await _nats_recovery(deployment.router_urls[0])
    migrations: dict[str, int] = {}
    for url in deployment.router_urls:
        try:
            samples = (await _metrics(url)).get(f"{router_metrics.MIGRATIONS}_total", {})
        except aiohttp.ClientError:
            continue  # a replica the scenario killed, or one that drained and exited
        for labels, value in samples.items():
            reason = dict(labels)["reason"]
            migrations[reason] = migrations.get(reason, 0) + int(value)
    exact = sum(
        1
        for index, outcome in enumerate(outcomes)
        if outcome.completed and (reference is None or outcome.ids == reference[index])
    )
    result = ScenarioResult(
        scenario=name,
        streams=settings.streams,
        completed=sum(1 for outcome in outcomes if outcome.completed),
        token_exact=exact,
        failed=sum(1 for outcome in outcomes if not outcome.completed),
        broken=sum(1 for outcome in outcomes if outcome.broken),
        migrations=migrations,
        max_gap_s=max(outcome.max_gap_s for outcome in outcomes),
        wall_s=wall,
        note=note,
    )
    return result, list(outcomes)


def _reached(client: _Client, target: float) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return client.received >= target

    return check


async def _nats_recovery(url: str) -> str:
    """How the router came through the NATS restart (its mode now, resyncs done)."""
    deadline = time.monotonic() + 30
    while True:
        metrics = await _metrics(url)
        connected = metrics.get(router_metrics.NATS_CONNECTED, {}).get((), 0.0)
        if connected == 1.0 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    resyncs = metrics.get(f"{router_metrics.KV_RESYNCS}_total", {})
    after = sum(value for labels, value in resyncs.items() if dict(labels).get("reason") == "connected")
    mode = "exact again" if connected == 1.0 else "still approximate after 30 s"
    return f"router {mode}, {int(after)} worker resyncs on reconnect"


async def run_suite(
    settings: FaultSettings,
    scenarios: Sequence[str],
    *,
    progress: Callable[[ScenarioResult], object] | None = None,
) -> list[ScenarioResult]:
    """The no-fault run (the reference outputs), then each scenario."""
    baseline, outcomes = await run_scenario("none", settings)
    if baseline.failed:
        raise RuntimeError(f"{baseline.failed} streams failed without any fault; see the logs")
    reference = [outcome.ids for outcome in outcomes]
    baseline.token_exact = baseline.completed
    results = [baseline]
    if progress is not None:
        progress(baseline)
    for name in scenarios:
        if name == "none":
            continue
        result, _ = await run_scenario(name, settings, reference=reference)
        results.append(result)
        if progress is not None:
            progress(result)
    return results
