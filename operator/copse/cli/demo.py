"""``copse demo``: the whole system on this machine, end to end, in a few minutes.

Every step runs a real ``copse``/``kubectl`` command as its own process, so the demo
exercises exactly what a user would type and imports none of the components itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from copse.cluster.kubectl import Kubectl, KubectlError

REPO = Path(__file__).resolve().parents[3]
NAMESPACE = "copse-demo"
TRACE = REPO / "examples" / "traces" / "mooncake-conversation-first-20min.jsonl.gz"
SEED = REPO / "examples" / "seed-inferencedeployment.yaml"
DISAGGREGATED = REPO / "examples" / "deployment-disaggregated.yaml"
PLANNER = REPO / "examples" / "planner"


class DemoError(click.ClickException):
    pass


def _copse(*args: str) -> list[str]:
    return [sys.executable, "-m", "copse.cli", *args]


def _step(title: str) -> None:
    click.secho(f"\n==> {title}", bold=True, err=True)


def _run(
    argv: Sequence[str], *, env: dict[str, str], capture: bool = False, stdout: int | None = None
) -> str:
    """Run ``argv``; ``capture``: return its stdout (stderr kept for the error), else let both
    through (``stdout``: where stdout goes instead, e.g. ``subprocess.DEVNULL``)."""
    if capture:
        completed = subprocess.run(argv, env=env, text=True, capture_output=True, check=False)
    else:
        completed = subprocess.run(argv, env=env, text=True, stdout=stdout, check=False)
    if completed.returncode != 0:
        detail = (completed.stderr or "").strip()[-2000:] if capture else "(see the output above)"
        raise DemoError(f"`{' '.join(argv)}` exited {completed.returncode}: {detail}")
    return completed.stdout if capture else ""


def _cluster_env() -> tuple[dict[str, str], str]:
    """Bring the local control plane up (building it once) and return its env and kubectl.

    The build runs first as its own step, its stderr on the terminal: a cold cache takes 8-30
    minutes, and ``copse cluster build`` reports each component (cached, building, done in) and a
    heartbeat while one compiles; ``copse cluster up``, whose output is read here, then finds it
    all cached."""
    env = dict(os.environ)
    _run(_copse("cluster", "build"), env=env, stdout=subprocess.DEVNULL)
    printed = _run(_copse("cluster", "up"), env=env, capture=True)
    for line in printed.splitlines():
        if line.startswith("export KUBECONFIG="):
            env["KUBECONFIG"] = line.removeprefix("export KUBECONFIG=")
        elif line.startswith("export PATH="):
            env["PATH"] = line.removeprefix("export PATH=").split(":", 1)[0] + os.pathsep + env["PATH"]
    kubectl = shutil.which("kubectl", path=env["PATH"])
    if "KUBECONFIG" not in env or kubectl is None:
        raise DemoError(f"`copse cluster up` did not say where its kubeconfig and kubectl are:\n{printed}")
    return env, kubectl


POLICIES = ("kv", "round_robin")


def _compare(runs: dict[str, tuple[str, ...]], *, env: dict[str, str]) -> None:
    """Replay the same slice with each policy in each run (label: ``copse bench replay`` options)
    and print TTFT/ITL/hit rate side by side."""
    reports: dict[str, dict[str, Any]] = {}
    for label, options in runs.items():
        for policy in POLICIES:
            printed = _run(
                _copse("bench", "replay", "--trace", str(TRACE), "--policy", policy, "-o", "json", *options),
                env=env,
                capture=True,
            )
            reports[f"{policy} {label}".strip()] = json.loads(printed)
    names = list(reports)
    width = max(14, *(len(name) + 2 for name in names))
    click.echo(f"{'':<22}" + "".join(f"{name:>{width}}" for name in names))
    for title, key, pick in (
        ("TTFT p50 (ms)", "ttft_ms", "p50"),
        ("TTFT p90 (ms)", "ttft_ms", "p90"),
        ("TTFT p99 (ms)", "ttft_ms", "p99"),
        ("ITL p50 (ms)", "itl_ms", "p50"),
        ("end-to-end p50 (ms)", "e2e_ms", "p50"),
    ):
        click.echo(f"{title:<22}" + "".join(f"{reports[n][key][pick]:>{width},.1f}" for n in names))
    click.echo(
        f"{'KV cache hit rate':<22}" + "".join(f"{reports[n]['cache_hit_rate']:>{width}.1%}" for n in names)
    )
    lags = {name: report["engine_lag_ms"] for name, report in reports.items() if "engine_lag_ms" in report}
    if lags:
        click.echo(
            "engine process lag behind the simulated engines (mean per step): "
            + ", ".join(f"{name} {lag:.1f} ms" for name, lag in lags.items())
            + " (tokens reach clients this much late; a loaded machine shows here)"
        )


def _missing_inputs() -> list[Path]:
    """The files the demo reads that are not there (all ship in the repository's ``examples/``)."""
    wanted = (
        TRACE,
        SEED,
        DISAGGREGATED,
        PLANNER / "servegen-m-large-3d.jsonl",
        PLANNER / "servegen-m-large-burst.jsonl",
        PLANNER / "mock-profile.npz",
    )
    return [path for path in wanted if not path.is_file()]


@click.command()
@click.option(
    "--requests",
    type=click.IntRange(min=1),
    default=600,
    show_default=True,
    help="Mooncake requests replayed per policy.",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Mocked engines behind the router.",
)
@click.option(
    "--speedup",
    type=click.FloatRange(min=0, min_open=True),
    default=3.0,
    show_default=True,
    help="Replay the trace this much faster than real time.",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=Path("out/demo"),
    show_default=True,
    help="Where the operator log and the planner plot go.",
)
def demo(*, requests: int, workers: int, speedup: float, out: Path) -> None:
    """Local cluster with fake NVL72 racks, the operator, placement, KV-aware routing, the planner.

    \b
    Examples:
      copse demo
      copse demo --requests 300 --workers 4 --out out/demo
    """
    missing = _missing_inputs()
    if missing:  # before anything starts: the cluster and the operator take a minute
        raise DemoError(
            "the demo reads files that are not there: "
            + ", ".join(str(path) for path in missing)
            + f" (they ship in {REPO / 'examples'}: is this a whole checkout of the repository?)"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise click.BadParameter(
            f"cannot create directory {out}: {exc.strerror}", param_hint="--out"
        ) from exc
    started = time.monotonic()

    _step(
        "local Kubernetes control plane with fake GB200 NVL72 racks (the first run builds it from Go: "
        "8-30 minutes, progress below)"
    )
    env, kubectl = _cluster_env()
    _run([kubectl, "apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds")], env=env)
    try:
        Kubectl(executable=Path(kubectl), kubeconfig=Path(env["KUBECONFIG"])).wait_established(
            "-f", str(REPO / "crds"), timeout=60
        )
    except KubectlError as exc:
        raise DemoError(str(exc)) from exc

    _step("the operator, placing the design documents' deployment and a disaggregated one")
    log_path = out / "operator.log"
    with log_path.open("w") as log:
        operator = subprocess.Popen(
            _copse("operator", "run", "--metrics-port", "0", "--health-port", "0"),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        namespace = subprocess.run(
            [kubectl, "create", "namespace", NAMESPACE], env=env, capture_output=True, text=True, check=False
        )
        if namespace.returncode != 0 and "AlreadyExists" not in namespace.stderr:
            raise DemoError(f"cannot create namespace {NAMESPACE}: {namespace.stderr.strip()}")
        for manifest in (SEED, DISAGGREGATED):
            _run([kubectl, "apply", "-n", NAMESPACE, "-f", str(manifest)], env=env)
        for name in ("llama-70b-serving", "llama-70b-disagg"):
            try:
                _run(
                    [kubectl, "wait", "-n", NAMESPACE, "--for=jsonpath={.status.phase}=Running",
                     f"idep/{name}", "--timeout=180s"],
                    env=env,
                )  # fmt: skip
            except DemoError as error:
                raise DemoError(f"{error}\n--- operator log: {log_path}") from error
        click.echo(_run([kubectl, "get", "idep", "-n", NAMESPACE, "-o", "wide"], env=env, capture=True))
        columns = (
            "POD:.metadata.name,ROLE:.metadata.labels.copse\\.dev/role,NODE:.spec.nodeName,"
            "GPUS:.spec.containers[0].resources.limits.nvidia\\.com/gpu,PHASE:.status.phase"
        )
        selector = "app.kubernetes.io/component=worker"
        pods = [kubectl, "get", "pods", "-n", NAMESPACE, "-l", selector, "-o", f"custom-columns={columns}"]
        click.echo(_run(pods, env=env, capture=True))
        groups = json.loads(
            _run([kubectl, "get", "idep", "-n", NAMESPACE, "-o", "json"], env=env, capture=True)
        )["items"]
        for item in groups:
            for group in item["status"]["groups"]:
                click.echo(
                    f"  {group['name']:<28} domain {group['domain'] or '(several)'}  rack {group['rack']}"
                    f"  cost {group['cost']} us"
                )
    finally:
        operator.terminate()
        operator.wait(timeout=30)

    _step(
        f"router + {workers} mocked engines + NATS, live: {requests} Mooncake requests at {speedup:g}x "
        "their rate, KV-aware vs round-robin, next to the same replay on the virtual clock"
    )
    same = ("--workers", str(workers), "--limit", str(requests), "--speedup", str(speedup))
    _compare({"live": (*same, "--live"), "virtual": same}, env=env)
    _step(
        "a longer comparison on the virtual clock (deterministic): 3,000 requests, 16 engines, "
        "6x the trace's rate"
    )
    _compare({"": ("--workers", "16", "--limit", "3000", "--speedup", "6")}, env=env)

    _step("the SLA planner, dry-run on three days of ServeGen's m-large load (examples/planner)")
    plot = out / "planner.png"
    printed = _run(
        _copse(
            "planner", "dry-run",
            "--metrics", str(PLANNER / "servegen-m-large-3d.jsonl"),
            "--perf-profile", str(PLANNER / "mock-profile.npz"),
            "--ttft-ms", "500",
            "--itl-ms", "50",
            "--max-replicas", "64",
            "--plot", str(plot),
            "-o", "json",
        ),
        env=env,
        capture=True,
    )  # fmt: skip
    summary = json.loads(printed)["summary"]
    click.echo(
        f"estimated (analytic) SLO attainment {summary['slo_attainment']:.1%} of requests; "
        f"{summary['gpu_hours']:.1f} GPU-hours planned vs {summary['static_peak_gpu_hours']:.1f} "
        f"for a static deployment sized for the peak; {summary['scaling_events']} scaling events; plot {plot}"
    )

    _step(
        "the SLA planner in closed loop (the twin): the first hour of the four-hour burst "
        "(examples/planner), 3 req/s at its peak, every request routed and served by mocked engines"
    )
    printed = _run(
        _copse(
            "bench", "planner",
            "--metrics", str(PLANNER / "servegen-m-large-burst.jsonl"),
            "--shapes", str(TRACE),
            "--max-isl", "32768",
            "--hours", "1",
            "--peak-rate", "3",
            "--warmup", "900",
            "--startup-delay", "120",
            "--ttft-ms", "2000",
            "--itl-ms", "50",
            "--no-frontier",
            "-o", "json",
        ),
        env=env,
        capture=True,
    )  # fmt: skip
    twin = json.loads(printed)
    click.echo(
        f"closed loop (simulated, every request): {twin['slo_attainment']:.1%} of requests within SLO, "
        f"{twin['gpu_hours']:.2f} GPU-hours (mean {twin['mean_replicas']:.2f}, peak {twin['peak_replicas']} "
        f"replicas), {twin['scaling_events']} scaling events; the estimate above is analytic, this is "
        "measured (without --no-frontier, copse bench planner also runs the static fleets on the same "
        "arrivals)"
    )

    _step(f"done in {time.monotonic() - started:.0f}s")
    click.echo(
        f"The cluster keeps running: KUBECONFIG={env['KUBECONFIG']} kubectl get idep -n {NAMESPACE}\n"
        f"Operator log: {log_path}   Planner plot: {plot}\n"
        "Tear down with `make cluster-down` (stops the control plane started by `copse cluster up`)."
    )
