"""Control-plane chaos with real traffic: roll the engine image of a disaggregated deployment while
streams run through its router processes, once undisturbed and once with the operator leader
SIGKILLed mid-roll followed by a node drain under a decode gang.

One local control plane (kwok GB200 trays whose pod CIDRs are loopback ranges), two ``copse
operator run`` processes sharing the leader Lease, and a local kubelet that runs every engine and
router pod as a process on its pod IP (:mod:`copse.cluster.chaos`). Clients keep ``--streams``
completions in flight through the two routers from before the roll to after the drain; samplers
read every router's usable workers and the pods' readiness throughout; the routers count each
prefill/decode pair they use by the revision of both.

Side by side in one run: the roll's time to converge with and without the leader killed (ratio),
and the takeover time against the lease duration.

    nice -n 10 .venv/bin/python benchmarks/operator_chaos.py --streams 200 --lease-duration 6
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

from copse.cluster import ClusterSettings, Kubectl, start_cluster
from copse.cluster.chaos import ChaosSettings, Report, run
from copse.operator.leader import LeaseSettings
from copse.operator.testing import OperatorProcess, wait_for
from copse.topology import fake

REPO = Path(__file__).resolve().parents[1]


def _run(
    kubectl: Kubectl, operators: list[OperatorProcess], settings: ChaosSettings, *, work: Path
) -> Report:
    namespace = settings.name
    kubectl.run("create", "namespace", namespace)
    kubectl.wait("--for=create", "serviceaccount/default", namespace=namespace, timeout=60)
    logs = work / namespace
    logs.mkdir()
    return run(kubectl, namespace=namespace, operators=operators, settings=settings, logs=logs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", type=int, default=2, help="prefill groups (TP4)")
    parser.add_argument("--decode", type=int, default=2, help="decode groups (TP8, two trays each)")
    parser.add_argument("--streams", type=int, default=200, help="streams kept in flight")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per stream")
    parser.add_argument("--lease-duration", type=float, default=6.0)
    parser.add_argument("--seed", type=int, default=0, help="of the prompts")
    parser.add_argument(
        "--keep", type=Path, default=None, help="keep the processes' logs in this new directory"
    )
    args = parser.parse_args()
    base = ChaosSettings(
        prefill=args.prefill,
        decode=args.decode,
        streams=args.streams,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    lease = LeaseSettings(
        namespace="copse-system",
        lease_duration_s=args.lease_duration,
        renew_deadline_s=args.lease_duration * 2 / 3,
        retry_period_s=max(0.5, args.lease_duration / 6),
    )
    with tempfile.TemporaryDirectory(prefix="copse-chaos-") as scratch:
        work = Path(scratch) if args.keep is None else args.keep
        work.mkdir(parents=True, exist_ok=args.keep is None)
        cluster, _ = start_cluster(ClusterSettings(work_dir=work / "cluster"), nodes=fake.cpu_nodes(1))
        kubectl = cluster.kubectl
        operators: list[OperatorProcess] = []
        try:
            kubectl.apply(REPO / "crds", server_side=True)
            kubectl.wait_established("-f", str(REPO / "crds"), timeout=60)
            kubectl.run("create", "namespace", lease.namespace)
            operators = [
                OperatorProcess(
                    log=work / f"op-{i}.log", kubeconfig=cluster.kubeconfig, lease=lease, identity=f"op-{i}"
                )
                for i in range(2)
            ]
            for operator in operators:
                operator.start()
            wait_for("both operators healthy", lambda: all(op.health() for op in operators), timeout_s=120)
            calm = _run(
                kubectl,
                operators,
                dataclasses.replace(base, name="calm", kill_leader=False, drain_node=False),
                work=work,
            )
            chaos = _run(kubectl, operators, dataclasses.replace(base, name="chaos"), work=work)
        finally:
            for operator in operators:
                operator.stop()
            cluster.stop()
    print(
        f"prefill {args.prefill} (TP4) + decode {args.decode} (TP8) groups of mocked engines on kwok, "
        f"maxSurge 1, maxUnavailable 0; {args.streams} streams in flight "
        f"({base.prompt_tokens}-token prompts, "
        f"{args.max_tokens} tokens each, seed {args.seed}) through 2 routers; lease {args.lease_duration:g}s"
    )
    print(
        f"{'run':<24} {'streams':>7} {'failed':>6} {'converge s':>10} {'samples R/P':>11} "
        f"{'min P/D router':>14} {'min P/D pods':>12} {'low R/P':>7} {'no pair':>7} "
        f"{'max groups P/D':>14} {'mixed pairs':>11} {'pairs old/new':>13} {'restarts':>8}"
    )
    for label, report in (("undisturbed roll", calm), ("leader SIGKILL + drain", chaos)):
        c = report.capacity

        def pd(counts: dict[str, int]) -> str:
            return f"{counts.get('prefill')}/{counts.get('decode')}"

        old = report.routes.get((report.old_revision, report.old_revision), 0)
        new = report.routes.get((report.new_revision, report.new_revision), 0)
        print(
            f"{label:<24} {report.streams.started:>7} {len(report.streams.failures):>6} "
            f"{report.converge_s:>10.1f} {f'{c.router_samples}/{c.pod_samples}':>11} "
            f"{pd(c.router_min):>14} {pd(c.pods_min):>12} "
            f"{f'{c.router_below_floor}/{c.pods_below_floor}':>7} {c.no_pair:>7} {pd(c.most_groups):>14} "
            f"{report.mixed_routes:>11.0f} {f'{old:.0f}/{new:.0f}':>13} {report.gang_restarts:>8}"
        )
        for failure in report.streams.failures[:5]:
            print(f"  failed: {failure}")
    print(f"converge ratio (leader killed / undisturbed): {chaos.converge_s / calm.converge_s:.2f}")
    assert chaos.takeover_s is not None
    print(
        f"leader takeover after SIGKILL ({chaos.killed_after_s:.1f}s into the roll): {chaos.takeover_s:.1f}s "
        f"(ratio to the lease duration {chaos.takeover_s / args.lease_duration:.2f})"
    )
    drain = chaos.drain
    print(
        f"drain of {drain['node']} under {drain['group']} ({len(drain['members'])} pods): kubectl drain "
        f"{drain['drain_s']:.1f}s, ok={drain['drain_ok']}, evictions refused by the gang's budget="
        f"{drain['refused_by_budget']}, gang replaced and gone after {drain['moved_s']:.1f}s"
    )


if __name__ == "__main__":
    main()
