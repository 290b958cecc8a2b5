"""Kubernetes pod discovery (with a fake API), the router config and ``copse router run`` errors."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from copse.cli import main
from copse.router.cli import router
from copse.router.config import ConfigError, KubernetesDiscovery, load_config, parse_config
from copse.router.core import Role
from copse.router.discovery import Endpoint, KubeApiError, KubernetesSource, StaticSource, endpoint_from_pod

from .conftest import eventually


def _pod(
    name: str,
    *,
    ip: str | None = "10.0.0.1",
    ready: bool = True,
    role: str = "worker",
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"copse.dev/role": role, **(labels or {})}},
        "spec": {"nodeName": f"node-{name}"},
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_endpoint_from_pod_needs_readiness_and_an_ip() -> None:
    endpoint = endpoint_from_pod(
        _pod("w-0", role="prefill", labels={"copse.dev/domain": "rack1.c0"}), port=8000
    )
    assert endpoint == Endpoint(
        key="w-0", url="http://10.0.0.1:8000", role=Role.PREFILL, worker_id="w-0", locality="rack1.c0"
    )
    assert endpoint_from_pod(_pod("w-1"), port=8000).locality == "node-w-1"  # type: ignore[union-attr]
    assert endpoint_from_pod(_pod("w-2", ready=False), port=8000) is None
    assert endpoint_from_pod(_pod("w-3", ip=None), port=8000) is None
    assert endpoint_from_pod(_pod("w-4", role="bogus"), port=8000) is None
    deleting = _pod("w-5")
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert endpoint_from_pod(deleting, port=8000) is None
    assert endpoint_from_pod(_pod("w-6", ip="fd00::1"), port=8000).url == "http://[fd00::1]:8000"  # type: ignore[union-attr]


class FakePodApi:
    """Lists, then replays scripted watch streams; a stream may end with an error."""

    def __init__(
        self, pods: list[dict[str, Any]], watches: list[list[tuple[str, dict[str, Any]] | Exception]]
    ):
        self.pods = pods
        self.watches = watches
        self.lists = 0
        self.selectors: list[str] = []

    async def list_pods(self, *, namespace: str, selector: str) -> tuple[list[dict[str, Any]], str]:
        self.lists += 1
        self.selectors.append(selector)
        return list(self.pods), str(self.lists)

    async def watch_pods(
        self, *, namespace: str, selector: str, resource_version: str
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        script = self.watches.pop(0) if self.watches else []
        for item in script:
            if isinstance(item, Exception):
                raise item
            kind, pod = item
            if kind in ("ADDED", "MODIFIED"):
                self.pods = [p for p in self.pods if p["metadata"]["name"] != pod["metadata"]["name"]] + [pod]
            else:
                self.pods = [p for p in self.pods if p["metadata"]["name"] != pod["metadata"]["name"]]
            yield kind, pod
        if not self.watches:
            await asyncio.Event().wait()  # the last watch stays open


async def test_kubernetes_source_lists_watches_and_relists_after_expiry() -> None:
    api = FakePodApi(
        [_pod("a"), _pod("b", ready=False)],
        [
            [("MODIFIED", _pod("b", ip="10.0.0.2")), KubeApiError("too old", status=410)],
            [("DELETED", _pod("a"))],
        ],
    )
    seen: list[set[str]] = []
    source = KubernetesSource(api, namespace="ns", selector="copse.dev/leader=true", port=8000, retry_s=0.01)
    task = asyncio.create_task(source.run(lambda endpoints: seen.append(set(endpoints))))
    try:
        await eventually(lambda: bool(seen) and seen[-1] == {"b"})
    finally:
        task.cancel()
    assert seen == [{"a"}, {"a", "b"}, {"b"}]
    assert api.lists == 2  # relisted after the 410
    assert api.selectors[0] == "copse.dev/leader=true"


async def test_static_source_reports_its_list() -> None:
    config = parse_config(
        {
            "model": "m",
            "engine": "mock",
            "discovery": {"kind": "static", "workers": [{"url": "http://127.0.0.1:1", "role": "decode"}]},
        },
        source="t",
    )
    assert config.discovery.kind == "static"
    seen: list[Mapping[str, Endpoint]] = []
    task = asyncio.create_task(StaticSource(config.discovery.workers).run(seen.append))
    await eventually(lambda: bool(seen))
    task.cancel()
    assert seen[0]["http://127.0.0.1:1"].role is Role.DECODE


OPERATOR_CONFIG = {
    "model": "llama",
    "engine": "mock",
    "host": "0.0.0.0",
    "port": 8080,
    "policy": "kv",
    "temperature": 0.0,
    "queue_size": 64,
    "block_size": 32,
    "nats_url": None,
    "deployment": "demo",
    "discovery": {
        "kind": "kubernetes",
        "namespace": "serving",
        "selector": "app.kubernetes.io/component=worker,copse.dev/deployment=demo,copse.dev/leader=true",
        "port": 8000,
    },
}


def test_the_operators_config_is_accepted_as_is(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(OPERATOR_CONFIG))
    config = load_config(path)
    assert isinstance(config.discovery, KubernetesDiscovery)
    assert config.namespace == "serving"  # NATS subjects follow the deployment's namespace
    assert config.thresholds().queue_size == 64
    # Unset, the threshold of contended requests is one step of the engines.
    assert config.thresholds().contended_prefill_tokens == config.max_num_batched_tokens


def test_the_onboarding_cost_per_block_follows_the_tier_bandwidths() -> None:
    config = parse_config(
        {**OPERATOR_CONFIG, "kv_offload": {"host_gbps": 64.0, "disk_gbps": 8.0}}, source="router.yaml"
    )
    settings = config.selection()
    block_bytes = 32 * 131072  # block_size x the default kv_transfer.kv_bytes_per_token
    assert settings.host_block_ms == pytest.approx(block_bytes / 64e9 * 1000.0)
    assert settings.disk_block_ms == pytest.approx(block_bytes / 8e9 * 1000.0)
    assert settings.tier_weights == (1.0, 0.8, 0.8)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"policy": "fastest"}, "policy: unknown policy 'fastest'"),
        ({"kv_offload": {"host_gbps": 0}}, "kv_offload.host_gbps: Input should be greater than 0"),
        ({"block_size": 0}, "block_size: Input should be greater than or equal to 1"),
        ({"discovery": {"kind": "dns"}}, "discovery: Input tag 'dns'"),
        ({"colour": "red"}, "colour: Extra inputs are not permitted"),
    ],
)
def test_config_errors_name_source_field_and_value(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=f"^router.yaml: {message}"):
        parse_config({**OPERATOR_CONFIG, **change}, source="router.yaml")


def test_router_run_rejects_bad_config_with_exit_1(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("model: m\ndiscovery: {kind: static, workers: []}\n")
    result = CliRunner().invoke(router, ["run", "--config", str(path)])
    assert result.exit_code == 1
    assert "router.yaml: discovery.static.workers: List should have at least 1 item" in result.stderr
    missing = CliRunner().invoke(router, ["run", "--config", str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 1
    assert "cannot read" in missing.stderr
    no_model = CliRunner().invoke(router, ["run", "--worker", "http://127.0.0.1:9"])
    assert no_model.exit_code == 1
    assert "command line: model: Field required" in no_model.stderr


@pytest.fixture
def root_logging() -> Iterator[None]:
    """The root logger's handlers and level back as they were (``copse`` configures them)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers, level


@pytest.mark.parametrize(
    ("group_level", "router_level", "info", "debug"),
    [
        ("info", "WARNING", False, False),
        ("info", "debug", True, True),
        ("warning", None, False, False),
        ("info", None, True, False),
    ],
)
@pytest.mark.usefixtures("root_logging")
def test_router_run_log_level_overrides_the_groups(
    monkeypatch: pytest.MonkeyPatch, group_level: str, router_level: str | None, info: bool, debug: bool
) -> None:
    """``copse --log-level`` configures logging first; ``router run --log-level`` still decides."""
    seen: dict[str, bool] = {}

    async def serve(config: object) -> None:
        logger = logging.getLogger("copse.router.frontend")
        seen.update(info=logger.isEnabledFor(logging.INFO), debug=logger.isEnabledFor(logging.DEBUG))

    monkeypatch.setattr("copse.router.server.serve", serve)
    args = ["--log-level", group_level, "router", "run", "--worker", "http://127.0.0.1:9", "--model", "m"]
    args += ["--engine", "mock"]
    if router_level is not None:
        args += ["--log-level", router_level]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert seen == {"info": info, "debug": debug}
