"""The weights cache (``spec.model.cache``): engines load the model from storage, not each from
the hub (pure: builds objects, no I/O).

Engines see the cache at ``mountPath`` with ``HF_HUB_CACHE=<mountPath>/hub`` and
``HF_HUB_OFFLINE=1``, so ``trtllm-serve <model id>`` resolves the id to the cached snapshot and
never downloads. What fills the cache depends on where it lives:

- **PVC** (shared by every node): one Job per deployment, model and cache downloads the snapshot
  (``huggingface_hub.snapshot_download``, the token from the Secret the user names) and then writes
  a marker; every worker pod's init container waits for the marker (at most ``downloadTimeout``:
  then the pod fails and its gang restarts). One download however many groups start.
- **hostPath** (node-local): no single place to fill, so each worker pod's init container
  downloads into its node's directory unless the marker is already there; huggingface_hub's
  file locks keep two pods on one node from writing the same files.

ModelExpress cold start (issue 17) reads and fills the same ``spec.model.cache``.

LoRA adapters (``spec.model.loras``) live in the same cache: the download step fetches hub
adapters (``huggingface_hub.snapshot_download``) and object-store adapters (``fsspec``, which needs
``s3fs``/``gcsfs`` in the image) into ``<mountPath>/loras/<name>`` before it writes the marker;
a ``pvc://<path>`` adapter is already at ``<mountPath>/<path>``. The marker's name carries a digest
of the adapters, so adding one downloads again.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from copse.api import InferenceDeployment, LoraSpec, ModelCacheSpec
from copse.operator import names

VOLUME = "model-cache"

#: Downloads the model into HF_HUB_CACHE unless the marker says it is there, then writes the marker.
_DOWNLOAD = """\
import json, os, pathlib
from huggingface_hub import snapshot_download
marker = pathlib.Path(os.environ["COPSE_WEIGHTS_MARKER"])
if marker.exists():
    print(f"copse: {os.environ['COPSE_MODEL']} is already cached ({marker})")
else:
    path = snapshot_download(
        repo_id=os.environ["COPSE_MODEL"],
        cache_dir=os.environ["HF_HUB_CACHE"],
        token=os.environ.get("HF_TOKEN") or None,
    )
    for lora in json.loads(os.environ.get("COPSE_LORAS") or "[]"):
        scheme, rest = lora["source"].split("://", 1)
        if scheme == "hf":
            repo, _, revision = rest.partition("@")
            snapshot_download(
                repo_id=repo,
                revision=revision or None,
                local_dir=lora["path"],
                token=os.environ.get("HF_TOKEN") or None,
            )
        else:
            try:
                import fsspec
                fsspec.filesystem(scheme).get(rest.rstrip("/") + "/", lora["path"] + "/", recursive=True)
            except ImportError as exc:
                raise SystemExit(f"copse: adapter {lora['name']} ({lora['source']}) needs fsspec and "
                                 f"{'s3fs' if scheme == 's3' else 'gcsfs'} in this image: {exc}")
        print(f"copse: cached adapter {lora['name']} from {lora['source']} in {lora['path']}")
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(path + "\\n")
    print(f"copse: cached {os.environ['COPSE_MODEL']} in {path}")
"""

#: Waits (bounded) for the download Job's marker on the shared cache.
_AWAIT = """\
set -eu
deadline=$(( $(date +%s) + COPSE_WEIGHTS_TIMEOUT_S ))
until [ -e "$COPSE_WEIGHTS_MARKER" ]; do
  if [ "$(date +%s)" -ge "$deadline" ]; then
    echo "copse: $COPSE_MODEL is not in the cache after ${COPSE_WEIGHTS_TIMEOUT_S}s (see the weights Job)" >&2
    exit 1
  fi
  sleep 5
done
echo "copse: $COPSE_MODEL is cached"
"""


def _downloaded(deployment: InferenceDeployment) -> list[LoraSpec]:
    """The adapters the download step fetches (hub and object store; a pvc:// one is in place)."""
    return [lora for lora in deployment.spec.model.loras if lora.scheme != "pvc"]


def _digest(deployment: InferenceDeployment, cache: ModelCacheSpec) -> str:
    shaped: dict[str, Any] = {"model": deployment.spec.model.name, "cache": cache.model_dump(mode="json")}
    downloaded = _downloaded(deployment)
    if downloaded:  # only then: a deployment without adapters keeps its Job name
        shaped["loras"] = [[lora.name, lora.source] for lora in downloaded]
    return hashlib.sha256(json.dumps(shaped, sort_keys=True).encode()).hexdigest()[:8]


def lora_path(cache: ModelCacheSpec, lora: LoraSpec) -> str:
    """Where the engines read adapter ``lora`` (``lora_request.lora_path``, ``lora_config.lora_dir``)."""
    if lora.scheme == "pvc":
        return f"{cache.mount_path}/{lora.pvc_path}"
    return f"{cache.mount_path}/loras/{lora.name}"


def marker_path(deployment: InferenceDeployment, cache: ModelCacheSpec) -> str:
    """Written once the model (and its downloaded adapters) is complete in the cache; per model id
    (huggingface's own folder name) and set of adapters."""
    folder = "models--" + deployment.spec.model.name.replace("/", "--")
    if _downloaded(deployment):
        folder += "." + _digest(deployment, cache)
    return f"{cache.mount_path}/.copse/{folder}.complete"


def engine_env(cache: ModelCacheSpec) -> dict[str, str]:
    return {"HF_HUB_CACHE": f"{cache.mount_path}/hub", "HF_HUB_OFFLINE": "1"}


def volume(cache: ModelCacheSpec) -> dict[str, Any]:
    if cache.persistent_volume_claim is not None:
        return {"name": VOLUME, "persistentVolumeClaim": {"claimName": cache.persistent_volume_claim}}
    return {"name": VOLUME, "hostPath": {"path": cache.host_path, "type": "DirectoryOrCreate"}}


def mount(cache: ModelCacheSpec) -> dict[str, Any]:
    return {"name": VOLUME, "mountPath": cache.mount_path}


def _step_env(
    deployment: InferenceDeployment, cache: ModelCacheSpec, *, download: bool
) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "COPSE_MODEL", "value": deployment.spec.model.name},
        {"name": "COPSE_WEIGHTS_MARKER", "value": marker_path(deployment, cache)},
        {"name": "COPSE_WEIGHTS_TIMEOUT_S", "value": str(int(cache.download_timeout_s))},
        {"name": "HF_HUB_CACHE", "value": f"{cache.mount_path}/hub"},
    ]
    downloaded = _downloaded(deployment)
    if download and downloaded:
        loras = [{"name": x.name, "source": x.source, "path": lora_path(cache, x)} for x in downloaded]
        env.append({"name": "COPSE_LORAS", "value": json.dumps(loras, separators=(",", ":"))})
    if download and cache.hf_token_secret is not None:
        ref = cache.hf_token_secret
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    return env


def init_containers(deployment: InferenceDeployment, *, image: str) -> list[dict[str, Any]]:
    """What a worker pod runs before the engine: wait for the Job (PVC) or download (hostPath)."""
    cache = deployment.spec.model.cache
    if cache is None:
        return []
    shared = cache.persistent_volume_claim is not None
    return [
        {
            "name": "weights",
            "image": image,
            "command": ["/bin/sh", "-c", _AWAIT] if shared else ["python3", "-c", _DOWNLOAD],
            "env": _step_env(deployment, cache, download=not shared),
            "volumeMounts": [mount(cache)],
        }
    ]


def download_job(
    deployment: InferenceDeployment, *, image: str, owner: dict[str, Any]
) -> dict[str, Any] | None:
    """The one-shot Job that fills a PVC cache; None for a node-local cache or none at all."""
    cache = deployment.spec.model.cache
    if cache is None or cache.persistent_volume_claim is None:
        return None
    name = deployment.metadata.name
    labels = {
        names.LABEL_MANAGED_BY: names.MANAGED_BY,
        names.LABEL_DEPLOYMENT: name,
        names.LABEL_COMPONENT: names.COMPONENT_WEIGHTS,
    }
    pod = deployment.spec.pod
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": names.weights_job_name(name, _digest(deployment, cache)),
            "namespace": deployment.metadata.namespace,
            "labels": labels,
            "ownerReferences": [owner],
        },
        "spec": {
            "backoffLimit": 4,
            "activeDeadlineSeconds": int(cache.download_timeout_s),
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "restartPolicy": "Never",
                    "tolerations": [t.model_dump(mode="json", exclude_none=True) for t in pod.tolerations],
                    "containers": [
                        {
                            "name": "download",
                            "image": image,
                            "command": ["python3", "-c", _DOWNLOAD],
                            "env": _step_env(deployment, cache, download=True),
                            "volumeMounts": [mount(cache)],
                        }
                    ],
                    "volumes": [volume(cache)],
                },
            },
        },
    }
