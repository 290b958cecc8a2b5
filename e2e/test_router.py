"""The router end to end: the official ``openai`` client through the router to mocked engines, two
router replicas sharing one pool over NATS, and pod discovery against a real API server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from e2e.local_router import MODEL, until
from e2e.local_router import static_router as _router

from copse.cluster import Kubectl
from copse.router.discovery import Endpoint, KubeAioPodApi, KubernetesSource
from copse.router.sequences import ActiveSequences
from copse.workers.testing import mock_fleet

pytestmark = pytest.mark.e2e


async def test_openai_client_streams_through_the_router(nats_url: str) -> None:
    async with (
        mock_fleet(engines=2, nats_url=nats_url, deployment="openai") as fleet,
        _router(fleet.urls, nats_url=nats_url, deployment="openai") as running,
    ):
        client = openai.AsyncOpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
        stream = await client.completions.create(
            model=MODEL, prompt="The quick brown fox jumps over the lazy dog", max_tokens=8, stream=True
        )
        pieces = [chunk.choices[0].text async for chunk in stream if chunk.choices]
        assert len(pieces) == 8
        assert all(piece.strip() for piece in pieces)
        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say something."}], max_tokens=4, stream=True
        )
        deltas = [chunk.choices[0].delta.content async for chunk in chat if chunk.choices]
        assert "".join(d for d in deltas if d).strip()
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="other", prompt="x", max_tokens=1)
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            await client.completions.create(model=MODEL, prompt="x", max_tokens=0)
        await client.close()


async def test_two_router_replicas_keep_one_pool_balanced(nats_url: str) -> None:
    """Rounds of 3 long requests through one replica then 1 through the other. A replica that did
    not see the other's load would pick among engines it believes idle (3 of 4 are not); with
    shared load every request lands on a least-loaded engine, so the pool stays balanced."""
    async with (
        mock_fleet(engines=4, nats_url=nats_url, deployment="balance") as fleet,
        _router(fleet.urls, nats_url=nats_url, deployment="balance") as one,
        _router(fleet.urls, nats_url=nats_url, deployment="balance") as two,
    ):
        assert one.replica_sync is not None
        assert two.replica_sync is not None
        sync_one, sync_two = one.replica_sync, two.replica_sync
        await until(lambda: bool(sync_one.peers) and bool(sync_two.peers))
        clients = {
            name: openai.AsyncOpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
            for name, running in (("one", one), ("two", two))
        }
        views = [one.service.router.sequences, two.service.router.sequences]
        tasks = []
        for i in range(16):
            prompt = [1000 + 97 * i + t for t in range(256)]  # distinct prompts: no cache pull
            client = clients["two" if i % 4 == 3 else "one"]
            tasks.append(
                asyncio.create_task(client.completions.create(model=MODEL, prompt=prompt, max_tokens=400))
            )
            # Both replicas account for every request routed so far before the next decision.
            await until(_accounted(views, i + 1), timeout_s=10)
        in_flight = [len(server.engine.requests) for server in fleet.servers]
        assert sum(in_flight) == 16
        assert max(in_flight) - min(in_flight) <= 1, in_flight
        for task in tasks:
            await task
        for client in clients.values():
            await client.close()


def _accounted(views: list[ActiveSequences], routed: int) -> Callable[[], bool]:
    return lambda: all(view.requests.sum() == routed for view in views)


def _pod(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "containers": [{"name": "engine", "image": "registry.k8s.io/pause:3.10"}],
            "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}],
        },
    }


async def test_pod_discovery_follows_ready_worker_pods(
    kubectl: Kubectl, kubeconfig: Path, namespace: str
) -> None:
    deployment = "disc"
    selector = f"app.kubernetes.io/component=worker,copse.dev/deployment={deployment},copse.dev/leader=true"
    labels = {
        "app.kubernetes.io/component": "worker",
        "copse.dev/deployment": deployment,
        "copse.dev/leader": "true",
        "copse.dev/role": "decode",
    }
    rank1 = {**labels, "copse.dev/leader": "false"}
    kubectl.apply([_pod("w-0", labels), _pod("w-1", labels), _pod("w-1-rank1", rank1)], namespace=namespace)
    api = await KubeAioPodApi.from_environment(kubeconfig)
    seen: list[dict[str, Endpoint]] = []
    source = KubernetesSource(api, namespace=namespace, selector=selector, port=8000)
    task = asyncio.create_task(source.run(lambda endpoints: seen.append(dict(endpoints))))
    try:
        await until(lambda: bool(seen) and set(seen[-1]) == {"w-0", "w-1"}, timeout_s=60)
        endpoint = seen[-1]["w-0"]
        assert endpoint.url.startswith("http://")
        assert endpoint.url.endswith(":8000")
        assert endpoint.role.value == "decode"
        assert endpoint.worker_id == "w-0"
        kubectl.run("delete", "pod", "w-0", "--wait=false", f"--namespace={namespace}")
        await until(lambda: set(seen[-1]) == {"w-1"}, timeout_s=60)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await api.close()
