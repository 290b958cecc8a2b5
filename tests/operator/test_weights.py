"""The weights cache (spec.model.cache) and /dev/shm: what the pods and the download Job get."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from copse.api import Role
from copse.operator import children, weights
from copse.operator.children import GroupLayout

from .conftest import make_deployment
from .test_reconcile import NAMESPACE, Harness

ONE_TRAY = GroupLayout(role=Role.WORKER, replica=0, pods=(("tray-a", 4),), domain="d", rack="r", cost=0)
MODEL = {"name": "meta-llama/Llama-3-70B", "tensorParallelism": 4}
PVC = {"persistentVolumeClaim": "weights", "hfTokenSecret": {"name": "hf"}}


def pod(**spec: Any) -> dict[str, Any]:
    [only] = children.worker_pods(make_deployment(replicas=1, **spec), ONE_TRAY, cold_start_source=None)
    return only


def engine(pod: dict[str, Any]) -> dict[str, Any]:
    [container] = [c for c in pod["spec"]["containers"] if c["name"] == "engine"]
    return dict(container)


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container["env"]}


def test_shm_is_memory_backed_and_sized_by_the_setting() -> None:
    default, sized, off = pod(), pod(pod={"shmSize": "32Gi"}), pod(pod={"shmSize": None})
    for worker, size in ((default, "8Gi"), (sized, "32Gi")):
        volumes = {v["name"]: v for v in worker["spec"]["volumes"]}
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": size}
        assert {"name": "dshm", "mountPath": "/dev/shm"} in engine(worker)["volumeMounts"]
    assert "dshm" not in {v["name"] for v in off["spec"]["volumes"]}


def test_a_pvc_cache_is_filled_once_by_a_job_and_pods_wait_for_it() -> None:
    deployment = make_deployment(replicas=1, model={**MODEL, "cache": PVC})
    worker = children.worker_pods(deployment, ONE_TRAY, cold_start_source=None)[0]
    volumes = {v["name"]: v for v in worker["spec"]["volumes"]}
    assert volumes[weights.VOLUME] == {
        "name": weights.VOLUME,
        "persistentVolumeClaim": {"claimName": "weights"},
    }
    env = env_of(engine(worker))
    assert (env["HF_HUB_CACHE"], env["HF_HUB_OFFLINE"]) == ("/models/hub", "1")
    assert "HF_TOKEN" not in env, "the engine reads the cache only; the token stays with the download"
    [init] = worker["spec"]["initContainers"]
    assert init["command"][:2] == ["/bin/sh", "-c"]
    assert env_of(init)["COPSE_WEIGHTS_MARKER"] == "/models/.copse/models--meta-llama--Llama-3-70B.complete"
    owner = children.owner_reference(deployment)
    job = weights.download_job(deployment, image="img", owner=owner)
    assert job is not None
    assert job["metadata"]["ownerReferences"] == [owner]
    [download] = job["spec"]["template"]["spec"]["containers"]
    assert env_of(download)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}}
    assert download["command"][:2] == ["python3", "-c"]
    assert job["spec"]["activeDeadlineSeconds"] == 3600
    assert job["spec"]["template"]["spec"]["volumes"] == [volumes[weights.VOLUME]]


def test_a_node_local_cache_downloads_in_each_pod() -> None:
    cache = {
        "hostPath": "/raid/models",
        "mountPath": "/weights",
        "hfTokenSecret": {"name": "hf", "key": "token"},
    }
    deployment = make_deployment(replicas=1, model={**MODEL, "cache": cache})
    worker = children.worker_pods(deployment, ONE_TRAY, cold_start_source=None)[0]
    volumes = {v["name"]: v for v in worker["spec"]["volumes"]}
    assert volumes[weights.VOLUME]["hostPath"] == {"path": "/raid/models", "type": "DirectoryOrCreate"}
    [init] = worker["spec"]["initContainers"]
    assert init["command"][:2] == ["python3", "-c"]
    assert env_of(init)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert env_of(engine(worker))["HF_HUB_CACHE"] == "/weights/hub"
    assert weights.download_job(deployment, image="img", owner={}) is None


def run_download(tmp_path: Path, marker: Path) -> subprocess.CompletedProcess[str]:
    """The download step's program with a stand-in huggingface_hub that records its call."""
    fake = tmp_path / "fake" / "huggingface_hub"
    fake.mkdir(parents=True, exist_ok=True)
    (fake / "__init__.py").write_text(
        "import json, os\n"
        "def snapshot_download(**kwargs):\n"
        "    with open(os.environ['CALLS'], 'a') as f: f.write(json.dumps(kwargs) + '\\n')\n"
        "    return kwargs['cache_dir'] + '/snapshot'\n"
    )
    worker = pod(model={**MODEL, "cache": {"hostPath": "/raid"}})
    [init] = worker["spec"]["initContainers"]
    env = {item["name"]: item["value"] for item in init["env"] if "value" in item}
    env |= {"COPSE_WEIGHTS_MARKER": str(marker), "HF_TOKEN": "hf_secret", "CALLS": str(tmp_path / "calls")}
    return subprocess.run(
        [sys.executable, "-c", init["command"][2]],
        env={**env, "PYTHONPATH": str(fake.parent)},
        capture_output=True,
        text=True,
        check=True,
    )


def test_the_download_step_fetches_once_then_trusts_the_marker(tmp_path: Path) -> None:
    marker = tmp_path / "cache" / ".copse" / "done"
    run_download(tmp_path, marker)
    assert marker.read_text() == "/models/hub/snapshot\n"
    second = run_download(tmp_path, marker)
    assert "already cached" in second.stdout
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls == [
        '{"repo_id": "meta-llama/Llama-3-70B", "cache_dir": "/models/hub", "token": "hf_secret"}'
    ]


@pytest.mark.parametrize("cache", [{}, {"persistentVolumeClaim": "a", "hostPath": "/b"}])
def test_a_cache_names_exactly_one_place(cache: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="exactly one of persistentVolumeClaim and hostPath"):
        make_deployment(replicas=1, model={**MODEL, "cache": cache})


async def test_the_controller_creates_the_download_job_once() -> None:
    harness = Harness(replicas=1, model={**MODEL, "cache": PVC})
    await harness.settle()
    [job] = harness.kube.of_kind("Job")
    assert job["metadata"]["namespace"] == NAMESPACE
    assert job["metadata"]["ownerReferences"][0]["uid"] == "uid-llama"
    assert [call for call in harness.kube.calls if call[0] == "create Job"] == [
        ("create Job", job["metadata"]["name"])
    ]
    harness.update_spec(model={**MODEL, "name": "other/model", "cache": PVC})
    await harness.settle()
    assert len(harness.kube.of_kind("Job")) == 2, "another model is another download"
