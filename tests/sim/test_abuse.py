"""Fuzzing and abuse of the serving path's real processes (router, mocked engine, KV relay), on
loopback: no 5xx, no dropped connection, every process under a memory bound, and the router still
serves good requests (:mod:`copse.sim.abuse`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from copse.sim.abuse import MODEL, Served, serving, soak
from copse.workers.testing import nats_server

RSS_BOUND = 600 * 1024 * 1024
"""Each process stays under this (they start at ~80-130 MB; a request the router allocated for
in proportion to a client's number grew it to 24 GB)."""
MIB = 1024 * 1024
BRACKETS = [{"text": "x"}] * 80
"""Documents enough to have the body's JSON nesting scanned (fewer brackets skip the scan)."""
GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with (
        nats_server() as nats_url,
        serving(
            workdir=tmp_path_factory.mktemp("abuse"),
            engine_args=("--speedup", "50"),
            router_settings={"clients": {"body_timeout_s": 2.0}},
            nats_url=nats_url,
        ) as running,
    ):
        yield running


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60) as client:
        yield client


def _still_well(served: Served, http: httpx.Client) -> None:
    reply = http.post(f"{served.router_url}/v1/chat/completions", json=GOOD)
    assert reply.status_code == 200, reply.text
    served.sample()
    assert all(peak < RSS_BOUND for peak in served.peak_rss.values()), served.peak_rss


def _no_server_error(reply: httpx.Response) -> None:
    assert reply.status_code < 500, (reply.status_code, reply.text[:300])
    if reply.status_code >= 400 and reply.headers.get("content-type", "").startswith("application/json"):
        error = reply.json()["error"]  # the one error shape
        assert set(error) == {"message", "type", "param", "code"}


_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=30)
)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_FIELDS = {
    "model": st.just(MODEL) | _JSON,
    "prompt": st.text(max_size=50)
    | st.lists(st.integers(min_value=-5, max_value=2**33), max_size=20)
    | _JSON,
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "tool", "alien", ""]) | _JSON},
            optional={"content": st.text(max_size=40) | _JSON},
        ),
        max_size=4,
    )
    | _JSON,
    "max_tokens": st.integers(min_value=-3, max_value=8)
    | st.integers(min_value=2**17, max_value=10**13)
    | _JSON,
    "n": st.integers(min_value=-1, max_value=10**9) | _JSON,
    "stream": st.booleans() | _JSON,
    "stop": st.lists(st.text(max_size=5), max_size=100) | _JSON,
    "logit_bias": st.dictionaries(st.text(max_size=6), st.floats(allow_nan=False), max_size=20) | _JSON,
    "temperature": _JSON,
    "tools": _JSON,
    "response_format": _JSON,
    "seed": _JSON,
}
_BODIES = st.fixed_dictionaries({}, optional=_FIELDS).map(lambda body: json.dumps(body).encode())


@FUZZ
@given(
    body=_BODIES | st.binary(max_size=300),
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
    target=st.sampled_from(["router", "engine"]),
)
def test_fuzzed_generation_bodies_never_get_a_5xx(
    served: Served, http: httpx.Client, body: bytes, path: str, target: str
) -> None:
    url = served.router_url if target == "router" else served.engine_url
    reply = http.post(f"{url}{path}", content=body, headers={"Content-Type": "application/json"})
    _no_server_error(reply)


@FUZZ
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
    path=st.sampled_from(
        ["/health", "/ready", "/metrics", "/workers", "/v1/models", "/worker_info", "/kv_dump",
         "/prometheus/metrics", "/kv_cache_events", "/reset_prefix_cache", "/nope", "/v1/embeddings"]
    ) | st.text(alphabet="abc/%.-_~", max_size=30).map(lambda tail: "/" + tail),
    target=st.sampled_from(["router", "engine", "relay"]),
    body=st.binary(max_size=200),
)  # fmt: skip
def test_every_endpoint_of_every_process_answers_without_a_5xx(  # noqa: PLR0917 (hypothesis passes them by name)
    served: Served, http: httpx.Client, method: str, path: str, target: str, body: bytes
) -> None:
    url = {"router": served.router_url, "engine": served.engine_url, "relay": served.relay_url}[target]
    reply = http.request(method, f"{url}{path}", content=body if method != "GET" else None)
    if path in ("/health", "/ready") and reply.status_code == 503:
        return  # a health answer, not an error: the probes' own 503
    _no_server_error(reply)


def test_the_three_reported_failures_and_huge_bodies_leave_every_process_well(
    served: Served, http: httpx.Client
) -> None:
    url = f"{served.router_url}/v1/chat/completions"
    cases: list[tuple[bytes, int]] = [
        (json.dumps({**GOOD, "max_tokens": 10**12}).encode(), 400),
        (b"[" * 5000 + b"]" * 5000, 400),
        (json.dumps({**GOOD, "messages": [{"role": "alien", "content": "x"}]}).encode(), 400),
        (b'{"model": "mock-model", "prompt": "' + b"a b " * (17 * 1024 * 1024) + b'"}', 413),
        (json.dumps({"model": MODEL, "messages": [[]] * 300_000}).encode(), 400),
        # 8 MiB of text in one string, and brackets enough to be scanned: the scan took 940 MB (a
        # regex keeping state per character)
        (
            json.dumps(
                {**GOOD, "messages": [{"role": "user", "content": "a" * 8 * MIB}], "documents": BRACKETS}
            ).encode(),
            200,
        ),
    ]
    for target in (url, f"{served.engine_url}/v1/chat/completions"):
        for body, status in cases:
            reply = http.post(target, content=body, headers={"Content-Type": "application/json"})
            assert reply.status_code == status, (target, reply.text[:300])
    _still_well(served, http)


def test_an_abuse_soak_fails_no_good_request(served: Served, http: httpx.Client) -> None:
    report = asyncio.run(soak(served, duration_s=20, good_clients=3, abusers=3, max_requests=600, seed=1))
    assert report.tried["good"] > 10
    assert report.good_failed == []
    # The answers say why a kind was never tried (a 429 after 30 s: the queue held the abusers).
    assert set(report.tried) == {"good", "malformed", "huge", "slow", "abandoned"}, (
        report.tried,
        report.statuses,
    )
    assert report.server_errors == []
    assert all(peak < RSS_BOUND for peak in served.peak_rss.values()), served.peak_rss
    _still_well(served, http)


@pytest.fixture(scope="module", autouse=True)
def _well_at_the_end(served: Served, http: httpx.Client) -> Iterator[None]:
    yield
    _still_well(served, http)
