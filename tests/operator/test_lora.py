"""spec.model.loras: validation, TensorRT-LLM's lora_config in the engine YAML, the router's adapter
list, the mocked engines' flags, the download step and what rolls the pods."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from copse.api import Role
from copse.operator import children, weights
from copse.operator.children import GroupLayout
from copse.router.config import parse_config

from .conftest import make_deployment

ONE_TRAY = GroupLayout(role=Role.WORKER, replica=0, pods=(("tray-a", 4),), domain="d", rack="r", cost=0)
MODEL = {"name": "meta-llama/Llama-3.1-8B", "tensorParallelism": 4}
LORAS = [
    {"name": "sql", "source": "hf://org/sql-lora@v2", "rank": 16},
    {"name": "support", "source": "pvc://adapters/support", "rank": 64},
    {"name": "legal", "source": "s3://my-bucket/loras/legal", "rank": 8},
]
PVC = {"persistentVolumeClaim": "weights"}


def _with_loras(**model: Any) -> Any:
    return make_deployment(replicas=1, model={**MODEL, "cache": PVC, "loras": LORAS, **model})


def test_the_engine_yaml_carries_tensorrt_llms_lora_config() -> None:
    deployment = _with_loras(maxLoras=2)
    config = yaml.safe_load(children.engine_configmap(deployment)["data"]["worker.yaml"])
    assert config["lora_config"] == {
        "lora_dir": ["/models/loras/sql", "/models/adapters/support", "/models/loras/legal"],
        "max_lora_rank": 64,
        "max_loras": 2,
        "max_cpu_loras": 3,
    }
    plain = make_deployment(replicas=1, model={**MODEL, "cache": PVC})
    assert "lora_config" not in yaml.safe_load(children.engine_configmap(plain)["data"]["worker.yaml"])


def test_the_router_config_lists_the_adapters_where_the_engines_read_them() -> None:
    deployment = _with_loras(maxLoras=2)
    config = children.router_config(deployment)
    assert config["loras"] == [
        {"name": "sql", "path": "/models/loras/sql"},
        {"name": "support", "path": "/models/adapters/support"},
        {"name": "legal", "path": "/models/loras/legal"},
    ]
    assert config["max_loras"] == 2
    router = parse_config({**config, "tokenizer": "/tok", "kv_capacity_tokens": 100_000}, source="operator")
    resolved = router.catalog().resolve("support")
    assert resolved.adapter is not None
    assert resolved.adapter.lora_request()["lora_path"] == "/models/adapters/support"


def test_mocked_engines_serve_the_adapters() -> None:
    deployment = make_deployment(
        replicas=1,
        engine={"backend": "mock"},
        model={**MODEL, "loras": [{"name": "sql", "source": "hf://org/sql-lora", "rank": 8}], "maxLoras": 3},
    )
    [worker] = children.worker_pods(deployment, ONE_TRAY, cold_start_source=None)
    command = worker["spec"]["containers"][0]["command"]
    assert command[command.index("--lora") + 1] == "sql"
    assert command[command.index("--max-loras") + 1] == "3"
    assert "path" not in children.router_config(deployment)["loras"][0]  # mocked engines read nothing


def test_adding_an_adapter_rolls_the_pods_and_downloads_again_but_no_adapters_change_nothing() -> None:
    plain = make_deployment(replicas=1, model={**MODEL, "cache": PVC})
    assert "loras" not in children.template_inputs(plain, Role.WORKER)
    one = _with_loras()
    assert children.template_hash(one, Role.WORKER) != children.template_hash(plain, Role.WORKER)
    cache = plain.spec.model.cache
    assert cache is not None
    assert weights.marker_path(plain, cache) == "/models/.copse/models--meta-llama--Llama-3.1-8B.complete"
    assert weights.marker_path(one, cache) != weights.marker_path(plain, cache)


@pytest.mark.parametrize(
    ("loras", "message"),
    [
        ([{"name": "m", "source": "hf://o/r", "rank": 8}], "an adapter must not have the model's name"),
        ([{"name": "a", "source": "hf://o/r", "rank": 0}], "rank"),
        ([{"name": "a b", "source": "hf://o/r", "rank": 8}], "name"),
        ([{"name": "a", "source": "https://example.com/x", "rank": 8}], "source"),
        (
            [{"name": "a", "source": "pvc://adapters/../../etc", "rank": 8}],
            "source",
        ),
        ([{"name": "a", "source": "pvc://..", "rank": 8}], "source"),
        (
            [
                {"name": "a81104", "source": "hf://o/r", "rank": 8},
                {"name": "a134232", "source": "hf://o/s", "rank": 8},
            ],
            "its lora_int_id .* adapter 'a81104'",
        ),
    ],
)
def test_invalid_adapters_are_named(loras: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_deployment(replicas=1, engine={"backend": "mock"}, model={"name": "m", "loras": loras})


def test_the_download_step_fetches_hub_and_object_store_adapters(tmp_path: Path) -> None:
    fakes = tmp_path / "fake"
    (fakes / "huggingface_hub").mkdir(parents=True)
    (fakes / "huggingface_hub" / "__init__.py").write_text(
        "import json, os\n"
        "def snapshot_download(**kwargs):\n"
        "    with open(os.environ['CALLS'], 'a') as f: f.write(json.dumps(kwargs) + '\\n')\n"
        "    return kwargs.get('cache_dir') or kwargs['local_dir']\n"
    )
    (fakes / "fsspec").mkdir()
    (fakes / "fsspec" / "__init__.py").write_text(
        "import json, os\n"
        "class _Fs:\n"
        "    def __init__(self, scheme): self.scheme = scheme\n"
        "    def get(self, src, dst, recursive):\n"
        "        with open(os.environ['CALLS'], 'a') as f:\n"
        "            f.write(json.dumps({'scheme': self.scheme, 'src': src, 'dst': dst}) + '\\n')\n"
        "def filesystem(scheme): return _Fs(scheme)\n"
    )
    deployment = make_deployment(
        replicas=1, model={**MODEL, "cache": {"hostPath": "/raid"}, "loras": LORAS[::2]}
    )
    [worker] = children.worker_pods(deployment, ONE_TRAY, cold_start_source=None)
    [init] = worker["spec"]["initContainers"]
    env = {item["name"]: item["value"] for item in init["env"] if "value" in item}
    calls = tmp_path / "calls"
    env |= {"COPSE_WEIGHTS_MARKER": str(tmp_path / "done"), "CALLS": str(calls), "PYTHONPATH": str(fakes)}
    subprocess.run(
        [sys.executable, "-c", init["command"][2]], env=env, capture_output=True, text=True, check=True
    )
    recorded = [json.loads(line) for line in calls.read_text().splitlines()]
    assert recorded[1:] == [
        {"repo_id": "org/sql-lora", "revision": "v2", "local_dir": "/models/loras/sql", "token": None},
        {"scheme": "s3", "src": "my-bucket/loras/legal/", "dst": "/models/loras/legal/"},
    ]
