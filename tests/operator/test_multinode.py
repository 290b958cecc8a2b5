"""Groups spanning nodes: the ssh Secret, and the rank scripts run for real with stand-ins for
ssh, sshd, mpirun, date and sleep (the scripts are the pods' exact commands)."""

from __future__ import annotations

import logging
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization

from copse.api import Role
from copse.operator import children, multinode, names
from copse.operator.children import GroupLayout

from .conftest import make_deployment
from .test_reconcile import NAMESPACE, Harness

TWO_TRAYS = GroupLayout(
    role=Role.WORKER, replica=0, pods=(("tray-a", 4), ("tray-b", 4)), domain="rack1.0", rack="rack1", cost=0.1
)
OWNER = {"apiVersion": "copse.dev/v1alpha1", "kind": "InferenceDeployment", "name": "llama", "uid": "uid-1"}
SHELLS = [shell for shell in ("dash", "bash") if shutil.which(shell)]

STUBS = {
    # Fails while $STUBS/ssh-failures holds a positive count, then lets every login in.
    "ssh": """#!/bin/sh
echo "$*" >> "$STUBS/ssh.log"
left=$(cat "$STUBS/ssh-failures" 2>/dev/null || echo 0)
if [ "$left" = always ]; then exit 255; fi
if [ "$left" -gt 0 ]; then echo $((left - 1)) > "$STUBS/ssh-failures"; exit 255; fi
""",
    "sshd": '#!/bin/sh\nprintf "%s\\n" "$@" > "$STUBS/sshd.args"\n',
    "mpirun": '#!/bin/sh\nprintf "%s\\n" "$@" > "$STUBS/mpirun.args"\nenv > "$STUBS/mpirun.env"\n',
    # A clock that advances $STUB_TICK seconds per reading.
    "date": """#!/bin/sh
now=$(cat "$STUBS/clock" 2>/dev/null || echo 1000)
echo $((now + ${STUB_TICK:-1})) > "$STUBS/clock"
echo "$now"
""",
    "sleep": "#!/bin/sh\n",
    "id": "#!/bin/sh\necho 1000\n",
}


def pods(**spec: Any) -> list[dict[str, Any]]:
    deployment = make_deployment(replicas=1, **spec)
    return children.worker_pods(deployment, TWO_TRAYS, cold_start_source=None)


def write_keys(directory: Path) -> dict[str, str]:
    secret = multinode.ssh_secret(make_deployment(replicas=1), owner=OWNER)
    directory.mkdir()
    for key, value in secret["stringData"].items():
        (directory / key).write_text(value)
    data: dict[str, str] = secret["stringData"]
    return data


class Rank:
    """One rank's engine container command, run in a scratch directory with stand-in binaries."""

    def __init__(self, pod: dict[str, Any], tmp_path: Path, shell: str) -> None:
        container = pod["spec"]["containers"][0]
        self.command = [shutil.which(shell) or shell, *container["command"][1:]]
        self.stubs = tmp_path / "stubs"
        self.stubs.mkdir(exist_ok=True)
        for name, text in STUBS.items():
            path = self.stubs / name
            path.write_text(text)
            path.chmod(0o755)
        self.ssh_dir = tmp_path / "run-ssh"
        self.keys = write_keys(tmp_path / "keys")
        pod_env = {item["name"]: item["value"] for item in container["env"] if "value" in item}
        self.env = {
            **pod_env,
            "PATH": f"{self.stubs}:/usr/bin:/bin",
            "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
            "STUBS": str(self.stubs),
            "COPSE_SSH_KEYS": str(tmp_path / "keys"),
            "COPSE_SSH_DIR": str(self.ssh_dir),
            # The pod's own runtime sets these; only the families copse forwards may travel.
            "NCCL_DEBUG": "INFO",
            "CUDA_VISIBLE_DEVICES": "0,1,2,3",
        }

    def run(self, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command, env={**self.env, **env}, capture_output=True, text=True, timeout=30, check=False
        )

    def lines(self, name: str) -> list[str]:
        return (self.stubs / name).read_text().splitlines()


def test_ssh_secret_holds_fresh_openssh_keys_owned_by_the_deployment() -> None:
    deployment = make_deployment(replicas=1)
    first = multinode.ssh_secret(deployment, owner=OWNER)
    second = multinode.ssh_secret(deployment, owner=OWNER)
    assert first["metadata"]["name"] == names.ssh_secret_name("llama") == "llama-mpi-ssh"
    assert first["metadata"]["ownerReferences"] == [OWNER]
    data = first["stringData"]
    for key in (multinode.CLIENT_KEY, multinode.HOST_KEY):
        private = serialization.load_ssh_private_key(data[key].encode(), password=None)
        public = private.public_key().public_bytes(
            encoding=serialization.Encoding.OpenSSH, format=serialization.PublicFormat.OpenSSH
        )
        assert data[f"{key}.pub"].split()[:2] == public.decode().split()
        assert data[key] != second["stringData"][key]


def test_group_pods_mount_the_keys_and_followers_are_ready_when_sshd_answers() -> None:
    leader, follower = pods()
    for pod in (leader, follower):
        volumes = {volume["name"]: volume for volume in pod["spec"]["volumes"]}
        assert volumes["mpi-ssh-keys"]["secret"] == {"secretName": "llama-mpi-ssh", "defaultMode": 0o400}
        assert volumes["mpi-ssh"]["emptyDir"]["medium"] == "Memory"
        mounts = {mount["name"]: mount for mount in pod["spec"]["containers"][0]["volumeMounts"]}
        assert mounts["mpi-ssh-keys"] == {
            "name": "mpi-ssh-keys",
            "mountPath": multinode.SSH_KEYS_DIR,
            "readOnly": True,
        }
    probe = follower["spec"]["containers"][0]["readinessProbe"]
    assert probe["tcpSocket"] == {"port": multinode.SSH_PORT}
    assert leader["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/health"


@pytest.mark.parametrize("shell", SHELLS)
def test_follower_serves_ssh_with_the_deployment_keys_and_no_passwords(tmp_path: Path, shell: str) -> None:
    rank = Rank(pods()[1], tmp_path, shell)
    done = rank.run()
    assert done.returncode == 0, done.stderr
    config = rank.ssh_dir / "sshd_config"
    assert rank.lines("sshd.args") == ["-D", "-e", "-f", str(config)]
    settings = dict(line.split(" ", 1) for line in config.read_text().splitlines())
    assert settings["Port"] == str(multinode.SSH_PORT)
    assert settings["PasswordAuthentication"] == "no"
    assert settings["KbdInteractiveAuthentication"] == "no"
    assert settings["HostKey"] == str(rank.ssh_dir / multinode.HOST_KEY)
    assert (rank.ssh_dir / multinode.HOST_KEY).read_text() == rank.keys[multinode.HOST_KEY]
    assert Path(settings["AuthorizedKeysFile"]).read_text() == rank.keys[f"{multinode.CLIENT_KEY}.pub"]
    for private in (multinode.HOST_KEY, multinode.CLIENT_KEY):
        assert stat.S_IMODE((rank.ssh_dir / private).stat().st_mode) == 0o600


@pytest.mark.parametrize("shell", SHELLS)
def test_leader_waits_for_every_follower_then_runs_mpirun_with_the_environment(
    tmp_path: Path, shell: str
) -> None:
    leader = pods(pod={"env": [{"name": "MY_FLAG", "value": "1"}]})[0]
    rank = Rank(leader, tmp_path, shell)
    (rank.stubs / "ssh-failures").write_text("2")
    done = rank.run()
    assert done.returncode == 0, done.stderr
    follower = "llama-worker-0-1.llama-worker-0.serving.svc"
    # Two refusals, then a login: only then does mpirun start.
    assert rank.lines("ssh.log") == [f"-F {rank.ssh_dir}/ssh_config {follower} true"] * 3
    args = rank.lines("mpirun.args")
    launched = leader["spec"]["containers"][0]["command"][4:]
    assert launched[0] == "trtllm-llmapi-launch"
    assert args[-len(launched) :] == launched
    head = args[: -len(launched)]
    assert head[:4] == ["--prefix", str(tmp_path), "--bind-to", "none"]
    assert head[4:8] == ["-np", "8", "-H", f"llama-worker-0-0.llama-worker-0.serving.svc:4,{follower}:4"]
    flags = head[8:]
    assert flags[::2] == ["-x"] * (len(flags) // 2)
    forwarded = set(flags[1::2])
    assert {"PATH", "LD_LIBRARY_PATH", "NCCL_DEBUG", "MY_FLAG"} <= forwarded
    assert not forwarded & {"CUDA_VISIBLE_DEVICES", "COPSE_NODE_RANK", "HOME"}
    env = dict(line.split("=", 1) for line in rank.lines("mpirun.env") if "=" in line)
    assert env["OMPI_MCA_plm_rsh_args"] == env["PRTE_MCA_plm_ssh_args"] == f"-F {rank.ssh_dir}/ssh_config"
    assert env["OMPI_MCA_orte_keep_fqdn_hostnames"] == "1"
    # No prompt and no blind trust: the deployment's host key is pinned for every rank.
    config = (rank.ssh_dir / "ssh_config").read_text()
    assert "StrictHostKeyChecking yes" in config
    assert f"Port {multinode.SSH_PORT}" in config
    host_key = " ".join(rank.keys[f"{multinode.HOST_KEY}.pub"].split()[:2])
    assert (rank.ssh_dir / "known_hosts").read_text() == f"* {host_key}\n"


@pytest.mark.parametrize("shell", SHELLS)
def test_leader_gives_up_when_a_follower_never_answers(tmp_path: Path, shell: str) -> None:
    rank = Rank(pods(engine={"multiNode": {"followerTimeout": "60s"}})[0], tmp_path, shell)
    (rank.stubs / "ssh-failures").write_text("always")
    done = rank.run(STUB_TICK="7")
    assert done.returncode == 1
    assert "llama-worker-0-1.llama-worker-0.serving.svc refused ssh on port 2222 for 60s" in done.stderr
    assert not (rank.stubs / "mpirun.args").exists()
    # Bounded: about timeout / tick attempts, not an endless loop.
    assert 5 <= len(rank.lines("ssh.log")) <= 10


def test_single_node_groups_and_the_mocker_need_no_ssh() -> None:
    deployment = make_deployment(replicas=1)
    one_tray = GroupLayout(role=Role.WORKER, replica=0, pods=(("tray-a", 8),), domain="d", rack="r", cost=0)
    [pod] = children.worker_pods(deployment, one_tray, cold_start_source=None)
    assert "mpi-ssh-keys" not in {volume["name"] for volume in pod["spec"]["volumes"]}
    for pod in pods(engine={"backend": "mock"}):
        env = {item["name"] for item in pod["spec"]["containers"][0]["env"]}
        assert "COPSE_MPI_HOSTS" not in env


# -- the controller against the in-memory cluster ------------------------------------------------

COMPUTE_DOMAINS = (
    multinode.COMPUTE_DOMAIN_GROUP,
    multinode.COMPUTE_DOMAIN_VERSION,
    multinode.COMPUTE_DOMAIN_PLURAL,
)
CRD = {
    "metadata": {"name": multinode.COMPUTE_DOMAIN_CRD},
    "spec": {"versions": [{"name": multinode.COMPUTE_DOMAIN_VERSION, "served": True}]},
}


def nvlink(harness: Harness) -> dict[str, Any]:
    [found] = [c for c in harness.status["conditions"] if c["type"] == multinode.CONDITION]
    return dict(found)


def channels(harness: Harness) -> dict[str, str | None]:
    return {pod["metadata"]["name"]: multinode.pod_channel_template(pod) for pod in harness.pods()}


async def test_without_the_crd_groups_run_and_the_condition_says_no_nvlink(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    harness = Harness(replicas=2)
    await harness.settle()
    assert harness.status["phase"] == "Running"
    assert harness.kube.of_kind("ComputeDomain") == []
    assert set(channels(harness).values()) == {None}
    condition = nvlink(harness)
    assert (condition["status"], condition["reason"]) == ("False", "ComputeDomainUnavailable")
    assert "llama-worker-0, llama-worker-1 run without NVLink across trays" in condition["message"]
    # One ssh Secret for the deployment, created once, owned by it, and never in the logs.
    [secret] = harness.kube.of_kind("Secret")
    assert secret["metadata"]["name"] == "llama-mpi-ssh"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-llama"
    assert [call for call in harness.kube.calls if call[0] == "create Secret"] == [
        ("create Secret", "llama-mpi-ssh")
    ]
    private = secret["stringData"][multinode.CLIENT_KEY]
    assert "created Secret llama-mpi-ssh" in caplog.text
    assert "PRIVATE KEY" not in caplog.text
    assert private not in caplog.text


async def test_a_group_spanning_trays_gets_its_compute_domain_and_each_rank_its_claim() -> None:
    harness = Harness(replicas=2)
    harness.kube.served_apis.add(COMPUTE_DOMAINS)
    await harness.controller.prime()
    await harness.settle()
    assert harness.status["phase"] == "Running"
    domains = {cd["metadata"]["name"]: cd for cd in harness.kube.of_kind("ComputeDomain")}
    assert set(domains) == {"llama-worker-0-imex-0", "llama-worker-1-imex-0"}
    for group in ("llama-worker-0", "llama-worker-1"):
        domain = domains[f"{group}-imex-0"]
        service = harness.kube.objects[("Service", NAMESPACE, group)]
        # Cleaned up with the group: the garbage collector removes it with the group's Service.
        assert domain["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "v1",
                "kind": "Service",
                "name": group,
                "uid": service["metadata"]["uid"],
                "controller": True,
            }
        ]
        assert domain["spec"] == {
            "numNodes": 2,
            "channel": {
                "resourceClaimTemplate": {"name": f"{group}-imex-0-channel"},
                "allocationMode": "Single",
            },
        }
        for rank in (0, 1):
            pod = harness.kube.objects[("Pod", NAMESPACE, f"{group}-{rank}")]
            assert multinode.pod_channel_template(pod) == f"{group}-imex-0-channel"
            [engine] = [c for c in pod["spec"]["containers"] if c["name"] == "engine"]
            assert engine["resources"]["claims"] == [{"name": multinode.CHANNEL_CLAIM}]
    condition = nvlink(harness)
    assert (condition["status"], condition["reason"]) == ("True", "ComputeDomainsCreated")


async def test_the_crd_arriving_later_reaches_groups_at_their_next_restart() -> None:
    harness = Harness(replicas=1)
    await harness.settle()
    harness.controller.on_crd(CRD, deleted=False)
    assert harness.controller.compute_domains_served
    await harness.settle()
    assert nvlink(harness)["reason"] == "StartedWithoutChannel"
    harness.kube.objects[("Pod", NAMESPACE, "llama-worker-0-1")]["status"]["phase"] = "Failed"
    await harness.settle()
    assert [cd["metadata"]["name"] for cd in harness.kube.of_kind("ComputeDomain")] == [
        "llama-worker-0-imex-1"
    ]
    assert set(channels(harness).values()) == {"llama-worker-0-imex-1-channel"}
    assert nvlink(harness)["status"] == "True"
    # A second restart replaces the domain: the old one is deleted, the new one created.
    harness.kube.objects[("Pod", NAMESPACE, "llama-worker-0-0")]["status"]["phase"] = "Failed"
    await harness.settle()
    assert [cd["metadata"]["name"] for cd in harness.kube.of_kind("ComputeDomain")] == [
        "llama-worker-0-imex-2"
    ]
    assert ("ComputeDomain", "llama-worker-0-imex-1", None) in harness.kube.deletions
    harness.controller.on_crd(CRD, deleted=True)
    assert not harness.controller.compute_domains_served


async def test_compute_domains_can_be_switched_off() -> None:
    harness = Harness(replicas=1, engine={"multiNode": {"computeDomain": "disabled"}})
    harness.kube.served_apis.add(COMPUTE_DOMAINS)
    await harness.controller.prime()
    await harness.settle()
    assert harness.kube.of_kind("ComputeDomain") == []
    assert (nvlink(harness)["status"], nvlink(harness)["reason"]) == ("False", "Disabled")


async def test_groups_on_one_tray_need_no_compute_domain() -> None:
    harness = Harness(replicas=1, model={"name": "m", "tensorParallelism": 4})
    harness.kube.served_apis.add(COMPUTE_DOMAINS)
    await harness.controller.prime()
    await harness.settle()
    assert harness.kube.of_kind("ComputeDomain") == []
    assert harness.kube.of_kind("Secret") == []
    assert (nvlink(harness)["status"], nvlink(harness)["reason"]) == ("True", "NotNeeded")
