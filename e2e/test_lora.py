"""LoRA adapters and two models behind one entry point, end to end: a real ``copse router run``
process in front of two ``copse worker mock`` processes (one model with three adapters on two
engines, another model on one engine), driven over HTTP; and an adapter request through a real
Envoy asking copse's endpoint picker."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import yaml
from e2e.local_router import MODEL, static_router

from copse.sim.gateway import envoy_gateway
from copse.workers.testing import free_port, free_port_range, mock_fleet, stop_process

pytestmark = pytest.mark.e2e

COPSE = str(Path(sys.executable).parent / "copse")


def _wait(what: str, condition: Callable[[], bool], *, processes: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 60.0
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if condition():
                return
        for process in processes:
            assert process.poll() is None, (
                f"{process.args!r} exited with {process.returncode} while waiting for {what}"
            )
        assert time.monotonic() < deadline, f"no {what} within 60 s"
        time.sleep(0.1)


@contextlib.contextmanager
def _process(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as sink:
        process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
        try:
            yield process
        finally:
            stop_process(process, timeout_s=30)


def _sample(metrics: str, name: str) -> float:
    """The value of the one sample ``name`` (with its labels) in a Prometheus exposition (0 if absent)."""
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _complete(router: str, model: str, prompt: list[int], **extra: Any) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, **extra}
    return httpx.post(f"{router}/v1/completions", json=body, timeout=30)


def test_adapters_and_two_models_behind_one_router_process(tmp_path: Path) -> None:
    llama_port, qwen_port, router_port = free_port_range(2), free_port(), free_port()
    llama = [f"http://127.0.0.1:{llama_port + i}" for i in range(2)]
    qwen = [f"http://127.0.0.1:{qwen_port}"]
    config = {
        "model": "llama",
        "engine": "mock",
        "port": router_port,
        "block_size": 32,
        "health_interval_s": 0.1,
        "discovery": {"kind": "static", "workers": [{"url": url} for url in llama]},
        "loras": [{"name": "sql"}, {"name": "chat"}, {"name": "legal"}],
        "max_loras": 1,
        "lora_load_ms": 200,
        "models": [{"name": "qwen", "discovery": {"kind": "static", "workers": [{"url": qwen[0]}]}}],
    }
    (tmp_path / "router.yaml").write_text(yaml.safe_dump(config))
    mock = [COPSE, "worker", "mock", "--block-size", "32", "--speedup", "20"]
    llama_argv = [
        *mock, "--engines", "2", "--port-base", str(llama_port), "--model", "llama",
        "--worker-prefix", "llama", "--max-loras", "1", "--lora-load-ms", "200",
    ]  # fmt: skip  # no --lora: the engines serve the adapters from the lora_request the router adds
    qwen_argv = [
        *mock,
        "--engines",
        "1",
        "--port-base",
        str(qwen_port),
        "--model",
        "qwen",
        "--worker-prefix",
        "qwen",
    ]
    router = f"http://127.0.0.1:{router_port}"
    with (
        _process(llama_argv, tmp_path / "llama.log") as llama_process,
        _process(qwen_argv, tmp_path / "qwen.log") as qwen_process,
        _process(
            [COPSE, "router", "run", "--config", str(tmp_path / "router.yaml")], tmp_path / "router.log"
        ) as router_process,
    ):
        processes = [llama_process, qwen_process, router_process]
        _wait(
            "router with three workers",
            lambda: httpx.get(f"{router}/health").json()["workers"] == 3,
            processes=processes,
        )

        listed = httpx.get(f"{router}/v1/models").json()["data"]
        assert [(m["id"], m.get("parent")) for m in listed] == [
            ("llama", None),
            ("qwen", None),
            ("sql", "llama"),
            ("chat", "llama"),
            ("legal", "llama"),
        ]
        unknown = _complete(router, "gpt-9", [1, 2, 3])
        assert unknown.status_code == 404
        assert unknown.json()["error"]["param"] == "model"
        assert "gpt-9" in unknown.json()["error"]["message"]
        smuggled = _complete(
            router, "llama", [1, 2, 3], lora_request={"lora_name": "x", "lora_int_id": 1, "lora_path": "/etc"}
        )
        assert smuggled.status_code == 400

        # Six requests through one adapter, one after the other: the router keeps them where the
        # adapter is loaded, so the engines load it once.
        prompt = list(range(500, 500 + 256))
        for i in range(6):
            answer = _complete(router, "sql", [*prompt, i])
            assert answer.status_code == 200, answer.text
        cached = _complete(router, "sql", [*prompt, 99]).json()["usage"]["prompt_tokens_details"][
            "cached_tokens"
        ]
        assert cached >= 224, "the adapter's own prefix is cached"
        base = _complete(router, "llama", [*prompt, 99]).json()["usage"]["prompt_tokens_details"][
            "cached_tokens"
        ]
        assert base == 0, "the base model's request finds none of the adapter's blocks"

        def llama_loads() -> float:
            return sum(
                _sample(
                    httpx.get(f"{url}/prometheus/metrics").text,
                    'copse_mock_lora_loads_total{engine_type="aggregated",model_name="llama"}',
                )
                for url in llama
            )

        assert llama_loads() == 1.0
        holders = [httpx.get(f"{url}/worker_info").json()["loras"] for url in llama]
        assert sorted(holders) == [[], ["sql"]]

        # The other model's requests reach only its own engine.
        before = [
            _sample(
                httpx.get(f"{url}/prometheus/metrics").text,
                'trtllm_prompt_tokens_total{engine_type="aggregated",model_name="llama"}',
            )
            for url in llama
        ]
        for i in range(3):
            assert _complete(router, "qwen", list(range(2000 + i, 2100 + i))).status_code == 200
        qwen_tokens = _sample(
            httpx.get(f"{qwen[0]}/prometheus/metrics").text,
            'trtllm_prompt_tokens_total{engine_type="aggregated",model_name="qwen"}',
        )
        assert qwen_tokens == 300.0
        after = [
            _sample(
                httpx.get(f"{url}/prometheus/metrics").text,
                'trtllm_prompt_tokens_total{engine_type="aggregated",model_name="llama"}',
            )
            for url in llama
        ]
        assert after == before

        streamed = _complete(router, "chat", list(range(4000, 4100)), stream=True)
        assert streamed.status_code == 200
        assert streamed.text.rstrip().endswith("data: [DONE]")
        metrics = httpx.get(f"{router}/metrics").text
        assert _sample(metrics, 'copse_router_adapter_admitted_total{adapter="sql",model="llama"}') == 7.0
        assert _sample(metrics, 'copse_router_adapter_admitted_total{adapter="base",model="qwen"}') == 3.0
        ttft = "copse_router_adapter_time_to_first_token_seconds_count"
        assert _sample(metrics, f'{ttft}{{adapter="chat",model="llama"}}') == 1.0
        assert _sample(metrics, "copse_router_adapter_loads_total") == 2.0  # sql, then chat

        # The router's picture of which engine holds which adapter is the engines' own.
        report = httpx.get(f"{router}/workers").json()["workers"]
        believed = {entry["url"]: (entry["model"], entry["loras"]) for entry in report}
        for url in llama:
            assert believed[url] == ("llama", httpx.get(f"{url}/worker_info").json()["loras"])
        assert believed[qwen[0]] == ("qwen", [])


async def test_an_adapter_request_through_envoy_and_the_endpoint_picker(tmp_path: Path) -> None:
    """EPP mode: a real Envoy asks copse's picker, which resolves the adapter and sends the body
    on with its ``lora_request``. The engines are not told the adapter's name (no ``--lora``), so
    they can only have served it from the ``lora_request`` Envoy forwarded."""
    async with (
        mock_fleet(engines=2, model_name=MODEL) as fleet,
        static_router(
            fleet.urls, epp={}, loras=[{"name": "sql", "path": "/models/loras/sql"}], max_loras=1
        ) as running,
    ):
        assert running.grpc_target is not None
        with envoy_gateway(
            picker=running.grpc_target, upstream="original_dst", engines=fleet.urls, scratch=tmp_path
        ) as url:
            async with aiohttp.ClientSession() as http:
                for i in range(3):
                    body = {"model": "sql", "prompt": list(range(700 + i, 900 + i)), "max_tokens": 2}
                    async with http.post(f"{url}/v1/completions", json=body) as response:
                        assert response.status == 200, await response.text()
                unknown = {"model": "gpt-9", "prompt": [1, 2, 3], "max_tokens": 1}
                async with http.post(f"{url}/v1/completions", json=unknown) as response:
                    assert response.status == 404
                    assert "gpt-9" in (await response.json())["error"]["message"]
    held = sorted(server.engine.adapters.held() for server in fleet.servers)
    assert held == [[], ["sql"]], "one engine loaded the adapter, once, and served all three requests"
    assert sum(server.engine.adapters.loads_total for server in fleet.servers) == 1
