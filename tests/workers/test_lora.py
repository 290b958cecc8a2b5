"""LoRA adapters on the engine side: hashes that never match across adapters, the mocked engine's
adapter cache (load delay, LRU of ``max_loras``), its HTTP surface (``lora_request`` and ``model``,
``/v1/models``, ``/worker_info``, metrics) and the KV relay hashing adapter blocks as the router does."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from copse.workers.mocker import EngineConfig
from copse.workers.mocker.adapters import AdapterCache, AdapterSettings
from copse.workers.mocker.engine import Engine
from copse.workers.mocker.simulation import Simulator
from copse.workers.perf import PolynomialPerfModel
from copse.workers.protocol import (
    KvStored,
    adapter_seed,
    block_hashes,
    chain_hashes,
    hash_blocks,
    lora_int_id,
    tokens_hashes,
)
from copse.workers.relay import KvRelay
from copse.workers.testing import mock_fleet

PERF = PolynomialPerfModel()
PROMPT = list(range(300, 428))  # four blocks of 32


def test_an_adapter_changes_every_block_hash_and_nothing_else() -> None:
    base = block_hashes(PROMPT, block_size=32)
    sql = block_hashes(PROMPT, block_size=32, lora_id=lora_int_id("sql"))
    chat = block_hashes(PROMPT, block_size=32, lora_id=lora_int_id("chat"))
    assert len(base) == len(sql) == len(chat) == 4
    assert not set(base) & set(sql)
    assert not set(sql) & set(chat)
    assert not set(base) & set(chat)
    assert block_hashes(PROMPT, block_size=32, lora_id=None) == base
    # Same chaining as the base model: only the tokens hashes' seed differs.
    chained, local = hash_blocks(PROMPT, block_size=32, lora_id=lora_int_id("sql"))
    assert chained == chain_hashes(local) == sql
    assert local == tokens_hashes(PROMPT, block_size=32, seed=adapter_seed(lora_int_id("sql")))


def test_lora_int_id_is_stable_small_and_refuses_an_empty_name() -> None:
    assert lora_int_id("sql") == lora_int_id("sql") != lora_int_id("sql2")
    assert 0 <= lora_int_id("a-very-long-adapter-name" * 8) < 2**31
    with pytest.raises(ValueError, match="must not be empty"):
        lora_int_id("")


def test_the_adapter_cache_loads_one_at_a_time_and_evicts_the_least_recently_used() -> None:
    cache = AdapterCache(AdapterSettings(max_loras=2, load_ms=100.0))
    assert cache.acquire("a", now_ms=0.0) == 100.0
    assert cache.acquire("b", now_ms=10.0) == 200.0  # waits for a's load
    assert cache.acquire("a", now_ms=300.0) == 100.0  # held: ready long ago, now most recent
    assert cache.acquire("c", now_ms=300.0) == 400.0  # evicts b, the least recently used
    assert cache.held() == ["a", "c"]
    assert cache.loads_total == 3
    assert cache.acquire("b", now_ms=500.0) == 600.0  # b again: a reload
    assert cache.held() == ["c", "b"]
    with pytest.raises(ValueError, match="max_loras=0"):
        AdapterSettings(max_loras=0)


def _run(engine: Engine, *, until_ms: float) -> float:
    """Step ``engine`` until it is idle; returns the last step end (ms)."""
    now = 0.0
    while engine.has_work():
        end = engine.begin_step(now)
        if end is None:
            wake = engine.next_wake_ms()
            assert wake is not None
            now = wake
            continue
        engine.end_step()
        now = end
        assert now < until_ms
    return now


def test_a_request_through_an_unloaded_adapter_waits_for_its_load_and_its_blocks_are_its_own() -> None:
    config = EngineConfig(adapters=AdapterSettings(max_loras=1, load_ms=500.0))
    engine = Engine(worker_id="e", config=config, perf=PERF)
    base = engine.add_request(request_id="base", tokens=PROMPT, max_tokens=2, now_ms=0.0)
    _run(engine, until_ms=10_000.0)
    through = engine.add_request(request_id="sql", tokens=PROMPT, max_tokens=2, now_ms=1000.0, adapter="sql")
    assert through.start_ms == 1500.0
    _run(engine, until_ms=10_000.0)
    assert through.first_token_ms > 1500.0
    assert through.cached_tokens == 0  # the base model's blocks are not the adapter's
    assert set(through.hashes).isdisjoint(base.hashes)
    again = engine.add_request(request_id="sql-2", tokens=PROMPT, max_tokens=2, now_ms=5000.0, adapter="sql")
    assert again.start_ms == 5000.0  # held: no load
    _run(engine, until_ms=10_000.0)
    assert again.cached_tokens == len(PROMPT) - 1  # the adapter's own prefix is cached
    engine.add_request(request_id="chat", tokens=PROMPT, max_tokens=2, now_ms=6000.0, adapter="chat")
    assert engine.adapters.held() == ["chat"]
    assert engine.adapters.loads_total == 2


@pytest.mark.parametrize("until_submit", [False, True])
def test_fused_decode_steps_end_when_a_waiting_requests_adapter_is_loaded(until_submit: bool) -> None:
    """A long decode runs while a request waits for its adapter's load: fused steps stop where the
    load ends, so the request starts when it would stepping one by one."""

    def first_tokens(*, fuse: bool) -> dict[str, float]:
        config = EngineConfig(adapters=AdapterSettings(max_loras=2, load_ms=300.0))
        engine = Engine(worker_id="e", config=config, perf=PERF)
        sim = Simulator([engine], fuse_decode=fuse, fuse_until_submit=fuse and until_submit)
        sim.submit(0, request_id="long", tokens=list(range(100, 200)), max_tokens=2000)
        sim.run_until(50.0)
        sim.submit(0, request_id="sql", tokens=list(range(300, 400)), max_tokens=5, adapter="sql")
        sim.run()
        return {outcome.request_id: outcome.first_token_ms for outcome in sim.outcomes}

    stepwise = first_tokens(fuse=False)
    assert first_tokens(fuse=True) == pytest.approx(stepwise)


def _body(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": PROMPT, "max_tokens": 2, **extra}


async def test_the_mocked_engine_serves_adapters_named_as_model_or_in_lora_request() -> None:
    config = EngineConfig(adapters=AdapterSettings(max_loras=2, load_ms=0.0))
    async with (
        mock_fleet(virtual_clock=True, config=config, loras=("sql", "chat")) as fleet,
        httpx.AsyncClient(base_url=fleet.urls[0]) as http,
    ):
        listed = (await http.get("/v1/models")).json()["data"]
        assert [(m["id"], m.get("parent")) for m in listed] == [
            ("mock-model", None),
            ("sql", "mock-model"),
            ("chat", "mock-model"),
        ]
        await http.post("/kv_cache_events")
        assert (await http.post("/v1/completions", json=_body("sql"))).status_code == 200
        lora = {"lora_name": "chat", "lora_int_id": lora_int_id("chat"), "lora_path": "/models/loras/chat"}
        answer = await http.post("/v1/completions", json=_body("mock-model", lora_request=lora))
        assert answer.status_code == 200
        assert (await http.post("/v1/completions", json=_body("unlisted-name"))).status_code == 200  # base
        info = (await http.get("/worker_info")).json()
        assert info["max_loras"] == 2
        assert info["loras"] == ["sql", "chat"]
        stored = [
            e["data"] for e in (await http.post("/kv_cache_events")).json() if e["data"]["type"] == "stored"
        ]
        ids = [{block["lora_id"] for block in data["blocks"]} for data in stored]
        assert ids == [{lora_int_id("sql")}, {lora_int_id("chat")}, {None}]
        bad = await http.post(
            "/v1/completions", json=_body("m", lora_request={"lora_name": "", "lora_int_id": 1})
        )
        assert bad.status_code == 400
        assert "lora_request" in bad.json()["error"]["message"]
        metrics = (await http.get("/prometheus/metrics")).text
        assert (
            'copse_mock_lora_loaded{engine_type="aggregated",lora_name="sql",model_name="mock-model"} 1.0'
            in metrics
        )
        assert 'copse_mock_lora_loads_total{engine_type="aggregated",model_name="mock-model"} 2.0' in metrics


def test_the_relay_hashes_an_adapter_block_with_the_adapter_seed_as_the_router_does() -> None:
    relay = KvRelay(worker_id="pod-0", block_size=4, epoch=1, registry=CollectorRegistry())
    tokens = [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in range(100, 104)]
    lora = lora_int_id("sql")
    events = relay.ingest(
        [
            {"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [64, 0]}},
            {
                "event_id": 1,
                "data": {
                    "type": "stored",
                    "parent_hash": None,
                    "blocks": [{"type": "stored_block", "block_hash": 7, "tokens": tokens, "lora_id": lora}],
                },
            },
        ]
    )
    stored = [e.data for e in events if isinstance(e.data, KvStored)]
    assert [block.block_hash for data in stored for block in data.blocks] == block_hashes(
        list(range(100, 104)), block_size=4, lora_id=lora
    )
