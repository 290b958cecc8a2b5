"""Live replay: the real router in front of real mocked-engine processes, in wall time.

A throwaway ``nats-server`` carries the engines' KV events; ``copse worker mock`` serves the
engines (one process, consecutive ports on 127.0.0.1); ``copse router run`` routes (a process of its
own, as in a deployment, so the load generator here does not share its event loop) with static
discovery of those engines and the perf profile the replay's router model gives (by default measured
from the engines, as ``copse bench replay`` does). Every trace request is sent at its (sped-up)
arrival time as a streamed completion of synthesised token ids, and its TTFT, ITL, end-to-end
latency and cached prompt tokens are read from the stream. The report has the same shape as the
simulation's, plus how far the engines' process fell behind the engines it simulates.

A fleet may run *dilated* (``live_fleet(..., dilation=k)``): its engines ``k`` times slower and the
router's targets and workload durations ``k`` times longer, so a workload sent ``k`` times slower
(``drive(..., speedup=1 / k)``) and timed back at ``1 / k`` (:meth:`Answer.undilated`) is the same
workload, while the processes' own work (HTTP, Envoy, NATS, the router's decisions) weighs ``k``
times less against the engines' steps: how a box too small to keep up with the engines in wall
time still measures the routing rather than itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import numpy as np
import uvloop
import yaml

from copse.router.clients import CLIENT_KEEPALIVE_S
from copse.router.config import RouterConfig
from copse.sim.gateway import envoy_gateway
from copse.sim.replay import Distribution, ReplayReport, ReplaySettings
from copse.sim.trace import TokenSynth, TraceRequest
from copse.workers.metrics import MOCK_STEP_LAG_SECONDS
from copse.workers.perf import save_profile
from copse.workers.protocol.errors import as_openai_error
from copse.workers.serving import tune_collector
from copse.workers.testing import free_port, free_port_range, nats_server

MODEL = "live-replay"
DEPLOYMENT = "live-replay"
ONE_CLIENT_FOR_MANY = 1_000_000
"""The router's per-client bounds here (``clients.max_requests`` and ``max_streams``): this process
sends the whole workload, which stands for a fleet's many clients, so the router's abuse protection
(:mod:`copse.router.clients`: 512 requests of one client at once by default) must not refuse it as
one client holding more than its share; the twin has no such bound either."""
HEALTH_TIMEOUT_S = 2.0
"""The router's health probe timeout here: every engine of a live replay shares one Python process
on a machine shared with the router, this client and whatever else runs, so a probe can wait behind
the other engines' steps for longer than the 0.5 s default meant for engine pods of their own (then
the router dropped healthy engines and migrated their streams)."""


@contextlib.contextmanager
def _nats() -> Iterator[str]:
    with nats_server() as url:
        yield url


async def _engines(
    settings: ReplaySettings, *, block_size: int, nats_url: str, extra: Sequence[str] = ()
) -> tuple[asyncio.subprocess.Process, list[str]]:
    config = settings.engines.config
    base = free_port_range(settings.workers)
    args = [
        sys.executable, "-m", "copse.cli", "worker", "mock",
        "--engines", str(settings.workers),
        "--port-base", str(base),
        "--model", MODEL,
        "--block-size", str(block_size),
        "--max-num-seqs", str(config.max_num_seqs),
        "--max-num-batched-tokens", str(config.max_num_batched_tokens),
        "--max-model-len", str(config.max_model_len),
        "--speedup", str(config.speedup_ratio),
        "--decode-speedup", str(config.decode_speedup_ratio),
        "--kv-capacity-tokens", str(settings.engines.perf.kv_capacity_tokens),
        "--seed", str(settings.seed),
        "--nats", nats_url,
        "--deployment", DEPLOYMENT,
    ]  # fmt: skip
    if config.num_blocks is not None:
        args += ["--num-blocks", str(config.num_blocks)]
    args += extra
    process = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE)
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), timeout=60)
    if not line:
        raise RuntimeError(f"copse worker mock exited with {await process.wait()} before serving")
    return process, [f"http://127.0.0.1:{base + i}" for i in range(settings.workers)]


class Answer(NamedTuple):
    """What the client saw of one streamed completion (times in s, NaN where they did not happen)."""

    status: int
    """HTTP status of the answer (0: none, the connection failed)."""
    retry_after: str | None
    """The ``Retry-After`` header of a refused request."""
    ttft_s: float
    itl_s: float
    """Mean gap between the streamed tokens."""
    e2e_s: float
    """Until the last token; NaN unless the stream completed."""
    cached: int
    """Prompt tokens the engine found cached."""
    outputs: int
    error: str | None = None
    """Why the stream did not complete: the status and message of a refusal, the error event that
    ended it, or the client's exception; ``None`` when it completed."""

    def undilated(self, dilation: float) -> Answer:
        """The times of an answer from a fleet dilated ``dilation`` times, in the workload's time."""
        return self._replace(
            ttft_s=self.ttft_s / dilation, itl_s=self.itl_s / dilation, e2e_s=self.e2e_s / dilation
        )


def _message(body: bytes, *, status: int) -> str:
    """The message of an error answer or error event, whatever its shape (:func:`as_openai_error`
    puts every one in the shape whose ``error.message`` is a string)."""
    return str(json.loads(as_openai_error(body, status=status))["error"]["message"])[:200]


async def send(
    http: aiohttp.ClientSession,
    url: str,
    *,
    tokens: Sequence[int],
    max_tokens: int,
    headers: Mapping[str, str] | None = None,
    model: str = MODEL,
) -> Answer:
    """Stream a completion of ``tokens`` from ``url`` and time it at this client."""
    body = {
        "model": model,
        "prompt": tokens,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.monotonic()
    status = 0
    retry_after = None
    first = last = math.nan
    count = cached = 0
    try:
        async with http.post(f"{url}/v1/completions", json=body, headers=headers) as response:
            status, retry_after = response.status, response.headers.get("Retry-After")
            if status != 200:
                why = f"HTTP {status}: {_message(await response.read(), status=status)}"
                return Answer(status, retry_after, math.nan, math.nan, math.nan, 0, 0, why)
            async for line in response.content:
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    why = f"stream error after {count} tokens: {_message(line[5:], status=status)}"
                    return Answer(status, retry_after, first - start, math.nan, math.nan, cached, count, why)
                if event.get("choices"):
                    now = time.monotonic()
                    if count == 0:
                        first = now
                    last = now
                    count += 1
                usage = event.get("usage")
                if usage and usage.get("prompt_tokens_details"):
                    cached = int(usage["prompt_tokens_details"].get("cached_tokens", 0))
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
        why = f"client {type(exc).__name__} after {count} tokens: {exc}"
        return Answer(status, retry_after, first - start, math.nan, math.nan, cached, count, why)
    if count == 0:
        why = "stream ended without a token"
        return Answer(status, retry_after, math.nan, math.nan, math.nan, cached, 0, why)
    itl = (last - first) / (count - 1) if count > 1 else math.nan
    return Answer(status, retry_after, first - start, itl, last - start, cached, count)


async def _router(
    config: dict[str, Any], *, workdir: Path, workers: int, url: str
) -> asyncio.subprocess.Process:
    """``copse router run`` with ``config``, once it lists all ``workers`` as live at ``url``."""
    path = workdir / f"router-{config['port']}.yaml"
    path.write_text(yaml.safe_dump(config))
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "copse.cli", "router", "run", "--config", str(path), "--log-level", "WARNING"
    )
    deadline = time.monotonic() + 60
    try:
        async with aiohttp.ClientSession() as http:
            while True:
                if process.returncode is not None:
                    raise RuntimeError(f"copse router run exited with {process.returncode} before serving")
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"{url}/workers") as response:
                        if response.status == 200 and len((await response.json())["workers"]) >= workers:
                            return process
                if time.monotonic() > deadline:
                    raise RuntimeError("the router did not see every mocked engine healthy within 60 s")
                await asyncio.sleep(0.1)
    except BaseException:  # a failed start or Ctrl-C must not leave the router running
        if process.returncode is None:
            process.terminate()
            await process.wait()
        raise


async def metric_total(urls: Sequence[str], name: str) -> float:
    """The sum of every sample of metric ``name`` (all label sets) that ``urls`` (Prometheus text
    pages) expose."""
    total = 0.0
    async with aiohttp.ClientSession() as http:
        for url in urls:
            async with http.get(url) as response:
                for line in (await response.text()).splitlines():
                    if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
                        total += float(line.rsplit(" ", 1)[1])
    return total


async def mean_lag_ms(urls: Sequence[str]) -> float:
    """Mean delivery lag of the engines' steps behind their timeline (``copse_mock_step_lag_seconds``)."""
    pages = [f"{url}/prometheus/metrics" for url in urls]
    count = await metric_total(pages, f"{MOCK_STEP_LAG_SECONDS}_count")
    return await metric_total(pages, f"{MOCK_STEP_LAG_SECONDS}_sum") / count * 1000 if count else 0.0


#: Router settings that are durations of the workload rather than of the processes' own work: a
#: dilated fleet stretches them with its engines.
_WORKLOAD_DURATIONS = ("queue_timeout_s", "request_timeout_s", "token_timeout_s", "rate_window_s")


def _check_dilation(dilation: float) -> None:
    if not (dilation >= 1 and math.isfinite(dilation)):
        raise ValueError(f"dilation must be a finite number >= 1, got {dilation}")


def dilate_router(config: Mapping[str, Any], dilation: float) -> dict[str, Any]:
    """``config`` (a ``copse router run`` config) for engines ``dilation`` times slower: its workload
    durations (default or given) and every objective's and the SLO's targets that much longer."""
    _check_dilation(dilation)
    out = dict(config)
    for name in _WORKLOAD_DURATIONS:
        out[name] = float(out.get(name, RouterConfig.model_fields[name].default)) * dilation

    def targets(settings: Mapping[str, Any]) -> dict[str, Any]:
        return {
            key: value * dilation if key in ("ttft_ms", "itl_ms") and value is not None else value
            for key, value in settings.items()
        }

    if "objectives" in out:
        out["objectives"] = {name: targets(objective) for name, objective in out["objectives"].items()}
    for name in ("default_objective", "slo"):
        if out.get(name) is not None:
            out[name] = targets(out[name])
    return out


@dataclasses.dataclass(frozen=True)
class LiveFleet:
    """Mocked engines behind router processes (or one router and Envoy in front of it, as a gateway)."""

    urls: list[str]
    """Where clients send requests: each router replica, or Envoy asking the router as endpoint
    picker."""
    admin_urls: list[str]
    """Where each router serves ``/metrics`` and ``/workers`` (as a picker: its metrics port)."""
    engine_urls: list[str]

    def targets(self, replica_of: Sequence[int] | None = None) -> str | list[str]:
        """Where :func:`drive` sends each request: all to the first URL, or the ``i``-th to
        replica ``replica_of[i]``."""
        return self.urls[0] if replica_of is None else [self.urls[replica] for replica in replica_of]


@contextlib.asynccontextmanager
async def live_fleet(
    settings: ReplaySettings,
    *,
    router: Mapping[str, Any] | None = None,
    gateway: bool = False,
    engine_args: Sequence[str] = (),
    dilation: float = 1.0,
    replicas: int = 1,
) -> AsyncIterator[LiveFleet]:
    """Start ``settings.workers`` mocked engines (``engine_args`` added to ``copse worker mock``)
    and ``replicas`` ``copse router run`` processes before them, sharing their load over the NATS
    server as a deployment's router replicas do, their config the replay's with ``router`` on top;
    with ``gateway``, one router serves as endpoint picker too and a real Envoy fronts it
    (:mod:`copse.sim.gateway`). With ``dilation`` k, the engines run k times slower and the router's
    config is :func:`dilate_router`'s (``router`` in the workload's time): see the module's text."""
    _check_dilation(dilation)
    if replicas < 1 or (gateway and replicas != 1):
        raise ValueError(f"replicas must be >= 1, and 1 behind a gateway (one picker), got {replicas}")
    if dilation != 1.0:
        base = settings.engines.config
        slowed = dataclasses.replace(base, speedup_ratio=base.speedup_ratio / dilation)
        settings = dataclasses.replace(settings, engines=dataclasses.replace(settings.engines, config=slowed))
    engine_config = settings.engine_config()
    block_size = engine_config.block_size
    if settings.trace_block_size % block_size:
        raise ValueError(
            f"engine block_size {block_size} must divide the trace block size {settings.trace_block_size}"
        )
    router_perf = settings.router_model.resolve(config=engine_config, perf=settings.engines.perf)
    with _nats() as nats_url, tempfile.TemporaryDirectory(prefix="copse-live-") as workdir:
        profile = Path(workdir) / "router-profile.npz"
        save_profile(router_perf, profile, max_context_length=engine_config.max_model_len)
        process, urls = await _engines(settings, block_size=block_size, nats_url=nats_url, extra=engine_args)
        try:
            config = {
                "model": MODEL,
                "engine": "mock",
                "policy": settings.policy,
                "temperature": settings.temperature,
                "objective": settings.objective,
                "decode_weight": settings.decode_weight,
                "block_size": block_size,
                "queue_size": settings.thresholds.queue_size,
                "busy_prefill_tokens": settings.thresholds.busy_prefill_tokens,
                "contended_prefill_tokens": settings.thresholds.contended_prefill_tokens,
                "busy_kv_fraction": settings.thresholds.busy_kv_fraction,
                "rate_window_s": settings.thresholds.rate_window_s,
                "nats_url": nats_url,
                "deployment": DEPLOYMENT,
                "max_num_batched_tokens": engine_config.max_num_batched_tokens,
                "kv_capacity_tokens": settings.engines.perf.kv_capacity_tokens,
                "perf_profile": str(profile),
                "health_timeout_s": HEALTH_TIMEOUT_S,
                "clients": {"max_requests": ONE_CLIENT_FOR_MANY, "max_streams": ONE_CLIENT_FOR_MANY},
                "discovery": {"kind": "static", "workers": [{"url": url} for url in urls]},
                "seed": settings.seed,
                **(router or {}),
            }
            if dilation != 1.0:
                config = dilate_router(config, dilation)
            routers: list[asyncio.subprocess.Process] = []
            try:
                if gateway:
                    port = free_port_range(3)
                    # The picker serves /workers on its metrics port, not on the router's.
                    epp = {"grpc_port": port + 1, "health_port": None, "metrics_port": port + 2}
                    admin_url = f"http://127.0.0.1:{port + 2}"
                    routers.append(
                        await _router(
                            {**config, "port": port, "epp": epp},
                            workdir=Path(workdir),
                            workers=settings.workers,
                            url=admin_url,
                        )
                    )
                    with envoy_gateway(
                        picker=f"127.0.0.1:{port + 1}",
                        upstream="original_dst",
                        engines=urls,
                        scratch=Path(workdir),
                        dilation=dilation,
                    ) as url:
                        yield LiveFleet(urls=[url], admin_urls=[admin_url], engine_urls=urls)
                else:
                    router_urls = []
                    for _ in range(replicas):
                        port = free_port()
                        router_url = f"http://127.0.0.1:{port}"
                        routers.append(
                            await _router(
                                {**config, "port": port},
                                workdir=Path(workdir),
                                workers=settings.workers,
                                url=router_url,
                            )
                        )
                        router_urls.append(router_url)
                    yield LiveFleet(urls=router_urls, admin_urls=router_urls, engine_urls=urls)
            finally:
                for router_process in routers:
                    router_process.terminate()
                    await router_process.wait()
        finally:
            process.terminate()
            await process.wait()


async def live_replay(
    trace: Sequence[TraceRequest],
    settings: ReplaySettings,
    *,
    progress: Callable[[int], object] | None = None,
) -> ReplayReport:
    """Replay ``trace`` in wall time through a real router and real mocked engines."""
    started = time.perf_counter()
    synth = TokenSynth(seed=settings.seed, trace_block_size=settings.trace_block_size)
    async with live_fleet(settings) as fleet:
        (url,) = fleet.urls
        answers = await drive(url, trace, speedup=settings.speedup, synth=synth, progress=progress)
        lag_ms = await mean_lag_ms(fleet.engine_urls)
    ttft, itl, e2e, cached, outputs = (
        np.array(column, dtype=np.float64)
        for column in zip(*((a.ttft_s, a.itl_s, a.e2e_s, a.cached, a.outputs) for a in answers), strict=True)
    )
    done = ~np.isnan(e2e)
    prompts = np.array([r.input_length for r in trace], dtype=np.float64)
    span = float(np.nanmax(e2e + np.array([r.timestamp_ms / 1000 / settings.speedup for r in trace])))
    return ReplayReport(
        policy=settings.policy,
        workers=settings.workers,
        requests=int(done.sum()),
        ttft_ms=Distribution.of(ttft[done] * 1000),
        itl_ms=Distribution.of(itl[done] * 1000),
        e2e_ms=Distribution.of(e2e[done] * 1000),
        cache_hit_rate=float(cached[done].sum() / prompts[done].sum()) if done.any() else 0.0,
        throughput_tok_s=float(outputs[done].sum() / span) if done.any() and span > 0 else 0.0,
        failed=int((~done).sum()),
        preemptions=0,
        simulated_s=span,
        wall_s=time.perf_counter() - started,
        engine_lag_ms=lag_ms,
    )


async def drive(
    url: str | Sequence[str],
    trace: Sequence[TraceRequest],
    *,
    speedup: float,
    synth: TokenSynth,
    headers: Sequence[Mapping[str, str] | None] | None = None,
    models: Sequence[str] | None = None,
    progress: Callable[[int], object] | None = None,
) -> list[Answer]:
    """Send every request of ``trace`` at its arrival time (divided by ``speedup``) to ``url``, or
    the ``i``-th to ``url[i]`` (a router replica, say), with ``headers[i]`` for model ``models[i]``
    (a LoRA adapter, say); the answers in trace order."""
    if not isinstance(url, str) and len(url) != len(trace):
        raise ValueError(f"{len(url)} URLs for {len(trace)} requests: one URL, or one per request")
    urls = [url] * len(trace) if isinstance(url, str) else url
    tune_collector()  # this process stands for a fleet's clients: its timings must not stall either
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
        loop = asyncio.get_running_loop()
        origin = loop.time()
        tasks = []
        for index, request in enumerate(trace):
            delay = origin + request.timestamp_ms / 1000 / speedup - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            # A tuple, as the router keeps prompts (TokenIds): thousands of long prompts in flight as
            # lists would stall this client's loop at every full collection and late its timings.
            tokens = tuple(synth.tokens(request.hash_ids, request.input_length).tolist())
            extra = headers[index] if headers is not None else None
            model = models[index] if models is not None else MODEL
            tasks.append(
                asyncio.create_task(
                    send(
                        http,
                        urls[index],
                        tokens=tokens,
                        max_tokens=request.output_length,
                        headers=extra,
                        model=model,
                    )
                )
            )
            if progress is not None:
                progress(1)
        return list(await asyncio.gather(*tasks))


def run_live(
    trace: Sequence[TraceRequest],
    settings: ReplaySettings,
    *,
    progress: Callable[[int], object] | None = None,
) -> ReplayReport:
    """:func:`live_replay` from synchronous code."""
    return uvloop.run(live_replay(trace, settings, progress=progress))
