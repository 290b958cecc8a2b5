"""LoRA adapters and several models on the router: the catalog (names, 404), the adapter tracker,
worker choice (adapter affinity, ``max_loras`` at once, models kept apart), the configuration's
validation, per-adapter metrics with bounded labels, and discovery of several models' workers."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import aiohttp
import numpy as np
import numpy.typing as npt
import pytest

from copse.router.adapters import AdapterRouting, AdapterTracker
from copse.router.config import ConfigError, parse_config
from copse.router.core import FlightRecord, NoWorkers, PeerChange, Role, Router, WorkerInfo
from copse.router.discovery import Endpoint, ModelSources, OnChange
from copse.router.metrics import RouterMetrics
from copse.router.models import Adapter, ModelCatalog, UnknownModel
from copse.router.policies import RouteRequest, SelectionSettings
from copse.router.replica_sync import Snapshot, decode_changes, encode_changes
from copse.router.server import start_router
from copse.workers.perf import PolynomialPerfModel
from copse.workers.protocol import block_hashes, lora_int_id
from copse.workers.testing import mock_fleet

from .conftest import eventually

BS = 16
PERF = PolynomialPerfModel()
PROMPT = list(range(1000, 1000 + 512))


def _catalog() -> ModelCatalog:
    return ModelCatalog(
        {
            "llama": [
                Adapter(name="sql", base="llama", path="/models/loras/sql"),
                Adapter(name="chat", base="llama"),
            ],
            "qwen": [Adapter(name="qwen-math", base="qwen")],
        }
    )


def test_the_catalog_resolves_models_and_adapters_and_names_an_unknown_one() -> None:
    catalog = _catalog()
    assert catalog.resolve("llama").adapter is None
    sql = catalog.resolve("sql")
    assert sql.model == "llama"
    assert sql.adapter is not None
    assert sql.adapter.lora_request() == {
        "lora_name": "sql",
        "lora_int_id": lora_int_id("sql"),
        "lora_path": "/models/loras/sql",
    }
    assert catalog.resolve("qwen-math").model == "qwen"
    with pytest.raises(UnknownModel, match=r"model 'gpt-9' is not served here .*'llama', 'qwen', 'sql'"):
        catalog.resolve("gpt-9")
    listed = [(m["id"], m.get("parent")) for m in catalog.listing()["data"]]
    assert listed == [
        ("llama", None),
        ("qwen", None),
        ("sql", "llama"),
        ("chat", "llama"),
        ("qwen-math", "qwen"),
    ]
    with pytest.raises(ValueError, match="'llama' is used twice"):
        ModelCatalog({"llama": [Adapter(name="llama", base="llama")]})


def _request(rid: str, *, adapter: str = "", model: str = "", tokens: list[int] = PROMPT) -> RouteRequest:
    lora_id = lora_int_id(adapter) if adapter else None
    return RouteRequest(
        request_id=rid,
        hashes=block_hashes(tokens, block_size=BS, lora_id=lora_id),
        prompt_tokens=len(tokens),
        max_tokens=16,
        adapter=adapter,
        model=model,
    )


def _listed(values: npt.NDArray[np.float64] | None) -> list[float]:
    assert values is not None
    return [float(v) for v in values]


def test_the_tracker_mirrors_each_engines_lru_and_counts_loads() -> None:
    tracker = AdapterTracker(AdapterRouting(max_loras=2, load_ms=100.0))
    tracker.set_worker(0, model="llama", held=("a", "b", "c"))  # reported: the last two fit
    tracker.set_worker(1, model="llama")
    assert tracker.held(0) == ["b", "c"]
    assert _listed(tracker.load_ms(_request("r", adapter="b"), 2)) == [0.0, 100.0]
    tracker.routed("r1", slots=(1,), adapter="b")
    tracker.routed("r2", slots=(1,), adapter="a")
    tracker.routed("r3", slots=(1,), adapter="c")  # evicts b
    assert tracker.held(1) == ["a", "c"]
    assert tracker.loads == 3
    assert _listed(tracker.load_ms(_request("r", adapter="b"), 2)) == [0.0, 100.0]
    assert tracker.load_ms(_request("r"), 2) is None
    blind = AdapterTracker(AdapterRouting(aware=False))
    blind.set_worker(0, model="llama")
    assert blind.load_ms(_request("r", adapter="b"), 1) is None


def test_a_worker_running_max_loras_other_adapters_is_left_out_while_another_can_start() -> None:
    tracker = AdapterTracker(AdapterRouting(max_loras=1))
    for slot in range(2):
        tracker.set_worker(slot, model="llama")
    tracker.routed("r1", slots=(0,), adapter="a")
    everyone = np.ones(2, dtype=bool)
    assert tracker.narrow(_request("x", adapter="b"), everyone).tolist() == [False, True]
    assert tracker.narrow(_request("x", adapter="a"), everyone).tolist() == [True, True]
    tracker.routed("r2", slots=(1,), adapter="c")
    # Nobody can start it now: it waits in an engine of its model rather than nowhere.
    assert tracker.narrow(_request("x", adapter="b"), everyone).tolist() == [True, True]
    tracker.finished("r1")
    assert tracker.narrow(_request("x", adapter="b"), everyone).tolist() == [True, False]


def test_a_request_routed_again_frees_its_adapter_where_it_ran_before() -> None:
    tracker = AdapterTracker(AdapterRouting(max_loras=1))
    for slot in range(2):
        tracker.set_worker(slot, model="llama")
    tracker.routed("r1", slots=(0,), adapter="a")
    tracker.routed("r1", slots=(1,), adapter="a")  # its first worker failed: retried on the other
    tracker.finished("r1")
    everyone = np.ones(2, dtype=bool)
    assert tracker.narrow(_request("x", adapter="b"), everyone).tolist() == [True, True]


def test_a_worker_reporting_fewer_max_loras_keeps_only_its_most_recent_adapters() -> None:
    tracker = AdapterTracker(AdapterRouting(max_loras=4))
    tracker.set_worker(0, model="llama", max_loras=3, held=("a", "b", "c"))
    tracker.set_worker(0, model="llama", max_loras=1)
    assert tracker.held(0) == ["c"]


def test_a_removed_workers_requests_free_their_adapter_on_the_workers_that_remain() -> None:
    router = Router(
        perf=PERF,
        settings=SelectionSettings(block_size=BS),
        policy="kv",
        seed=1,
        adapters=AdapterRouting(max_loras=1),
    )
    router.add_worker(WorkerInfo(worker_id="p0", role=Role.PREFILL), now=0.0)
    for name in ("d0", "d1"):
        router.add_worker(WorkerInfo(worker_id=name, role=Role.DECODE), now=0.0)
    long_prompt = list(range(1000, 1000 + 4096))  # long enough to be prefilled apart
    route = router.submit(_request("x", adapter="a", tokens=long_prompt), now=0.0)
    assert route is not None
    assert route.prefill_worker_id == "p0"
    assert router.remove_worker(route.worker_id) == ["x"]
    router.finish("x", now=1.0)
    survivor = "d1" if route.worker_id == "d0" else "d0"
    mask = np.zeros(router.sequences.size, dtype=bool)
    slots = [router.slots.slot(name) for name in ("p0", survivor)]
    mask[slots] = True
    # p0 no longer runs adapter a for the lost request: it can start another adapter.
    assert router.adapters.narrow(_request("y", adapter="b"), mask)[slots].tolist() == [True, True]


def _router(
    *, aware: bool = True, models: Mapping[str, int] | None = None, events: bool = True, **routing: Any
) -> Router:
    router = Router(
        perf=PERF,
        settings=SelectionSettings(block_size=BS),
        policy="kv",
        seed=1,
        adapters=AdapterRouting(aware=aware, **routing),
        use_kv_events=events,
    )
    index = 0
    for model, count in (models or {"llama": 4}).items():
        for _ in range(count):
            router.add_worker(WorkerInfo(worker_id=f"w{index}", role=Role.WORKER, model=model), now=0.0)
            index += 1
    return router


def test_adapter_aware_routing_keeps_an_adapter_on_the_worker_that_holds_it() -> None:
    router = _router(load_ms=500.0)
    first = router.submit(_request("r1", adapter="sql"), now=0.0)
    assert first is not None
    router.finish("r1", now=0.0)
    other = list(range(9000, 9512))  # another prompt: no prefix to follow, only the adapter
    again = router.submit(_request("r2", adapter="sql", tokens=other), now=0.0)
    assert again is not None
    assert again.worker_id == first.worker_id
    assert router.adapters.loads == 1
    base = router.submit(_request("r3", tokens=other), now=0.0)
    assert base is not None  # the base model needs no adapter: any worker


def test_adapter_blind_routing_loads_the_adapter_wherever_load_is_lowest() -> None:
    router = _router(aware=False)
    workers = set()
    for i in range(4):
        route = router.submit(
            _request(f"r{i}", adapter="sql", tokens=list(range(i * 1000, i * 1000 + 512))), now=0.0
        )
        assert route is not None
        workers.add(route.worker_id)
    assert len(workers) > 1
    assert router.adapters.loads == len(workers)


def test_no_kv_hit_crosses_adapters() -> None:
    router = _router(models={"llama": 2}, events=False)  # the index learns from the router's choices
    route = router.submit(_request("r1", adapter="sql"), now=0.0)
    assert route is not None
    router.finish("r1", now=0.0)
    same = router.submit(_request("r2", adapter="sql"), now=0.0)
    assert same is not None
    assert same.cached_tokens == 511  # all but the token it must compute
    other = router.submit(_request("r3", adapter="chat"), now=0.0)
    base = router.submit(_request("r4"), now=0.0)
    assert other is not None
    assert base is not None
    assert other.cached_tokens == 0
    assert base.cached_tokens == 0


def test_each_model_goes_to_its_own_workers_and_a_model_without_workers_is_refused() -> None:
    router = _router(models={"llama": 2, "qwen": 2})
    for i in range(6):
        route = router.submit(
            _request(f"q{i}", model="qwen", tokens=list(range(i * 700, i * 700 + 512))), now=0.0
        )
        assert route is not None
        assert route.worker_id in {"w2", "w3"}
    route = router.submit(_request("l", model="llama", adapter="sql"), now=0.0)
    assert route is not None
    assert route.worker_id in {"w0", "w1"}
    with pytest.raises(NoWorkers, match="model 'mistral'"):
        router.submit(_request("m", model="mistral"), now=0.0)
    router.remove_worker("w2")
    router.remove_worker("w3")
    with pytest.raises(NoWorkers, match="model 'qwen'"):
        router.submit(_request("q", model="qwen"), now=0.0)


BASE_CONFIG: dict[str, Any] = {
    "model": "llama",
    "engine": "mock",
    "discovery": {"kind": "static", "workers": [{"url": "http://127.0.0.1:9000"}]},
}


def test_config_lists_adapters_and_models_and_refuses_a_name_used_twice() -> None:
    config = parse_config(
        {
            **BASE_CONFIG,
            "loras": [{"name": "sql", "path": "/models/loras/sql"}],
            "models": [
                {
                    "name": "qwen",
                    "loras": [{"name": "qwen-math"}],
                    "discovery": {"kind": "static", "workers": [{"url": "http://127.0.0.1:9100"}]},
                }
            ],
            "max_loras": 8,
            "lora_load_ms": 50,
        },
        source="router.yaml",
    )
    assert config.catalog().resolve("qwen-math").model == "qwen"
    assert config.adapter_routing() == AdapterRouting(max_loras=8, load_ms=50.0, aware=True)
    with pytest.raises(
        ConfigError, match=r"models\[0\].loras\[0\]: name 'sql' is already used by loras\[0\]"
    ):
        parse_config(
            {
                **BASE_CONFIG,
                "loras": [{"name": "sql"}],
                "models": [
                    {"name": "qwen", "loras": [{"name": "sql"}], "discovery": BASE_CONFIG["discovery"]}
                ],
            },
            source="router.yaml",
        )
    with pytest.raises(ConfigError, match=r"models\[0\].deployment: required with nats_url"):
        parse_config(
            {
                **BASE_CONFIG,
                "nats_url": "nats://127.0.0.1:4222",
                "models": [{"name": "qwen", "discovery": BASE_CONFIG["discovery"]}],
            },
            source="router.yaml",
        )
    # Two names whose lora_int_id (a 31-bit hash) collide: the engines would take one for the other.
    assert lora_int_id("a81104") == lora_int_id("a134232")
    with pytest.raises(ConfigError, match=r"loras\[1\]: its lora_int_id .* adapter 'a81104'"):
        parse_config(
            {**BASE_CONFIG, "loras": [{"name": "a81104"}, {"name": "a134232"}]}, source="router.yaml"
        )
    with pytest.raises(ConfigError, match=r"loras\[0\].path: required with engine: trtllm"):
        parse_config(
            {
                **BASE_CONFIG,
                "engine": "trtllm",
                "tokenizer": "/models/llama",
                "kv_capacity_tokens": 100_000,
                "loras": [{"name": "sql"}],
            },
            source="router.yaml",
        )
    with pytest.raises(ConfigError, match=r"loras\[0\]: name 'llama' is already used by model"):
        parse_config({**BASE_CONFIG, "loras": [{"name": "llama"}]}, source="router.yaml")
    with pytest.raises(ConfigError, match="one InferencePool"):
        parse_config(
            {
                **BASE_CONFIG,
                "epp": {},
                "models": [{"name": "qwen", "discovery": BASE_CONFIG["discovery"]}],
            },
            source="router.yaml",
        )


def _value(metrics: RouterMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_per_adapter_metrics_bound_their_labels() -> None:
    router = _router()
    metrics = RouterMetrics(lambda: router, adapter_labels=2, model="llama")
    for adapter in ("a", "b", "c", "a", ""):
        request = _request("r", adapter=adapter)
        metrics.admitted(request, queued=False)
        metrics.first_token(request, 0.05)
    admitted = "copse_router_adapter_admitted_total"
    assert _value(metrics, admitted, model="llama", adapter="a") == 2.0
    assert _value(metrics, admitted, model="llama", adapter="b") == 1.0
    assert _value(metrics, admitted, model="llama", adapter="other") == 1.0  # c: past the bound
    assert _value(metrics, admitted, model="llama", adapter="base") == 1.0
    ttft = "copse_router_adapter_time_to_first_token_seconds_count"
    assert _value(metrics, ttft, model="llama", adapter="a") == 2.0
    router.submit(_request("x", adapter="sql"), now=0.0)
    assert _value(metrics, "copse_router_adapter_loads_total") == 1.0


async def test_several_models_sources_tag_and_key_their_endpoints() -> None:
    class Fixed:
        def __init__(self, endpoints: dict[str, Endpoint]) -> None:
            self.endpoints = endpoints

        async def run(self, on_change: OnChange) -> None:
            on_change(self.endpoints)
            await asyncio.Event().wait()

    def endpoint(url: str) -> Endpoint:
        return Endpoint(key=url, url=url, role=Role.WORKER, worker_id=None)

    seen: list[dict[str, Endpoint]] = []
    sources = ModelSources(
        {"llama": Fixed({"a": endpoint("http://a")}), "qwen": Fixed({"a": endpoint("http://b")})}
    )
    task = asyncio.create_task(sources.run(lambda endpoints: seen.append(dict(endpoints))))
    try:
        while not seen or len(seen[-1]) < 2:
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
    assert {key: (e.model, e.url) for key, e in seen[-1].items()} == {
        "llama/a": ("llama", "http://a"),
        "qwen/a": ("qwen", "http://b"),
    }


async def test_each_models_kv_events_reach_the_index_and_adapter_blocks_match_the_routers_hashes(
    nats_url: str,
) -> None:
    """Two deployments publishing on their own subjects behind one router: both models' workers'
    caches are known exactly, and a prompt through an adapter is indexed under the adapter's hashes."""
    async with (
        mock_fleet(
            engines=1, nats_url=nats_url, deployment="llama-dep", model_name="llama", loras=("sql",)
        ) as llama,
        mock_fleet(engines=1, nats_url=nats_url, deployment="qwen-dep", model_name="qwen") as qwen,
    ):
        config = parse_config(
            {
                **BASE_CONFIG,
                "port": 0,
                "block_size": 32,
                "health_interval_s": 0.05,
                "nats_url": nats_url,
                "deployment": "llama-dep",
                "discovery": {"kind": "static", "workers": [{"url": llama.urls[0]}]},
                "loras": [{"name": "sql"}],
                "models": [
                    {
                        "name": "qwen",
                        "deployment": "qwen-dep",
                        "discovery": {"kind": "static", "workers": [{"url": qwen.urls[0]}]},
                    }
                ],
            },
            source="test",
        )
        running = await start_router(config, router_id="two-models")
        try:
            router = running.service.router
            await eventually(lambda: len(router.workers) == 2)
            prompt = list(range(3000, 3000 + 320))
            async with aiohttp.ClientSession() as http:
                for model in ("sql", "qwen"):
                    body = {"model": model, "prompt": prompt, "max_tokens": 1}
                    async with http.post(f"{running.url}/v1/completions", json=body) as response:
                        assert response.status == 200
            sql = block_hashes(prompt, block_size=32, lora_id=lora_int_id("sql"))
            base = block_hashes(prompt, block_size=32)
            await eventually(
                lambda: len(router.indexer.overlaps(sql)) == 1 and len(router.indexer.overlaps(base)) == 1
            )
            [(sql_slot, sql_depth)] = router.indexer.overlaps(sql).items()
            [(base_slot, base_depth)] = router.indexer.overlaps(base).items()
            assert router.workers[router.slots.worker_id(sql_slot)].model == "llama"
            assert router.workers[router.slots.worker_id(base_slot)].model == "qwen"
            assert sql_depth == base_depth == 10
        finally:
            await running.close()


async def test_an_adapter_request_reaches_an_engine_that_was_not_told_the_adapter_with_its_lora_request() -> (
    None
):
    """The engine is started without the adapter's name, so it can only serve the request through
    the adapter from the ``lora_request`` the router added: the router must not forward the
    client's own bytes (which name the adapter only as ``model``)."""
    async with mock_fleet(engines=1) as fleet:
        config = parse_config(
            {
                **BASE_CONFIG,
                "engine": "mock",
                "port": 0,
                "block_size": 32,
                "health_interval_s": 0.05,
                "discovery": {"kind": "static", "workers": [{"url": fleet.urls[0]}]},
                "loras": [{"name": "sql", "path": "/adapters/sql"}, {"name": "chat"}],
            },
            source="test",
        )
        running = await start_router(config, router_id="raw-lora")
        try:
            await eventually(lambda: len(running.service.router.workers) == 1)
            async with aiohttp.ClientSession() as http:
                for model, stream in (("sql", False), ("chat", True)):
                    body = {
                        "model": model,
                        "prompt": list(range(100, 200)),
                        "max_tokens": 2,
                        "stream": stream,
                    }
                    async with http.post(f"{running.url}/v1/completions", json=body) as response:
                        await response.read()
                        assert response.status == 200
                async with http.get(f"{fleet.urls[0]}/worker_info") as response:
                    info = await response.json()
            assert sorted(info["loras"]) == ["chat", "sql"]
        finally:
            await running.close()


# -- adapter state shared between router replicas ---------------------------------------------


def _replicas(*, shared: bool = True, max_loras: int = 1) -> tuple[Router, Router]:
    """Two replicas sharing load (as over NATS), each knowing the same four workers."""
    pair = []
    for _ in range(2):
        router = Router(
            perf=PERF,
            settings=SelectionSettings(block_size=BS),
            policy="kv",
            seed=1,
            share_load=True,
            adapters=AdapterRouting(load_ms=500.0, max_loras=max_loras, shared=shared),
        )
        for index in range(4):
            router.add_worker(WorkerInfo(worker_id=f"w{index}", role=Role.WORKER, model="llama"), now=0.0)
        pair.append(router)
    return pair[0], pair[1]


def _deliver(source: Router, peer: Router, *, name: str, now: float = 0.0) -> None:
    """Hand ``source``'s load changes to ``peer`` as replica sync does."""
    assert source.outbox is not None
    for change in source.outbox:
        peer.apply_peer(change, peer=name, now=now)
    source.outbox.clear()


def test_a_replica_mirrors_the_adapters_its_peers_requests_load() -> None:
    one, two = _replicas()
    route = one.submit(_request("r1", adapter="sql"), now=0.0)
    assert route is not None
    _deliver(one, two, name="one")
    slot = two.slots.slot(route.worker_id)
    assert two.adapters.held(slot) == ["sql"]
    assert (two.adapters.loads, two.adapters.peer_loads) == (0, 1)
    # The peer's request runs adapter sql there: with max_loras 1, another adapter goes elsewhere.
    everyone = np.ones(two.sequences.size, dtype=bool)
    assert not two.adapters.narrow(_request("x", adapter="legal"), everyone)[slot]
    one.finish("r1", now=0.1)
    _deliver(one, two, name="one")
    assert two.adapters.narrow(_request("x", adapter="legal"), everyone)[slot]
    # Another prompt through sql, at the second replica: to the worker its peer loaded sql on.
    other = list(range(9000, 9512))
    again = two.submit(_request("r2", adapter="sql", tokens=other), now=0.2)
    assert again is not None
    assert again.worker_id == route.worker_id
    assert two.adapters.loads == 0


def test_without_sharing_a_replica_knows_only_its_own_loads() -> None:
    one, two = _replicas(shared=False)
    route = one.submit(_request("r1", adapter="sql"), now=0.0)
    assert route is not None
    _deliver(one, two, name="one")
    assert two.adapters.held(two.slots.slot(route.worker_id)) == []
    assert two.adapters.peer_loads == 0


def test_a_joining_replica_takes_its_peers_view_of_the_adapters_from_the_snapshot() -> None:
    one, two = _replicas(max_loras=2)
    for index, adapter in enumerate(("sql", "legal", "chat")):
        route = one.submit(
            _request(f"r{index}", adapter=adapter, tokens=list(range(index * 600, index * 600 + 512))),
            now=0.0,
        )
        assert route is not None
    assert one.outbox is not None
    one.outbox.clear()  # the joining replica heard none of it
    flights = one.own_flights()
    assert sorted(record.adapter for _, record, _ in flights) == ["chat", "legal", "sql"]
    held = one.held_adapters()
    assert held
    two.load_peer_snapshot("one", flights, now=0.0, adapters=held)
    for worker_id, adapters in held.items():
        assert two.adapters.held(two.slots.slot(worker_id)) == adapters
    # The peer's requests in flight hold their adapters there until the peer frees them.
    assert two.adapters.adapter_of("one/r0") == "sql"
    one.finish("r0", now=0.1)
    _deliver(one, two, name="one")
    assert two.adapters.adapter_of("one/r0") == ""
    running = sorted(a for worker_id in held for a in two.adapters.running(two.slots.slot(worker_id)))
    assert running == ["chat", "legal"]
    two.forget_peer("one", now=0.2)
    for worker_id in held:
        assert two.adapters.running(two.slots.slot(worker_id)) == []


def test_the_adapter_and_the_held_adapters_cross_the_wire() -> None:
    record = FlightRecord(
        worker_id="w", hashes=[1], prefill_tokens=16, prefill_ms=1.0, kv_tokens=2.0, adapter="sql"
    )
    [change] = decode_changes(encode_changes("me", [PeerChange(op="add", key="k", record=record)]))[1]
    assert change.record == record
    snapshot = Snapshot(router="me", seq=3, flights=[], adapters={"w": ["legal", "sql"]})
    assert Snapshot.model_validate_json(snapshot.model_dump_json()).adapters == {"w": ["legal", "sql"]}
    assert Snapshot.model_validate_json('{"router": "old", "seq": 1, "flights": []}').adapters == {}


def test_held_adapters_of_a_worker_not_yet_registered_are_taken_when_it_registers() -> None:
    _, two = _replicas(max_loras=2)
    two.load_peer_snapshot("one", [], now=0.0, adapters={"w9": ["sql", "legal"], "w8": ["chat"]})
    two.add_worker(WorkerInfo(worker_id="w9", role=Role.WORKER, model="llama"), now=0.0)
    assert two.adapters.held(two.slots.slot("w9")) == ["sql", "legal"]
    # An engine that reports its own adapters is believed over a peer's view.
    two.add_worker(WorkerInfo(worker_id="w8", role=Role.WORKER, model="llama", loras=("legal",)), now=0.0)
    assert two.adapters.held(two.slots.slot("w8")) == ["legal"]
    # So is a fresh engine that reports holding none (``()``, not ``None``: it does not say).
    two.load_peer_snapshot("one", [], now=0.0, adapters={"w7": ["sql"], "w6": ["chat"]})
    two.add_worker(WorkerInfo(worker_id="w7", role=Role.WORKER, model="llama", loras=()), now=0.0)
    assert two.adapters.held(two.slots.slot("w7")) == []
    # A peer's view of a worker not yet here goes with the peer.
    two.forget_peer("one", now=0.0)
    two.add_worker(WorkerInfo(worker_id="w6", role=Role.WORKER, model="llama"), now=0.0)
    assert two.adapters.held(two.slots.slot("w6")) == []


def test_a_peers_snapshot_merges_into_the_adapters_this_replica_saw() -> None:
    """A snapshot comes whenever a peer joins and at every sequence gap: it must not drop what this
    replica routed since (least recent: the peer's, then this replica's own; adapters with
    requests in flight stay)."""
    _, two = _replicas(max_loras=2)
    slot = two.slots.slot("w0")
    two.adapters.routed("a", slots=(slot,), adapter="y")
    two.adapters.finished("a")
    two.adapters.routed("b", slots=(slot,), adapter="z")  # z runs here
    assert two.adapters.held(slot) == ["y", "z"]
    two.load_peer_snapshot("one", [], now=0.0, adapters={"w0": ["y", "x"]})
    assert two.adapters.held(slot) == ["y", "z"]
    assert two.adapters.running(slot) == ["z"]
    loads = two.adapters.load_ms(_request("c", adapter="z"), two.sequences.size)
    assert loads is not None
    assert loads[slot] == 0.0
    # What it had not seen, the peer's view adds (as least recent).
    other = two.slots.slot("w1")
    two.adapters.routed("d", slots=(other,), adapter="z")
    two.load_peer_snapshot("one", [], now=0.0, adapters={"w1": ["x"]})
    assert two.adapters.held(other) == ["x", "z"]


def test_adapters_at_once_never_evict_those_with_requests_in_flight() -> None:
    _, two = _replicas(max_loras=1)
    slot = two.slots.slot("w0")
    two.adapters.routed("a", slots=(slot,), adapter="z")
    two.load_peer_snapshot("one", [], now=0.0, adapters={"w0": ["x"]})
    assert two.adapters.held(slot) == ["z"]
