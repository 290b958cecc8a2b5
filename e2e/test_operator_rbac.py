"""The operator's RBAC on a strict cluster: OwnerReferencesPermissionEnforcement on the local API
server (as OpenShift runs it), and the chart's namespaced Roles when operator.watchNamespaces is set."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from e2e.operator_harness import LEASE, OPERATOR_NAMESPACE, Operator, operator_kubeconfig, seed, wait_running

from copse.cluster import Kubectl, KubeTarget
from copse.cluster.kubectl import manifest_yaml

pytestmark = pytest.mark.e2e


def configmap(name: str, *, owner: dict[str, Any] | None = None, block: bool = False) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if owner is not None:
        metadata["ownerReferences"] = [
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "name": owner["metadata"]["name"],
                "uid": owner["metadata"]["uid"],
                **({"blockOwnerDeletion": True} if block else {}),
            }
        ]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata}


def grant(kubectl: Kubectl, namespace: str, name: str, rules: list[dict[str, Any]]) -> None:
    kubectl.apply(
        [
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": {"name": name},
                "rules": rules,
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": name},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
                "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
            },
        ],
        namespace=namespace,
    )


def test_the_local_api_server_enforces_owner_reference_permissions(
    kube: KubeTarget, kubectl: Kubectl, namespace: str
) -> None:
    """What the plugin checks (kube-apiserver v1.34): blockOwnerDeletion needs update on the owner's
    finalizers, and changing an object's ownerReferences needs delete on that object."""
    if kube.local is None:
        pytest.skip("only the local control plane is known to run OwnerReferencesPermissionEnforcement")
    kubectl.run("create", "serviceaccount", "prober", f"--namespace={namespace}")
    kubectl.apply(configmap("owner"), namespace=namespace)
    owner = kubectl.get("configmap", "owner", namespace=namespace)
    as_prober = f"--as=system:serviceaccount:{namespace}:prober"

    def refusal(*args: str, obj: dict[str, Any] | None = None) -> str:
        stdin = None if obj is None else manifest_yaml(obj)
        done = kubectl.run(*args, as_prober, f"--namespace={namespace}", stdin=stdin, check=False)
        return done.stderr if done.returncode else ""

    configmaps = {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create", "get", "patch"]}
    grant(kubectl, namespace, "prober", [configmaps])
    assert refusal("create", "-f", "-", obj=configmap("plain", owner=owner)) == ""
    blocking = configmap("blocking", owner=owner, block=True)
    assert "cannot set blockOwnerDeletion" in refusal("create", "-f", "-", obj=blocking)
    unowned = ("patch", "configmap", "plain", "--type=merge", "-p", '{"metadata":{"ownerReferences":null}}')
    assert "cannot set an ownerRef on a resource you can't delete" in refusal(*unowned)
    finalizers = {"apiGroups": [""], "resources": ["configmaps/finalizers"], "verbs": ["update"]}
    grant(
        kubectl,
        namespace,
        "prober",
        [{**configmaps, "verbs": ["create", "get", "patch", "delete"]}, finalizers],
    )
    assert refusal("create", "-f", "-", obj=blocking) == ""
    assert refusal(*unowned) == ""


def test_the_operator_owns_every_child_on_the_chart_rbac(
    kubectl: Kubectl, namespace: str, operator: Operator
) -> None:
    kubectl.apply(seed("strict"), namespace=namespace)
    wait_running(kubectl, "strict", namespace, operator)
    for kind, name in (
        ("secret", "strict-mpi-ssh"),
        ("configmap", "strict-engine"),
        ("configmap", "strict-router"),
        ("serviceaccount", "strict-router"),
        ("role", "strict-router"),
        ("rolebinding", "strict-router"),
        ("deployment", "strict-router"),
        ("poddisruptionbudget", "strict-router"),
        ("service", "strict-worker-0"),
        ("pod", "strict-worker-0-1"),
    ):
        [owner] = kubectl.get(kind, name, namespace=namespace)["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["blockOwnerDeletion"]) == (
            "InferenceDeployment",
            "strict",
            True,
        )
    # What lives and dies with a group is owned by its Service (not blocking: no finalizers rights).
    [owner] = kubectl.get("pdb", "strict-worker-0", namespace=namespace)["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner.get("blockOwnerDeletion")) == (
        "Service",
        "strict-worker-0",
        None,
    )


def test_watch_namespaces_narrows_the_operator_to_roles_in_them(
    kubectl: Kubectl, namespace: str, operator: Operator, tmp_path: Path
) -> None:
    release = "scoped"
    subject = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{release}-copse-operator"
    kubeconfig = operator_kubeconfig(
        kubectl, tmp_path, release=release, helm_args=("--set", f"operator.watchNamespaces={{{namespace}}}")
    )

    def can(verb: str, resource: str, where: str, *extra: str) -> bool:
        answer = kubectl.run(
            "auth", "can-i", verb, resource, *extra, f"--as={subject}", f"--namespace={where}", check=False
        )
        return answer.stdout.strip() == "yes"

    assert can("create", "pods", namespace)
    assert can("create", "roles", namespace)
    assert can("update", "inferencedeployments.copse.dev", namespace, "--subresource=finalizers")
    assert not can("create", "pods", "default")
    assert not can("create", "roles", "default")
    assert not can("create", "secrets", "default")
    assert can("create", "secrets", namespace)
    # Reads stay cluster-wide: GPUs held by any workload are not free.
    assert can("list", "pods", "default")
    assert can("list", "nodes", "default")
    # Only one operator may reconcile at a time: the session's cluster-wide one pauses meanwhile.
    operator.stop()
    scoped = Operator(
        log=tmp_path / "scoped.log", kubeconfig=kubeconfig, lease=LEASE, namespaces=(namespace,)
    )
    scoped.start()
    try:
        kubectl.apply(seed("scoped"), namespace=namespace)
        wait_running(kubectl, "scoped", namespace, scoped)
        kubectl.get("secret", "scoped-mpi-ssh", namespace=namespace)
    finally:
        scoped.stop()
        operator.start()
        for kind in ("clusterrolebinding", "clusterrole"):
            kubectl.run("delete", kind, f"{release}-copse-operator", "--ignore-not-found")
