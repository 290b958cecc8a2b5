"""Deterministic names and labels of everything the operator creates.

Names derive only from the deployment, the role and the group's replica index, so an
operator that restarts mid-reconcile finds what it already made instead of making it twice.
"""

from __future__ import annotations

import hashlib

from copse.api import Role

DOMAIN = "copse.dev"
LABEL_DEPLOYMENT = f"{DOMAIN}/deployment"
LABEL_ROLE = f"{DOMAIN}/role"
LABEL_GROUP = f"{DOMAIN}/group"
LABEL_REPLICA = f"{DOMAIN}/replica"
LABEL_RANK = f"{DOMAIN}/rank"
LABEL_LEADER = f"{DOMAIN}/leader"
LABEL_DOMAIN = f"{DOMAIN}/domain"  # the group's NVLink domain, when it has one
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "copse-operator"

#: Hash of everything that shapes a worker pod; a mismatch means the group is outdated.
ANNOTATION_TEMPLATE_HASH = f"{DOMAIN}/template-hash"
#: The hashed inputs themselves, on the group's Service: a roll's Event names the fields that changed.
ANNOTATION_TEMPLATE = f"{DOMAIN}/template"
#: The deployment's revision (what prefill and decode share) on every worker pod: the router
#: pairs prefill and decode groups of one revision only.
LABEL_REVISION = f"{DOMAIN}/revision"
#: The group's planned pods as JSON, written on its Service before any pod exists so a
#: restarted operator can finish a half-created gang exactly as planned.
ANNOTATION_PLACEMENT = f"{DOMAIN}/placement"
#: The NVLink domain, rack and cost the group was placed with.
ANNOTATION_DOMAIN = f"{DOMAIN}/domain"
ANNOTATION_RACK = f"{DOMAIN}/rack"
ANNOTATION_COST = f"{DOMAIN}/cost"
#: Gang restarts so far and when the last one happened (backoff survives operator restarts).
ANNOTATION_RESTARTS = f"{DOMAIN}/restarts"
ANNOTATION_LAST_RESTART = f"{DOMAIN}/last-restart"

#: Label on the pods of a group being removed: the router sends it no new requests (the
#: router's discovery reads the same key).
LABEL_DRAINING = f"{DOMAIN}/draining"
#: When the group started to drain and why, on its Service: the deadline survives restarts.
ANNOTATION_DRAINING_SINCE = f"{DOMAIN}/draining-since"
ANNOTATION_DRAINING_REASON = f"{DOMAIN}/draining-reason"

#: Scheduling gate held on every pod of a gang until all of them exist.
GANG_GATE = f"{DOMAIN}/gang"

COMPONENT_WORKER = "worker"
COMPONENT_ROUTER = "router"
COMPONENT_MODELEXPRESS = "modelexpress"
COMPONENT_WEIGHTS = "weights"

_MAX_NAME = 63


def _fit(name: str) -> str:
    """Kubernetes names (and Service names, which become DNS labels) stay within 63 characters."""
    if len(name) <= _MAX_NAME:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    return f"{name[: _MAX_NAME - 9].rstrip('-')}-{digest}"


def group_name(deployment: str, role: Role, replica: int) -> str:
    return _fit(f"{deployment}-{role.value}-{replica}")


def pod_name(group: str, rank: int) -> str:
    return _fit(f"{group}-{rank}")


def engine_config_name(deployment: str) -> str:
    return _fit(f"{deployment}-engine")


def router_name(deployment: str) -> str:
    return _fit(f"{deployment}-router")


def modelexpress_name(deployment: str) -> str:
    """The ModelExpress server's Deployment and Service."""
    return _fit(f"{deployment}-modelexpress")


def modelexpress_source_name(deployment: str) -> str:
    """The Service new groups fetch weights through: the chosen source group's worker gRPC ports."""
    return _fit(f"{deployment}-mx-source")


def ssh_secret_name(deployment: str) -> str:
    """The deployment's MPI ssh keys (groups spanning nodes)."""
    return _fit(f"{deployment}-mpi-ssh")


def compute_domain_name(group: str, restarts: int) -> str:
    """A group's IMEX ComputeDomain, one per placement (``restarts`` counts them): a restarted
    gang gets a new one instead of racing the deletion of the old one."""
    return _fit(f"{group}-imex-{restarts}")


def channel_template_name(compute_domain: str) -> str:
    """The ResourceClaimTemplate the DRA driver creates for a ComputeDomain; the pods claim from it."""
    return _fit(f"{compute_domain}-channel")


def weights_job_name(deployment: str, digest: str) -> str:
    """The Job that downloads the weights into a PVC cache, per model and cache."""
    return _fit(f"{deployment}-weights-{digest}")


def worker_selector(deployment: str) -> dict[str, str]:
    return {LABEL_DEPLOYMENT: deployment, LABEL_COMPONENT: COMPONENT_WORKER}


def scale_selector(deployment: str) -> dict[str, str]:
    """What one replica of the scale subresource is: a TP group of the aggregated pool, counted
    by its rank-0 pod (an autoscaler averages per-pod metrics over exactly these)."""
    return {**worker_selector(deployment), LABEL_ROLE: "worker", LABEL_LEADER: "true"}


def selector_string(labels: dict[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


def scale_selector_string(deployment: str) -> str:
    """:func:`scale_selector` without the pods of draining groups (they are on their way out);
    ``!key`` rather than ``key!=true``, which the scale subresource's selector parser refuses."""
    return f"{selector_string(scale_selector(deployment))},!{LABEL_DRAINING}"
