"""LoRA adapters in the twin: requests through adapters, engines that load them, and the router's
adapter-aware choice against adapter-blind routing on the same arrivals."""

from __future__ import annotations

from copse.router.adapters import AdapterRouting
from copse.sim.replay import EngineSetup, Fleet, ReplaySettings, RequestClass
from copse.sim.trace import TraceRequest
from copse.workers.mocker import EngineConfig
from copse.workers.mocker.adapters import AdapterSettings


def _run(*, aware: bool, shared_prefix: bool) -> Fleet:
    """Requests 50 ms apart alternating between four adapters on four engines that hold one each;
    with ``shared_prefix``, every prompt starts with the same block."""
    trace = [
        TraceRequest(
            timestamp_ms=50.0 * i,
            input_length=1024,
            output_length=8,
            hash_ids=(0, 1000 + i) if shared_prefix else (2000 + i, 1000 + i),
        )
        for i in range(32)
    ]
    config = EngineConfig(adapters=AdapterSettings(max_loras=1, load_ms=300.0))
    settings = ReplaySettings(
        workers=4,
        seed=3,
        engines=EngineSetup(config=config),
        # max_loras is not repeated here: the router learns it from each engine as it registers
        adapters=AdapterRouting(load_ms=300.0, aware=aware),
    )
    classes = [RequestClass(adapter=f"a{i % 4}") for i in range(len(trace))]
    fleet = Fleet(trace, settings, engines=4, classes=classes)
    for index in range(len(trace)):
        fleet.run_until(float(fleet.arrival_ms[index]))
        fleet.arrive(index)
    fleet.run()
    assert int((fleet.finish_ms > 0).sum()) == 32
    return fleet


def _loads(fleet: Fleet) -> int:
    return sum(engine.adapters.loads_total for engine in fleet.engines)


def test_adapter_aware_routing_keeps_each_adapter_where_it_is_loaded() -> None:
    aware, blind = _run(aware=True, shared_prefix=False), _run(aware=False, shared_prefix=False)
    assert _loads(aware) == 4, "each adapter stays on one engine of its own"
    assert _loads(blind) > _loads(aware)
    assert aware.router.adapters.loads == _loads(aware), "the router's mirror of the engines' caches is exact"
    for fleet in (aware, blind):  # the router holds each engine to the max_loras it reported
        router = fleet.router
        believed = [router.adapters.held(router.slots.slot(e.worker_id)) for e in fleet.engines]
        assert believed == [e.adapters.held() for e in fleet.engines]


def test_no_prefix_hit_crosses_adapters() -> None:
    fleet = _run(aware=True, shared_prefix=True)
    # The shared first block is four adapters' blocks: the first request of each adapter finds none
    # of it cached; the later ones find their adapter's copy.
    assert [float(fleet.cached[i]) for i in range(4)] == [0.0] * 4
    assert all(float(fleet.cached[i]) >= 512 for i in range(4, 32))
