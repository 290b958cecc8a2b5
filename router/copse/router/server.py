"""Assembling and running a router: config -> discovery, NATS sync, and its frontend (the OpenAI
HTTP server, or a gateway's endpoint picker over gRPC)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
import uuid

from aiohttp import web

from copse.router.config import Discovery, KubernetesDiscovery, RouterConfig, StaticDiscovery
from copse.router.discovery import (
    InferencePoolSource,
    KubeAioPodApi,
    KubernetesSource,
    ModelSources,
    PoolApi,
    Source,
    StaticSource,
)
from copse.router.epp import EndpointPicker, PickerServer, start_picker
from copse.router.frontend import RouterService
from copse.router.kv_sync import KvEventSync
from copse.router.nats_link import NatsLink
from copse.router.objective_source import ObjectiveApi, ObjectiveFollower
from copse.router.replica_sync import ReplicaSync
from copse.router.service import RoutingService
from copse.router.tokens import load_tokenizer
from copse.workers.perf import load_perf_model
from copse.workers.serving import tune_collector

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class RunningRouter:
    """A router serving; :meth:`close` stops it."""

    service: RoutingService
    runner: web.AppRunner | None
    """The HTTP frontend's server (``None`` for an endpoint picker)."""
    url: str
    """Base URL of its HTTP server: the OpenAI API, or an endpoint picker's metrics ("" without)."""
    picker: PickerServer | None
    """The endpoint picker's gRPC server (``None`` for the HTTP frontend)."""
    link: NatsLink | None
    """The NATS connection (kept up in the background), when the config names a server."""
    kv_sync: KvEventSync | None
    replica_sync: ReplicaSync | None
    pod_api: KubeAioPodApi | None
    model_kv_syncs: list[KvEventSync] = dataclasses.field(default_factory=list)
    """KV event syncs of the further models' deployments (``RouterConfig.models``)."""

    @property
    def grpc_target(self) -> str | None:
        """``host:port`` of an endpoint picker's ext_proc service."""
        if self.picker is None:
            return None
        host = self.service.config.host
        shown = f"[{host}]" if ":" in host else host
        return f"{shown}:{self.picker.grpc_port}"

    async def drain(self, timeout_s: float) -> None:
        """Stop being ready (load balancers send new requests elsewhere; those that still come are
        served) and wait up to ``timeout_s`` for the requests in flight to end."""
        service = self.service
        service.draining = True
        service.readiness()
        log.info("draining: %d requests in flight, waiting up to %g s", service.in_flight, timeout_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while service.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if service.in_flight:
            log.warning("drain timeout: %d requests still in flight are cut", service.in_flight)

    async def close(self) -> None:
        if self.kv_sync is not None:
            await self.kv_sync.stop()
        for sync in self.model_kv_syncs:
            await sync.stop()
        if self.replica_sync is not None:
            await self.replica_sync.stop()
        if self.runner is not None:
            await self.runner.cleanup()
        if self.picker is not None:
            await self.picker.stop()
        if self.link is not None:
            await self.link.close()
        if self.pod_api is not None:
            await self.pod_api.close()


def default_router_id() -> str:
    """Host name, pid and a random suffix: unique per router process."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


async def start_router(
    config: RouterConfig,
    *,
    router_id: str | None = None,
    pod_api: PoolApi | None = None,
    objective_api: ObjectiveApi | None = None,
) -> RunningRouter:
    """Start a router for ``config``; ``pod_api`` and ``objective_api`` replace the Kubernetes
    client (tests). Raises ``ValueError`` for unusable settings (perf profile, tokenizer, ports)."""
    perf = load_perf_model(config.perf_profile, kv_capacity_tokens=config.kv_capacity_tokens)
    if config.engine == "trtllm" and config.perf_profile is None:
        log.warning(
            "no perf_profile: predicted TTFT uses copse's generic latency model scaled to %d KV tokens; "
            "profile the engines (copse planner profile) and set spec.router.perfProfile for real figures",
            perf.kv_capacity_tokens,
        )
    tokenizer = load_tokenizer(config)
    owned_api: KubeAioPodApi | None = None

    async def source_of(discovery: Discovery) -> Source:
        nonlocal pod_api, owned_api
        if isinstance(discovery, StaticDiscovery):
            return StaticSource(discovery.workers)
        if pod_api is None:
            pod_api = owned_api = await KubeAioPodApi.from_environment()
        if isinstance(discovery, KubernetesDiscovery):
            return KubernetesSource(
                pod_api, namespace=discovery.namespace, selector=discovery.selector, port=discovery.port
            )
        return InferencePoolSource(pod_api, namespace=discovery.namespace, name=discovery.name)

    source = await source_of(config.discovery)
    if config.models:
        sources = {config.model: source}
        for served in config.models:
            sources[served.name] = await source_of(served.discovery)
        source = ModelSources(sources)
    router_id = router_id or default_router_id()
    link = None
    if config.nats_url:
        link = NatsLink(config.nats_url, name=router_id, backoff_max_s=config.nats_reconnect_max_s)
    service: RoutingService
    synced = link is not None
    if config.epp is not None:
        service = EndpointPicker(
            config,
            settings=config.epp,
            source=source,
            perf=perf,
            tokenizer=tokenizer,
            use_kv_events=synced,
            share_load=synced,
        )
    else:
        service = RouterService(
            config, source=source, perf=perf, tokenizer=tokenizer, use_kv_events=synced, share_load=synced
        )
    objectives = config.inference_objectives
    if objectives is not None:
        if objective_api is None:
            if owned_api is None:
                owned_api = await KubeAioPodApi.from_environment()
            objective_api = owned_api
        follower = ObjectiveFollower(
            objective_api,
            namespace=objectives.namespace or config.namespace,
            pool=objectives.pool,
            api_version=objectives.api_version,
            interval_s=objectives.interval_s,
            on_change=service.classes.set_priorities,
        )
        service.add_task(asyncio.create_task(follower.run(), name="inference-objectives"))
        # A starting router reads the objectives before it takes traffic (until recovery_timeout_s).
        service.readiness_checks.append(
            lambda: None if follower.current is not None else "a first list of InferenceObjectives"
        )
    kv_sync = replica_sync = None
    model_kv_syncs: list[KvEventSync] = []
    if link is not None:
        link_url = config.nats_url
        link.on_state = service.set_nats_connected
        service.readiness_checks.append(lambda: None if link.connected else f"a NATS connection ({link_url})")
        kv_sync = KvEventSync(
            service,
            link,
            namespace=config.namespace,
            deployment=config.deployment,
            model=config.model if config.models else None,
        )
        await kv_sync.start()
        for served in config.models:
            assert served.deployment is not None, "the config requires it with nats_url"
            discovered = None if isinstance(served.discovery, StaticDiscovery) else served.discovery.namespace
            sync = KvEventSync(
                service,
                link,
                namespace=served.namespace or discovered or config.namespace,
                deployment=served.deployment,
                model=served.name,
            )
            await sync.start()
            model_kv_syncs.append(sync)
        replica_sync = ReplicaSync(
            service,
            link,
            namespace=config.namespace,
            deployment=config.deployment,
            router_id=router_id,
            peer_timeout_s=config.peer_timeout_s,
        )
        await replica_sync.start()
        await link.start()
    runner = picker = None
    if isinstance(service, EndpointPicker):
        picker = await start_picker(service, host=config.host)
        url = picker.metrics_url or ""
    else:
        assert isinstance(service, RouterService)
        # aiohttp closes a connection that has not sent a whole request head within
        # keepalive_timeout of opening (or of its last answer): slow headers hold nothing longer.
        runner = web.AppRunner(
            service.app, access_log=None, keepalive_timeout=config.clients.header_timeout_s
        )
        await runner.setup()
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        shown = f"[{host}]" if ":" in host else host
        url = f"http://{shown}:{port}"
    return RunningRouter(
        service=service,
        runner=runner,
        url=url,
        picker=picker,
        link=link,
        kv_sync=kv_sync,
        model_kv_syncs=model_kv_syncs,
        replica_sync=replica_sync,
        pod_api=owned_api,
    )


async def serve(config: RouterConfig) -> None:
    """Run a router until SIGTERM or SIGINT, then drain it (see :meth:`RunningRouter.drain`)."""
    running = await start_router(config)
    tune_collector()
    mode = "KV events + replica sync over NATS" if running.link is not None else "approximate (no NATS)"
    if running.picker is not None:
        log.info(
            "endpoint picker for %s: ext_proc on %s (metrics %s; policy %s, %s)",
            config.model,
            running.grpc_target,
            running.url or "off",
            config.policy,
            mode,
        )
    else:
        log.info(
            "router for %s listening on %s (policy %s, %s)", config.model, running.url, config.policy, mode
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
        await running.drain(config.drain_timeout_s)
    finally:
        await running.close()
