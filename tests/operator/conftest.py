from __future__ import annotations

from typing import Any

import pytest

from copse.api import InferenceDeployment, parse_deployment


def make_deployment(**spec: Any) -> InferenceDeployment:
    body = {
        "apiVersion": "copse.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "llama", "namespace": "serving", "uid": "uid-1", "generation": 3},
        "spec": {"model": {"name": "meta-llama/Llama-3-70B", "tensorParallelism": 8}, **spec},
    }
    return parse_deployment(body, source="test")


@pytest.fixture
def deployment() -> InferenceDeployment:
    return make_deployment(replicas=2)
