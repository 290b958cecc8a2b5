"""Assembling and running a router: config -> discovery, NATS sync, HTTP server."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import uuid

import nats
from aiohttp import web
from nats.aio.client import Client as NATS

from copse.router.config import KubernetesDiscovery, RouterConfig
from copse.router.discovery import KubeAioPodApi, KubernetesSource, PodApi, Source, StaticSource
from copse.router.frontend import RouterService
from copse.router.kv_sync import KvEventSync
from copse.router.replica_sync import ReplicaSync
from copse.router.tokens import load_tokenizer
from copse.workers.perf import load_perf_model

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class RunningRouter:
    """A router serving HTTP; :meth:`close` stops it."""

    service: RouterService
    runner: web.AppRunner
    url: str
    """Base URL it listens on."""
    nc: NATS | None
    kv_sync: KvEventSync | None
    replica_sync: ReplicaSync | None
    pod_api: KubeAioPodApi | None

    async def close(self) -> None:
        if self.kv_sync is not None:
            await self.kv_sync.stop()
        if self.replica_sync is not None:
            await self.replica_sync.stop()
        await self.runner.cleanup()
        if self.nc is not None:
            await self.nc.drain()
        if self.pod_api is not None:
            await self.pod_api.close()


def default_router_id() -> str:
    """Host name, pid and a random suffix: unique per router process."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


async def start_router(
    config: RouterConfig, *, router_id: str | None = None, pod_api: PodApi | None = None
) -> RunningRouter:
    """Start a router for ``config``; ``pod_api`` replaces the Kubernetes client (tests).
    Raises ``ValueError`` for unusable settings (perf profile, tokenizer)."""
    perf = load_perf_model(config.perf_profile, kv_capacity_tokens=config.kv_capacity_tokens)
    tokenizer = load_tokenizer(config.tokenizer)
    owned_api: KubeAioPodApi | None = None
    discovery = config.discovery
    source: Source
    if isinstance(discovery, KubernetesDiscovery):
        if pod_api is None:
            pod_api = owned_api = await KubeAioPodApi.from_environment()
        source = KubernetesSource(
            pod_api, namespace=discovery.namespace, selector=discovery.selector, port=discovery.port
        )
    else:
        source = StaticSource(discovery.workers)
    nc = await nats.connect(config.nats_url) if config.nats_url else None
    service = RouterService(
        config,
        source=source,
        perf=perf,
        tokenizer=tokenizer,
        use_kv_events=nc is not None,
        share_load=nc is not None,
    )
    kv_sync = replica_sync = None
    if nc is not None:
        kv_sync = KvEventSync(service, nc, namespace=config.namespace, deployment=config.deployment)
        await kv_sync.start()
        replica_sync = ReplicaSync(
            service,
            nc,
            namespace=config.namespace,
            deployment=config.deployment,
            router_id=router_id or default_router_id(),
            peer_timeout_s=config.peer_timeout_s,
        )
        await replica_sync.start()
    runner = web.AppRunner(service.app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    shown = f"[{host}]" if ":" in host else host
    return RunningRouter(
        service=service,
        runner=runner,
        url=f"http://{shown}:{port}",
        nc=nc,
        kv_sync=kv_sync,
        replica_sync=replica_sync,
        pod_api=owned_api,
    )


async def serve(config: RouterConfig) -> None:
    """Run a router until cancelled."""
    running = await start_router(config)
    mode = "KV events + replica sync over NATS" if running.nc is not None else "approximate (no NATS)"
    log.info("router for %s listening on %s (policy %s, %s)", config.model, running.url, config.policy, mode)
    try:
        await asyncio.Event().wait()
    finally:
        await running.close()
