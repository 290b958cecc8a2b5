"""TP groups that span nodes: one MPI world over ssh, and an IMEX channel for NVLink across trays
(pure: builds objects and scripts, no I/O).

**ssh.** Rank 0 runs ``mpirun``, which starts the other ranks' processes over ssh (as TensorRT-LLM's
``trtllm-llmapi-launch`` expects, and as LeaderWorkerSet and Dynamo run it). Per deployment the
operator generates one Secret (:func:`ssh_secret`: a client key pair and a host key pair, Ed25519,
owned by the InferenceDeployment); every rank mounts it and copies it into a memory-backed
directory with the modes OpenSSH insists on. Ranks > 0 run ``sshd`` on :data:`SSH_PORT` with that
host key, the client key as their only authorized key, no passwords. Rank 0 pins the host key in a
``known_hosts`` entry (so there is never a prompt, and never a blind trust), waits until every
other rank accepts a login (a bounded loop: the gang restarts when one never does), then runs
``mpirun`` with the ranks' environment forwarded (``-x``) and that ssh configuration.

**ComputeDomain.** Pods on different trays of one NVL72 share NVLink only through an IMEX channel,
which NVIDIA's DRA driver for GPUs hands out per ``ComputeDomain`` (``resource.nvidia.com/v1beta1``).
One ComputeDomain per group, not per deployment: ``spec.numNodes`` is then fixed by the group's
placement (the spec is immutable), scaling adds and removes domains without touching the others,
a gang restart replaces only its own, and a deployment's groups sit on different racks (different
IMEX domains) anyway. Its name counts the group's restarts, so a gang placed again gets a fresh
domain instead of racing the deletion of the old one (deleted at the restart). It is owned by the
group's Service: removing the group removes it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from copse.api import ComputeDomainMode, InferenceDeployment
from copse.operator import names

SSH_PORT = 2222
SSH_KEYS_DIR = "/etc/copse/ssh-keys"
"""The Secret, read-only (its files' owner and modes are the kubelet's)."""
SSH_DIR = "/var/run/copse/ssh"
"""A memory-backed emptyDir: the keys with the modes ssh demands, and the generated configs."""
CLIENT_KEY = "id_ed25519"
HOST_KEY = "ssh_host_ed25519_key"

COMPUTE_DOMAIN_GROUP = "resource.nvidia.com"
COMPUTE_DOMAIN_VERSION = "v1beta1"
COMPUTE_DOMAIN_PLURAL = "computedomains"
COMPUTE_DOMAIN_CRD = f"{COMPUTE_DOMAIN_PLURAL}.{COMPUTE_DOMAIN_GROUP}"
CHANNEL_CLAIM = "imex-channel"
"""The pod's name for its ResourceClaim of the group's IMEX channel."""
CONDITION = "MultiNodeNVLink"

#: What rank 0's mpirun forwards to the other ranks (ssh starts them with sshd's bare
#: environment): the engine's search paths and every variable of the families that tune
#: NCCL, UCX, TensorRT-LLM and the Hugging Face hub, plus the pod's own ``spec.pod.env``.
#: CUDA_VISIBLE_DEVICES and NVIDIA_* stay out: each node's device plugin set its own.
FORWARDED_NAMES = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "TOKENIZERS_PARALLELISM")
FORWARDED_PREFIXES = ("NCCL_", "UCX_", "TLLM_", "TRTLLM_", "NVSHMEM_", "GLOO_", "HF_", "HUGGING_FACE_")
#: Open MPI strips the domain from host names unless told not to; the ranks only resolve each
#: other through the group Service's FQDNs. Open MPI 4 (orte) and 5 (prte) spell it differently.
MPI_ENV = {"OMPI_MCA_orte_keep_fqdn_hostnames": "1", "PRTE_MCA_prte_keep_fqdn_hostnames": "1"}


def _key_pair(comment: str) -> tuple[str, str]:
    """An Ed25519 key in OpenSSH's private-key format and its ``authorized_keys`` line."""
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        encoding=serialization.Encoding.PEM,
        format=serialization.PrivateFormat.OpenSSH,
        encryption_algorithm=serialization.NoEncryption(),
    ).decode()
    public = key.public_key().public_bytes(
        encoding=serialization.Encoding.OpenSSH, format=serialization.PublicFormat.OpenSSH
    )
    return private, f"{public.decode()} {comment}\n"


def ssh_secret(deployment: InferenceDeployment, *, owner: Mapping[str, Any]) -> dict[str, Any]:
    """The deployment's MPI ssh keys, freshly generated (the operator creates it once and never
    reads, logs or regenerates it: a new key would lock out running ranks)."""
    name = deployment.metadata.name
    client_private, client_public = _key_pair(f"copse-mpi@{name}")
    host_private, host_public = _key_pair(f"copse-sshd@{name}")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": names.ssh_secret_name(name),
            "namespace": deployment.metadata.namespace,
            "labels": {names.LABEL_MANAGED_BY: names.MANAGED_BY, names.LABEL_DEPLOYMENT: name},
            "ownerReferences": [dict(owner)],
        },
        "stringData": {
            CLIENT_KEY: client_private,
            f"{CLIENT_KEY}.pub": client_public,
            HOST_KEY: host_private,
            f"{HOST_KEY}.pub": host_public,
        },
    }


# POSIX sh (dash in Debian/Ubuntu images, busybox elsewhere). Paths come from the environment
# so that tests can run the very same text against a scratch directory.
_SETUP = r"""set -eu
keys="$COPSE_SSH_KEYS" dir="$COPSE_SSH_DIR" port="$COPSE_SSH_PORT"
mkdir -p "$dir"
umask 077
cp "$keys/id_ed25519" "$dir/id_ed25519"
cp "$keys/ssh_host_ed25519_key" "$dir/ssh_host_ed25519_key"
cp "$keys/id_ed25519.pub" "$dir/authorized_keys"
printf '* %s\n' "$(cut -d' ' -f1,2 "$keys/ssh_host_ed25519_key.pub")" > "$dir/known_hosts"
cat > "$dir/ssh_config" <<EOF
Host *
  Port $port
  IdentityFile $dir/id_ed25519
  IdentitiesOnly yes
  UserKnownHostsFile $dir/known_hosts
  GlobalKnownHostsFile /dev/null
  StrictHostKeyChecking yes
  CheckHostIP no
  BatchMode yes
  ConnectTimeout 5
  LogLevel ERROR
EOF
"""

_FOLLOWER = r"""cat > "$dir/sshd_config" <<EOF
Port $port
HostKey $dir/ssh_host_ed25519_key
AuthorizedKeysFile $dir/authorized_keys
PidFile $dir/sshd.pid
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
EOF
sshd="$(command -v sshd || echo /usr/sbin/sshd)"
if [ ! -x "$sshd" ]; then
  echo "copse: no sshd in this image; every rank of a group spanning nodes needs openssh-server" >&2
  exit 1
fi
# sshd wants its privilege-separation directory when started as root.
if [ "$(id -u)" = 0 ]; then mkdir -p /run/sshd; fi
echo "copse: rank $COPSE_NODE_RANK serving ssh on port $port for rank 0's mpirun"
exec "$sshd" -D -e -f "$dir/sshd_config" "$@"
"""

_LEADER = r"""timeout="$COPSE_FOLLOWER_TIMEOUT_S"
deadline=$(( $(date +%s) + timeout ))
for host in $(printf '%s\n' "$COPSE_MPI_HOSTS" | tr ',' '\n' | sed '1d; s/:[0-9]*$//'); do
  until ssh -F "$dir/ssh_config" "$host" true; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
      echo "copse: $host refused ssh on port $port for ${timeout}s; giving up (the gang restarts)" >&2
      exit 1
    fi
    sleep 2
  done
  echo "copse: $host accepts ssh"
done
for name in $(env | sed -n 's/^\([A-Za-z_][A-Za-z0-9_]*\)=.*/\1/p'); do
  case "$name" in
    __FORWARDED__) set -- -x "$name" "$@" ;;
  esac
done
# Open MPI 4 reads plm_rsh_args, Open MPI 5 (PRRTE) plm_ssh_args; an unknown one is ignored.
export OMPI_MCA_plm_rsh_args="-F $dir/ssh_config" PRTE_MCA_plm_ssh_args="-F $dir/ssh_config"
root=""
if [ "$(id -u)" = 0 ]; then root="--allow-run-as-root"; fi
mpirun="$(command -v mpirun)"
echo "copse: every rank answers; starting $COPSE_WORLD_SIZE ranks on $COPSE_MPI_HOSTS"
# --prefix: the other ranks' orted is found where this mpirun lives, whatever sshd's PATH is.
exec "$mpirun" $root --prefix "$(dirname "$(dirname "$mpirun")")" --bind-to none \
  -np "$COPSE_WORLD_SIZE" -H "$COPSE_MPI_HOSTS" "$@"
"""


def _forwarded_patterns(extra: Iterable[str]) -> str:
    """The ``case`` pattern of the variable names rank 0 forwards (names are validated identifiers)."""
    return "|".join([*FORWARDED_NAMES, *(f"{prefix}*" for prefix in FORWARDED_PREFIXES), *sorted(set(extra))])


def follower_command() -> list[str]:
    """Rank > 0: set up ssh and serve it until the pod goes."""
    return ["/bin/sh", "-c", _SETUP + _FOLLOWER, "copse-mpi-follower"]


def leader_command(*, launched: Sequence[str], forwarded: Iterable[str]) -> list[str]:
    """Rank 0: set up ssh, wait for every other rank's sshd, then ``mpirun … <launched>``.
    ``launched`` travels as positional arguments, so no quoting of the engine's arguments."""
    script = _SETUP + _LEADER.replace("__FORWARDED__", _forwarded_patterns(forwarded))
    return ["/bin/sh", "-c", script, "copse-mpi-leader", *launched]


def ssh_env(
    *, hosts: Sequence[str], layout_pods: Sequence[tuple[str, int]], timeout_s: float
) -> dict[str, str]:
    """Environment of every rank of a group that spans nodes."""
    return {
        "COPSE_SSH_KEYS": SSH_KEYS_DIR,
        "COPSE_SSH_DIR": SSH_DIR,
        "COPSE_SSH_PORT": str(SSH_PORT),
        "COPSE_MPI_HOSTS": ",".join(
            f"{host}:{gpus}" for host, (_, gpus) in zip(hosts, layout_pods, strict=True)
        ),
        "COPSE_FOLLOWER_TIMEOUT_S": str(int(timeout_s)),
        **MPI_ENV,
    }


def ssh_volumes(deployment: str) -> list[dict[str, Any]]:
    return [
        {
            "name": "mpi-ssh-keys",
            "secret": {"secretName": names.ssh_secret_name(deployment), "defaultMode": 0o400},
        },
        {"name": "mpi-ssh", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
    ]


def ssh_mounts() -> list[dict[str, Any]]:
    return [
        {"name": "mpi-ssh-keys", "mountPath": SSH_KEYS_DIR, "readOnly": True},
        {"name": "mpi-ssh", "mountPath": SSH_DIR},
    ]


# -- ComputeDomain ----------------------------------------------------------------------------


def spans_trays(*, pods: Sequence[tuple[str, int]], domain: str | None) -> bool:
    """A group on several nodes of one NVLink domain: NVLink between them needs an IMEX channel.
    (A group spanning domains has no NVLink between its parts to enable.)"""
    return len(pods) > 1 and domain is not None


def wants_compute_domain(
    deployment: InferenceDeployment, *, pods: Sequence[tuple[str, int]], domain: str | None
) -> bool:
    mode = deployment.spec.engine.multi_node.compute_domain
    return mode is ComputeDomainMode.AUTO and spans_trays(pods=pods, domain=domain)


def compute_domain(
    *, name: str, namespace: str, labels: Mapping[str, str], owner: Mapping[str, Any], num_nodes: int
) -> dict[str, Any]:
    return {
        "apiVersion": f"{COMPUTE_DOMAIN_GROUP}/{COMPUTE_DOMAIN_VERSION}",
        "kind": "ComputeDomain",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {names.LABEL_MANAGED_BY: names.MANAGED_BY, **labels},
            "ownerReferences": [dict(owner)],
        },
        "spec": {
            # Deprecated upstream but required; the exact count is right in both of the driver's
            # modes (it gates startup without IMEXDaemonsWithDNSNames, and only feeds status with it).
            "numNodes": num_nodes,
            "channel": {
                "resourceClaimTemplate": {"name": names.channel_template_name(name)},
                "allocationMode": "Single",
            },
        },
    }


def pod_channel_template(pod: Mapping[str, Any]) -> str | None:
    """The channel template a worker pod claims, if any."""
    for claim in pod.get("spec", {}).get("resourceClaims") or []:
        if claim.get("name") == CHANNEL_CLAIM:
            template: str | None = claim.get("resourceClaimTemplateName")
            return template
    return None


def nvlink_check(
    deployment: InferenceDeployment,
    *,
    groups: Sequence[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
    served: bool,
) -> tuple[bool, str, str]:
    """The ``MultiNodeNVLink`` condition (ok, reason, message) from the status' ``groups`` and the
    deployment's pods: do the groups spanning trays of one NVLink domain have their IMEX channel?"""
    spanning = [
        group["name"]
        for group in groups
        if spans_trays(pods=[(pod["node"], pod["gpus"]) for pod in group["pods"]], domain=group["domain"])
    ]
    if not spanning:
        return True, "NotNeeded", "no group spans trays of one NVLink domain"
    listed = ", ".join(spanning)
    if deployment.spec.engine.multi_node.compute_domain is ComputeDomainMode.DISABLED:
        return (
            False,
            "Disabled",
            f"spec.engine.multiNode.computeDomain is disabled: {listed} use no NVLink across trays",
        )
    if not served:
        return (
            False,
            "ComputeDomainUnavailable",
            f"the cluster serves no {COMPUTE_DOMAIN_GROUP}/{COMPUTE_DOMAIN_VERSION} ComputeDomain "
            f"(NVIDIA's DRA driver for GPUs): {listed} run without NVLink across trays",
        )
    without = sorted(
        {
            pod["metadata"]["labels"][names.LABEL_GROUP]
            for pod in pods
            if pod["metadata"]["labels"].get(names.LABEL_GROUP) in spanning
            and pod_channel_template(pod) is None
        }
    )
    if without:
        return (
            False,
            "StartedWithoutChannel",
            f"{', '.join(without)} started before ComputeDomains were available; "
            "they get an IMEX channel when next restarted or rolled",
        )
    return True, "ComputeDomainsCreated", f"{listed}: one ComputeDomain each"
