"""ModelExpress as the operator sets it up, against the real ModelExpress client (PyPI ``modelexpress``,
its own code and generated gRPC stubs): the worker pods' settings are the ones the client reads,
it reaches the server the operator runs, and a new group pointed at its source group asks that
group's leader pod for its tensor manifest on the port the operator's Service exposes.

The ModelExpress server is a Rust binary (a container image, not on PyPI): here a stand-in
implements its gRPC services (``P2pService``, and a source worker's ``WorkerService``) from the
client package's own stubs, on 127.0.0.1. The client package is installed without its engine-side
dependencies (torch, the model streamer; ``make venv``) and loaded without its ``__init__``, which
imports torch for the loaders."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from copse.api import Role
from copse.operator import children, names
from copse.operator.children import GroupLayout
from copse.workers.testing import free_port

from .conftest import make_deployment

SOURCE = GroupLayout(role=Role.WORKER, replica=0, pods=(("gpu-a", 8),), domain="d", rack="r", cost=0.0)
NEW = GroupLayout(role=Role.WORKER, replica=1, pods=(("gpu-b", 8),), domain="d", rack="r", cost=0.0)


@pytest.fixture
def mx(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """The client's modules (``client``, ``p2p_pb2``, ``p2p_pb2_grpc``, the metadata client factory)."""
    spec = importlib.util.find_spec("modelexpress")
    assert spec is not None, "make venv installs the modelexpress client"
    assert spec.submodule_search_locations
    package = types.ModuleType("modelexpress")
    package.__path__ = list(spec.submodule_search_locations)
    saved = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "modelexpress"}
    for name in saved:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "modelexpress", package)
    modules = {
        name: importlib.import_module(f"modelexpress.{name}")
        for name in ("client", "p2p_pb2", "p2p_pb2_grpc", "metadata.client_factory")
    }
    yield modules
    for name in [name for name in sys.modules if name.split(".")[0] == "modelexpress"]:
        monkeypatch.delitem(sys.modules, name, raising=False)


def _env(pod: dict[str, Any]) -> dict[str, str]:
    """The engine container's plain env values (the downward-API ones given as this pod's)."""
    values = {}
    for item in pod["spec"]["containers"][0]["env"]:
        if "value" in item:
            values[item["name"]] = item["value"]
        else:
            field = item["valueFrom"]["fieldRef"]["fieldPath"]
            values[item["name"]] = {
                "metadata.name": "pod-0",
                "metadata.uid": "uid-0",
                "metadata.namespace": "serving",
            }[field]
    return values


def _deployment() -> Any:
    return make_deployment(replicas=2, coldStart={"strategy": "modelexpress"})


def test_the_workers_reach_the_server_the_operator_runs(
    mx: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    deployment = _deployment()
    [pod] = children.worker_pods(deployment, SOURCE, cold_start_source=None)
    env = _env(pod)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    server, service, *rest = children.modelexpress_objects(deployment, source=None, source_ranks=None)
    assert not rest  # no source yet: nothing to point new groups at
    address = f"{service['metadata']['name']}.serving.svc:{service['spec']['ports'][0]['port']}"
    assert mx["client"]._get_server_url() == address  # what MxClient dials
    # with no source chosen a group uses the central server (the client's default backend)
    assert "MX_METADATA_BACKEND" not in env
    assert type(mx["metadata.client_factory"].create_metadata_client(worker_rank=0)).__name__ == "MxClient"
    assert server["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] == 8001


class _Registry:
    """A stand-in for the ModelExpress server's P2pService: sources in memory."""

    def __init__(self, mx: dict[str, Any]) -> None:
        self.pb = mx["p2p_pb2"]
        self.sources: dict[str, Any] = {}

    def PublishMetadata(self, request: Any, context: Any) -> Any:
        self.sources[request.worker_id] = request
        return self.pb.PublishMetadataResponse(success=True, mx_source_id="0123456789abcdef")

    def ListSources(self, request: Any, context: Any) -> Any:
        refs = [
            self.pb.SourceInstanceRef(
                mx_source_id="0123456789abcdef",
                worker_id=worker_id,
                model_name=published.identity.model_name,
                worker_rank=published.worker.worker_rank,
            )
            for worker_id, published in self.sources.items()
        ]
        return self.pb.ListSourcesResponse(instances=refs)


def test_a_group_publishes_to_the_server_and_the_next_finds_it(
    mx: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    pb, grpc_stubs = mx["p2p_pb2"], mx["p2p_pb2_grpc"]
    registry = _Registry(mx)
    servicer = grpc_stubs.P2pServiceServicer()
    servicer.PublishMetadata = registry.PublishMetadata
    servicer.ListSources = registry.ListSources
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    grpc_stubs.add_P2pServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        for key, value in _env(
            children.worker_pods(_deployment(), SOURCE, cold_start_source=None)[0]
        ).items():
            monkeypatch.setenv(key, value)
        # the stand-in listens on loopback instead of the Service's DNS name
        monkeypatch.setenv("MODEL_EXPRESS_URL", f"127.0.0.1:{port}")
        monkeypatch.setenv("MX_SERVER_ADDRESS", f"127.0.0.1:{port}")
        client = mx["client"].MxClient()
        identity = pb.SourceIdentity(model_name="meta-llama/Llama-3-70B")
        source_id = client.publish_metadata(identity, pb.WorkerMetadata(worker_rank=3), "pod-0/3")
        assert source_id == "0123456789abcdef"
        assert registry.sources["pod-0/3"].pod_name == "pod-0"  # the downward-API identity reaches it
        [found] = client.list_sources(identity).instances
        assert (found.worker_id, found.worker_rank) == ("pod-0/3", 3)
        client.close()
    finally:
        server.stop(None)


def test_a_new_group_is_pointed_at_its_source_groups_leader(
    mx: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    deployment = _deployment()
    source = names.group_name("llama", Role.WORKER, 0)
    *_, pointer = children.modelexpress_objects(deployment, source=source, source_ranks=8)
    assert pointer["metadata"]["name"] == names.modelexpress_source_name("llama")
    assert pointer["spec"]["selector"] == {names.LABEL_GROUP: source, names.LABEL_LEADER: "true"}
    ports = {port["name"]: port["port"] for port in pointer["spec"]["ports"]}
    assert ports == {f"rank-{rank}": 6555 + rank for rank in range(8)}
    # the source group itself is not pointed at anything; a new group is
    [own] = children.worker_pods(deployment, SOURCE, cold_start_source=source, cold_start_ranks=8)
    assert "MX_METADATA_BACKEND" not in _env(own)
    [new] = children.worker_pods(deployment, NEW, cold_start_source=source, cold_start_ranks=8)
    env = _env(new)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    factory = mx["metadata.client_factory"]
    rank = 5
    client = factory.create_metadata_client(worker_rank=rank)
    assert type(client).__name__ == "MxK8sServiceClient"
    assert client._resolve_endpoint() == f"{pointer['metadata']['name']}:{ports[f'rank-{rank}']}"

    # Over gRPC: the source's rank-5 worker answers its manifest on 6555 + 5 (here on loopback, the
    # port base moved to a free one).
    pb, grpc_stubs = mx["p2p_pb2"], mx["p2p_pb2_grpc"]
    identity = pb.SourceIdentity(model_name="meta-llama/Llama-3-70B")
    [ref] = client.list_sources(identity).instances
    asked: list[str] = []

    def manifest(request: Any, context: Any) -> Any:
        asked.append(request.mx_source_id)
        return pb.GetTensorManifestResponse(mx_source_id=request.mx_source_id, worker_rank=rank)

    worker = grpc_stubs.WorkerServiceServicer()
    worker.GetTensorManifest = manifest

    base = free_port() - rank
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    grpc_stubs.add_WorkerServiceServicer_to_server(worker, server)
    server.add_insecure_port(f"127.0.0.1:{base + rank}")
    server.start()
    try:
        monkeypatch.setenv("MX_K8S_SERVICE_PATTERN", "127.0.0.1")
        monkeypatch.setenv("MX_WORKER_GRPC_PORT", str(base))
        client = factory.create_metadata_client(worker_rank=rank)
        found = client.get_metadata(ref.mx_source_id, ref.worker_id)
        assert found.found
        assert found.worker.worker_grpc_endpoint == f"127.0.0.1:{base + rank}"
        assert asked == [ref.mx_source_id]
    finally:
        server.stop(None)
