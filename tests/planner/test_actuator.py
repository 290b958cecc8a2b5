"""The actuator and the live loop against a fake API server object; Prometheus through respx."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import httpx
import pytest
import respx
from prometheus_client import generate_latest

from copse.api import Role
from copse.planner.actuator import REASON_RECOMMENDED, REASON_SCALED, Actuator, ActuatorError, patch_for
from copse.planner.capacity import Corrections, Sizing
from copse.planner.config import PlannerConfig, PrometheusConfig
from copse.planner.core import Decision
from copse.planner.metrics import PlannerMetrics, action_of
from copse.planner.observations import Observation, Pulse
from copse.planner.policy import Limits
from copse.planner.prometheus import PrometheusClient, PrometheusError, PrometheusSource, Queries
from copse.planner.recording import read_prometheus_export
from copse.planner.runner import Fleet, Planned, Runner, run_prometheus, run_recording
from copse.workers.perf import PolynomialPerfModel

P, D, W = Role.PREFILL, Role.DECODE, Role.WORKER
PROM = "http://127.0.0.1:9090"


def manifest(**spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": {"name": "m", "tensorParallelism": 1},
        "prefill": {"replicas": 1},
        "decode": {"replicas": 1},
        "scaling": {
            "minReplicas": 1,
            "maxReplicas": 6,
            "maxGpus": 10,
            "scaleDownDelay": "0s",
            "targetLatency": {"ttft_p99_ms": 500, "tbt_p99_ms": 40},
            "scaleUpTrigger": {"queueDepth": 5},
        },
    }
    body.update(spec)
    return {
        "apiVersion": "copse.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "llama", "namespace": "serving", "uid": "u-1"},
        "spec": body,
    }


def merge(target: dict[str, Any], patch: Mapping[str, Any]) -> None:
    """RFC 7386 JSON merge patch."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(target.get(key), dict):
            merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


class FakeApi:
    """The API server as the actuator sees it: one object, merge patches, Events."""

    def __init__(self, obj: dict[str, Any] | None) -> None:
        self.obj = obj
        self.patches: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.fail_patch = False

    async def names(self, *, namespace: str | None) -> list[tuple[str, str]]:
        if self.obj is None or namespace not in (None, "serving"):
            return []
        return [("serving", "llama")]

    async def get(self, *, namespace: str, name: str) -> dict[str, Any]:
        if self.obj is None or (namespace, name) != ("serving", "llama"):
            raise LookupError(f"InferenceDeployment {namespace}/{name} not found")
        return copy.deepcopy(self.obj)

    async def patch(self, *, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.fail_patch:
            raise ActuatorError("patching: 422 Unprocessable Entity")
        assert self.obj is not None
        self.patches.append(body)
        merge(self.obj, body)
        return copy.deepcopy(self.obj)

    async def post_event(self, *, namespace: str, body: dict[str, Any]) -> None:
        self.events.append(body)


def decision(target: dict[Role, int], current: dict[Role, int]) -> Decision:
    return Decision(
        time=0.0,
        current=current,
        target=target,
        sized={
            role: Sizing(replicas=count, throughput_replicas=count, feasible=True)
            for role, count in target.items()
        },
        forecast=None,
        next_forecast=None,
        corrections=Corrections(),
        reasons=(),
        margin=1.0,
        goal=0.99,
    )


def limits(roles: tuple[Role, ...] = (P, D), **overrides: Any) -> Limits:
    values: dict[str, Any] = {
        "roles": roles,
        "gpus_per_replica": dict.fromkeys(roles, 2),
        "ttft_ms": 500.0,
        "itl_ms": 40.0,
        "max_replicas": 6,
        "gpu_budget": 20,
    }
    values.update(overrides)
    return Limits(**values)


# --- patch bodies -------------------------------------------------------------------------


def test_patch_touches_only_changed_pools() -> None:
    body = patch_for(target={P: 3, D: 1}, current={P: 1, D: 1}, limits=limits())
    assert body == {"spec": {"prefill": {"replicas": 3}}}
    assert patch_for(target={P: 1, D: 1}, current={P: 1, D: 1}, limits=limits()) is None


def test_aggregated_patch_sets_spec_replicas() -> None:
    assert patch_for(target={W: 4}, current={W: 2}, limits=limits((W,))) == {"spec": {"replicas": 4}}


def test_patch_never_leaves_the_bounds() -> None:
    assert patch_for(target={P: 50, D: 0}, current={P: 1, D: 1}, limits=limits()) == {
        "spec": {"prefill": {"replicas": 6}}
    }
    # 6 + 6 groups of 2 GPUs exceed the 20-GPU budget: shared out in whole groups.
    body = patch_for(target={P: 6, D: 6}, current={P: 1, D: 1}, limits=limits())
    assert body == {"spec": {"prefill": {"replicas": 5}, "decode": {"replicas": 5}}}


# --- the actuator -------------------------------------------------------------------------


async def test_apply_patches_and_posts_an_event() -> None:
    api = FakeApi(manifest())
    actuator = Actuator(api=api, namespace="serving", name="llama", observe_only=False)
    deployment = await actuator.fetch()
    result = await actuator.apply(decision({P: 3, D: 2}, {P: 1, D: 1}), deployment)
    assert result == "applied"
    assert api.patches == [{"spec": {"prefill": {"replicas": 3}, "decode": {"replicas": 2}}}]
    assert api.obj is not None
    assert api.obj["spec"]["prefill"]["replicas"] == 3
    (event,) = api.events
    assert event["reason"] == REASON_SCALED
    assert event["involvedObject"] == {
        "apiVersion": "copse.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "name": "llama",
        "namespace": "serving",
        "uid": "u-1",
    }
    assert "prefill 1→3, decode 1→2" in event["message"]


async def test_observe_only_patches_nothing_and_says_so() -> None:
    api = FakeApi(manifest())
    actuator = Actuator(api=api, namespace="serving", name="llama", observe_only=True)
    result = await actuator.apply(decision({P: 3, D: 1}, {P: 1, D: 1}), await actuator.fetch())
    assert result == "observe_only"
    assert api.patches == []
    assert [event["reason"] for event in api.events] == [REASON_RECOMMENDED]
    assert api.events[0]["message"].startswith("recommend prefill 1→3")


async def test_nothing_to_change_posts_nothing() -> None:
    api = FakeApi(manifest())
    actuator = Actuator(api=api, namespace="serving", name="llama", observe_only=False)
    assert await actuator.apply(decision({P: 1, D: 1}, {P: 1, D: 1}), await actuator.fetch()) == "unchanged"
    assert api.events == []


async def test_missing_deployment_is_an_actuator_error() -> None:
    actuator = Actuator(api=FakeApi(None), namespace="serving", name="llama", observe_only=False)
    with pytest.raises(ActuatorError, match="InferenceDeployment serving/llama not found"):
        await actuator.fetch()


async def test_invalid_deployment_is_an_actuator_error() -> None:
    bad = manifest()
    bad["spec"]["scaling"]["minReplicas"] = 9
    actuator = Actuator(api=FakeApi(bad), namespace="serving", name="llama", observe_only=False)
    with pytest.raises(ActuatorError, match="minReplicas"):
        await actuator.fetch()


# --- the loop -------------------------------------------------------------------------------


def runner(api: FakeApi, *, observe_only: bool = False, clock: Any = None) -> Runner:
    config = PlannerConfig(predictor="constant", forecast_quantile=None, startup_delay_s=0.0)
    return Runner(
        config=config,
        actuator=Actuator(api=api, namespace="serving", name="llama", observe_only=observe_only),
        perf=PolynomialPerfModel(),
        metrics=PlannerMetrics(),
        interval_s=60.0,
        **({"clock": clock} if clock else {}),
    )


def busy(step: int, rate: float) -> Observation:
    return Observation(timestamp=60.0 * step, duration_s=60.0, num_requests=rate * 60, isl=3000, osl=150)


async def test_recording_drives_patches_within_bounds() -> None:
    api = FakeApi(manifest())
    loop = runner(api)
    steps = await run_recording(loop, [busy(0, 40.0), busy(1, 40.0), busy(2, 1.0)], max_intervals=2)
    assert steps == 2
    assert api.obj is not None
    prefill = api.obj["spec"]["prefill"]["replicas"]
    assert 1 < prefill <= 6
    assert len(api.patches) == 1  # the second decision holds
    exposition = generate_latest(loop.metrics.registry).decode()
    assert (
        'copse_planner_target_replicas{deployment="llama",namespace="serving",role="prefill"}' in exposition
    )
    assert (
        'copse_planner_patches_total{deployment="llama",namespace="serving",result="applied"} 1.0'
        in exposition
    )
    assert (
        'copse_planner_decisions_total{action="scale_up",deployment="llama",namespace="serving"} 1.0'
        in exposition
    )


async def test_edited_bounds_apply_to_the_next_decision() -> None:
    api = FakeApi(manifest())
    loop = runner(api)
    await loop.step(busy(0, 40.0))
    assert api.obj is not None
    api.obj["spec"]["scaling"]["maxReplicas"] = 2
    api.obj["spec"]["prefill"]["replicas"] = 2
    await loop.step(busy(1, 40.0))
    assert api.obj["spec"]["prefill"]["replicas"] == 2
    assert loop.limits.max_replicas == 2


async def test_new_latency_targets_restart_the_error_budget() -> None:
    """Intervals that missed nothing left budget unspent against the old targets; that says
    nothing of the new ones, so the spend starts again at 1. Other edits keep it."""
    api = FakeApi(manifest())
    loop = runner(api)
    calm = dataclasses.replace(busy(0, 4.0), slo_met=240.0, ttft_missed=0.0)
    for step in range(30):
        await loop.step(dataclasses.replace(calm, timestamp=60.0 * step))
    assert loop.planner is not None
    spent = loop.planner.budget.spend
    assert spent > 1.0
    assert api.obj is not None
    api.obj["spec"]["scaling"]["maxReplicas"] = 5
    await loop.step(dataclasses.replace(calm, timestamp=60.0 * 30))
    assert loop.planner.budget.spend > spent, "kept, and moved on by one more calm interval"
    api.obj["spec"]["scaling"]["targetLatency"]["ttft_p99_ms"] = 300
    await loop.step(dataclasses.replace(calm, timestamp=60.0 * 31))
    assert loop.limits.ttft_ms == 300
    assert 1.0 < loop.planner.budget.spend < spent, "restarted at 1, then one calm interval"


async def test_failed_patch_is_counted_and_the_loop_goes_on() -> None:
    api = FakeApi(manifest())
    api.fail_patch = True
    loop = runner(api)
    await run_recording(loop, [busy(0, 40.0), busy(1, 40.0)], max_intervals=None)
    exposition = generate_latest(loop.metrics.registry).decode()
    assert 'result="failed"} 2.0' in exposition


async def test_fast_path_only_adds() -> None:
    api = FakeApi(manifest(prefill={"replicas": 2}, decode={"replicas": 3}))
    loop = runner(api)
    await loop.prime()
    assert (
        await loop.fast_path(Pulse(time=0.0, window_s=30.0, queue_depth=4.0), now=0.0) is None
    )  # 4 < 5 per replica
    await loop.step(busy(0, 0.5))  # light load: the forecast alone would shrink the pools
    assert api.obj is not None
    api.obj["spec"]["decode"]["replicas"] = 3
    api.obj["spec"]["prefill"]["replicas"] = 2
    decided = await loop.fast_path(Pulse(time=61.0, window_s=30.0, queue_depth=5000.0), now=61.0)
    assert decided is not None
    assert api.obj["spec"]["prefill"]["replicas"] > 2
    assert api.obj["spec"]["decode"]["replicas"] == 3


# --- Prometheus -----------------------------------------------------------------------------


def vector(value: str | None) -> dict[str, Any]:
    result = [] if value is None else [{"metric": {}, "value": [1000.0, value]}]
    return {"status": "success", "data": {"resultType": "vector", "result": result}}


def queries() -> Queries:
    return Queries(
        PrometheusConfig(url=PROM), namespace="serving", name="llama", interval_s=60.0, quantile=0.99
    )


def test_default_queries_select_the_deployment() -> None:
    text = queries().text
    selector = 'namespace="serving",deployment="llama"'
    assert text["num_requests"] == (
        f"sum(increase(copse_router_class_admitted_total{{{selector}}}[60000ms]))"
        f' + (sum(increase(copse_router_class_shed_total{{{selector},reason!="QueueTimeout"}}[60000ms]))'
        " or vector(0))"
    )
    assert "histogram_quantile(0.99," in text["ttft_ms"]
    assert "copse_router_time_to_first_token_seconds_sum" in text["ttft_mean_ms"]
    assert "copse_router_inter_token_latency_seconds_count" in text["itl_mean_ms"]
    assert "copse_router_output_tokens_total" in text["osl"]
    assert "histogram_quantile(0.9," in text["isl_p90"]
    assert (
        "histogram_quantile(0.1, sum by (le) (rate(copse_router_output_length_tokens_bucket"
        in text["osl_p10"]
    )
    assert "copse_router_predicted_onboard_seconds_total" in text["onboard_ms"]
    assert (
        "histogram_quantile(0.99, sum by (le) (rate(copse_router_uncached_prompt_tokens_bucket"
        in text["uncached_p99"]
    )
    with pytest.raises(ValueError, match="unknown field latency"):
        Queries(
            PrometheusConfig(queries={"latency": "up"}), namespace="a", name="b", interval_s=60, quantile=0.9
        )


@respx.mock
async def test_prometheus_source_builds_an_observation() -> None:
    answers = {
        "num_requests": "120",
        "isl": "2000",
        "osl": "150",
        "isl_p90": "6144",
        "osl_p10": "12",
        "uncached_p50": "1024",
        "uncached_p90": "4096",
        "uncached_p99": "8192",
        "uncached_max": "16384",
        "kv_hit_rate": "0.25",
        "onboard_ms": "4.5",
        "ttft_ms": "310.5",
        "itl_ms": "22",
        "ttft_mean_ms": "120.25",
        "itl_mean_ms": "12.5",
        "serving": "3",
        "decode_serving": None,
        "queue_depth": "7",
        "decode_queue_depth": None,
        "inflight": "40",
        "slo_met": "110",
        "ttft_missed": "6",
        "itl_missed": "2",
        "refused": "0",
    }
    text = queries().text
    by_query = {text[field]: value for field, value in answers.items()}
    seen: list[dict[str, str]] = []

    def reply(request: httpx.Request) -> httpx.Response:
        params = dict(request.url.params)
        seen.append(params)
        return httpx.Response(200, json=vector(by_query[params["query"]]))

    respx.get(f"{PROM}/api/v1/query").mock(side_effect=reply)
    client = PrometheusClient(url=PROM, timeout_s=5)
    source = PrometheusSource(client=client, queries=queries(), interval_s=60.0)
    obs = await source.observe(end=1000.0)
    await client.aclose()
    assert obs == Observation(
        timestamp=940.0,
        duration_s=60.0,
        num_requests=120.0,
        isl=2000.0,
        osl=150.0,
        isl_p90=6144.0,
        osl_p10=12.0,
        uncached_p50=1024.0,
        uncached_p90=4096.0,
        uncached_p99=8192.0,
        uncached_max=16384.0,
        kv_hit_rate=0.25,
        onboard_ms=4.5,
        ttft_ms=310.5,
        itl_ms=22.0,
        ttft_mean_ms=120.25,
        itl_mean_ms=12.5,
        serving=3.0,
        queue_depth=7.0,
        decode_queue_depth=None,
        inflight=40.0,
        slo_met=110.0,
        ttft_missed=6.0,
        itl_missed=2.0,
        refused=0.0,
    )
    assert obs.attainment == pytest.approx(110 / 118)
    assert {params["time"] for params in seen} == {"1000.000"}


@respx.mock
async def test_no_traffic_gives_no_lengths_but_no_series_is_no_data() -> None:
    text = queries().text
    scraped = [True]

    def reply(request: httpx.Request) -> httpx.Response:
        query = dict(request.url.params)["query"]
        if not scraped[0]:
            return httpx.Response(200, json=vector(None))
        return httpx.Response(200, json=vector("0" if query == text["num_requests"] else "NaN"))

    respx.get(f"{PROM}/api/v1/query").mock(side_effect=reply)
    client = PrometheusClient(url=PROM, timeout_s=5)
    source = PrometheusSource(client=client, queries=queries(), interval_s=60.0)
    obs = await source.observe(end=1000.0)
    assert (obs.num_requests, obs.isl, obs.osl, obs.ttft_ms) == (0.0, None, None, None)
    scraped[0] = False
    with pytest.raises(PrometheusError, match="no series for num_requests"):
        await source.observe(end=1000.0)
    await client.aclose()


@respx.mock
async def test_prometheus_errors_name_the_query() -> None:
    respx.get(f"{PROM}/api/v1/query").mock(
        return_value=httpx.Response(400, json={"status": "error", "error": "parse error at char 5"})
    )
    client = PrometheusClient(url=PROM, timeout_s=5)
    with pytest.raises(PrometheusError, match=r"answered 400 for 'up\{': parse error at char 5"):
        await client.query("up{", at=1.0)
    respx.get(f"{PROM}/api/v1/query").mock(side_effect=httpx.ConnectError("refused"))
    with pytest.raises(PrometheusError, match="ConnectError: refused"):
        await client.query("up", at=1.0)
    two = {"status": "success", "data": {"resultType": "vector", "result": [{"value": [1, "1"]}] * 2}}
    respx.get(f"{PROM}/api/v1/query").mock(return_value=httpx.Response(200, json=two))
    with pytest.raises(PrometheusError, match="returned 2 series; aggregate it to one with sum"):
        await client.query("up", at=1.0)
    await client.aclose()


@respx.mock
async def test_export_is_what_the_dry_run_reads(tmp_path: Any) -> None:
    def reply(request: httpx.Request) -> httpx.Response:
        params = dict(request.url.params)
        assert params["step"] == "60000ms"
        values = [[1060.0, "60"], [1120.0, "120"]]
        return httpx.Response(
            200,
            json={
                "status": "success",
                "data": {"resultType": "matrix", "result": [{"metric": {}, "values": values}]},
            },
        )

    respx.get(f"{PROM}/api/v1/query_range").mock(side_effect=reply)
    client = PrometheusClient(url=PROM, timeout_s=5)
    export = await PrometheusSource(client=client, queries=queries(), interval_s=60.0).export(
        start=1000.0, end=1120.0
    )
    await client.aclose()
    path = tmp_path / "export.json"
    path.write_text(json.dumps(export))
    observations = read_prometheus_export(path)
    assert [obs.num_requests for obs in observations] == [60.0, 120.0]


@respx.mock
async def test_run_prometheus_decides_at_boundaries_and_polls_queues_between() -> None:
    now = [1000.0]
    answers = {"num_requests": "2400", "queue_depth": "0"}
    # the interval's queries, and the fast loop's over its burn window
    fields = {
        promql: name
        for texts in (queries().text, queries().over(PlannerConfig().burn_window_s))
        for name, promql in texts.items()
    }

    def reply(request: httpx.Request) -> httpx.Response:
        field = fields[dict(request.url.params)["query"]]
        value = answers.get(field, "2000" if field == "isl" else "150" if field == "osl" else None)
        return httpx.Response(200, json=vector(value))

    respx.get(f"{PROM}/api/v1/query").mock(side_effect=reply)

    async def sleep(seconds: float) -> None:
        now[0] += seconds
        # Part-way through the third interval a queue builds up.
        answers["queue_depth"] = "4000" if 1090.0 <= now[0] < 1110.0 else "0"

    api = FakeApi(manifest())
    client = PrometheusClient(url=PROM, timeout_s=5)

    def build(namespace: str, name: str) -> Planned:
        return Planned(
            runner=runner(api, clock=lambda: now[0]),
            source=PrometheusSource(client=client, queries=queries(), interval_s=60.0),
        )

    fleet = Fleet(discover=lambda: api.names(namespace=None), build=build)
    steps = await run_prometheus(
        fleet, interval_s=60.0, poll_s=15.0, max_intervals=3, clock=lambda: now[0], sleep=sleep
    )
    await client.aclose()
    assert steps == 3
    # Boundaries aligned to multiples of the interval: 1020, 1080, 1140.
    assert now[0] == 1140.0
    messages = [event["message"] for event in api.events]
    assert "fast path" not in messages[0]  # the first boundary scales up for the load itself
    assert any("fast path" in message for message in messages[1:])


def test_action_names() -> None:
    assert action_of(decision({P: 2, D: 1}, {P: 1, D: 1})) == "scale_up"
    assert action_of(decision({P: 1, D: 1}, {P: 2, D: 1})) == "scale_down"
    assert action_of(decision({P: 2, D: 1}, {P: 1, D: 2})) == "rebalance"
    assert action_of(decision({P: 1, D: 1}, {P: 1, D: 1})) == "hold"


async def test_fleet_follows_deployments_as_they_come_and_go() -> None:
    apis = {"a": FakeApi(manifest()), "b": FakeApi(manifest())}
    present = ["a", "b"]
    built: list[str] = []

    async def discover() -> list[tuple[str, str]]:
        return [("serving", name) for name in present]

    def build(namespace: str, name: str) -> Planned:
        built.append(name)
        actuator = Actuator(api=apis[name], namespace=namespace, name="llama", observe_only=False)
        loop = Runner(
            config=PlannerConfig(predictor="constant"),
            actuator=actuator,
            perf=PolynomialPerfModel(),
            metrics=PlannerMetrics(),
            interval_s=60.0,
        )
        client = PrometheusClient(url=PROM, timeout_s=5)
        return Planned(
            runner=loop, source=PrometheusSource(client=client, queries=queries(), interval_s=60.0)
        )

    fleet = Fleet(discover=discover, build=build)
    await fleet.refresh()
    assert sorted(name for _, name in fleet.members) == ["a", "b"]
    first = fleet.members[("serving", "a")]
    present.remove("b")
    await fleet.refresh()
    assert list(fleet.members) == [("serving", "a")]
    assert fleet.members[("serving", "a")] is first  # kept with its forecasts
    present.append("c")
    apis["c"] = FakeApi(None)  # listed but unreadable: not planned, no crash
    await fleet.refresh()
    assert list(fleet.members) == [("serving", "a")]
    assert built == ["a", "b", "c"]
