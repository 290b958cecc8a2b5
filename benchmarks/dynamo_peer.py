"""A peer in the same run: NVIDIA Dynamo's own KV router and mocker (``ai-dynamo`` 1.6.1 from PyPI)
replay the same Mooncake trace as copse's ``kv`` policy in front of copse's mocked engines, with the
same fleet; both also replay it round-robin, which shows how far apart the two engine models are.

Dynamo runs in its own virtualenv under the cache (``$COPSE_CACHE_DIR``, default ``~/.cache/copse``,
then ``dynamo-peer/venv``), created on first use: ``pip install --no-deps ai-dynamo==1.6.1
ai-dynamo-runtime==1.6.1`` plus the few modules its replay imports (pydantic within the runtime's
bounds, uvloop, msgspec, pyzmq, prometheus-client). It is never part of ``make test``. Its offline
replay (``dynamo.replay.run_trace_replay``) is a discrete-event simulation of its mocker engines
behind its KV router (or round-robin), needing no NATS or etcd.

Matched: worker count (``--workers``), KV capacity (``--blocks`` blocks of ``--block-size`` tokens:
Dynamo's ``num_gpu_blocks`` / ``block_size``, copse's ``EngineConfig.num_blocks`` / ``block_size``;
512 = one trace hash id per block, so both hash the trace's blocks alike), step budget 8,192 tokens
and 256 sequences, chunked prefill and prefix caching on (both defaults), engine speed 1 (no
speedup), arrival speedup (``--speedup``), and KV events reaching the router ``--kv-event-lag-ms``
late in both (Dynamo's ``kv_event_lag_ms``, copse's ``--kv-event-lag-ms``). Both engines time steps
with the same polynomial constants (Dynamo's mocker default, which copse's default model copies)
but apply them differently (see RESULTS). copse's engines run without step-time noise (Dynamo's
have none) and copse's router predicts with the profile it measures from its engines
(``copse bench replay``'s default), not their exact model; Dynamo's router needs no perf model.
Dynamo picks randomly among equal-cost workers even at temperature 0, so its ``kv_router`` replay
runs ``--dynamo-repeats`` times.

Columns: TTFT mean/p50/p90/p99 ms; TPOT p50 = the median of each request's mean gap between output
tokens (Dynamo's ``median_tpot_ms``, copse's ITL p50: the same definition); e2e p50 ms; hit = prompt
tokens found in the prefix cache at a request's first admission / all prompt tokens (Dynamo's
``first_admission_prefix_cache_reused_ratio``, copse's cache hit rate); hit / bound = that share of
the trace's offline bound (one infinite cache); rr / kv = the same system's round-robin TTFT over its
KV router's (>1: KV-aware routing helps).

Usage: ``.venv/bin/python benchmarks/dynamo_peer.py [--requests 12031] [--workers 16] [--speedup 6]
[--blocks 2048] [--block-size 512] [--kv-event-lag-ms 50] [--dynamo-repeats 3] [--json FILE]``
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import inputs
from copse.sim.replay import EngineSetup, ReplaySettings, replay
from copse.sim.trace import load_trace, offline_bound
from copse.workers.mocker import EngineConfig

TRACE = inputs.CONVERSATION
DYNAMO_VERSION = "1.6.1"
DYNAMO_PACKAGES = (
    f"ai-dynamo=={DYNAMO_VERSION}",
    f"ai-dynamo-runtime=={DYNAMO_VERSION}",
)
# What dynamo.replay imports, within ai-dynamo-runtime 1.6.1's declared bounds (pydantic<=2.13.5).
DYNAMO_DEPENDENCIES = ("pydantic>=2.10.6,<=2.13.5", "uvloop", "msgspec", "pyzmq", "prometheus-client")

_DYNAMO_RUN = """
import json, sys
from dynamo.replay import run_trace_replay
args = json.loads(sys.argv[1])
started = __import__("time").perf_counter()
report = run_trace_replay(
    [args["trace"]],
    num_workers=args["workers"],
    router_mode=args["router_mode"],
    trace_block_size=args["trace_block_size"],
    arrival_speedup_ratio=args["speedup"],
    kv_event_lag_ms=args["kv_event_lag_ms"] or None,
    extra_engine_args={"engine": {"num_gpu_blocks": args["blocks"], "block_size": args["block_size"]}},
)
summary = dict(report.summary)
summary["outer_wall_s"] = __import__("time").perf_counter() - started
print(json.dumps(summary))
"""


def cache_dir() -> Path:
    return Path(os.environ.get("COPSE_CACHE_DIR", Path.home() / ".cache" / "copse")) / "dynamo-peer"


def dynamo_python() -> Path:
    """The peer's interpreter, installing Dynamo into its own venv on first use."""
    venv = cache_dir() / "venv"
    python = venv / "bin" / "python"
    stamp = venv / f".installed-{DYNAMO_VERSION}"
    if stamp.exists():
        return python
    print(f"installing ai-dynamo {DYNAMO_VERSION} into {venv} (once)", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "--no-deps", *DYNAMO_PACKAGES], check=True)
    subprocess.run([*pip, *DYNAMO_DEPENDENCIES], check=True)
    stamp.touch()
    return python


def dynamo_versions(python: Path) -> str:
    code = (
        "import importlib.metadata as m; print(', '.join(f'{p} {m.version(p)}' for p in "
        "('ai-dynamo', 'ai-dynamo-runtime', 'pydantic', 'uvloop', 'msgspec', 'pyzmq', 'prometheus-client')))"
    )
    return subprocess.run(
        [str(python), "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()


def run_dynamo(
    python: Path, trace_file: Path, *, router_mode: str, args: argparse.Namespace
) -> dict[str, Any]:
    payload = {
        "trace": str(trace_file),
        "workers": args.workers,
        "router_mode": router_mode,
        "trace_block_size": 512,
        "speedup": args.speedup,
        # Dynamo accepts an event lag only with its KV router (round-robin reads no events).
        "kv_event_lag_ms": args.kv_event_lag_ms if router_mode == "kv_router" else 0,
        "blocks": args.blocks,
        "block_size": args.block_size,
    }
    env = {**os.environ, "DYN_LOG": "warn"}
    done = subprocess.run(
        [str(python), "-c", _DYNAMO_RUN, json.dumps(payload)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"Dynamo's replay ({router_mode}) failed:\n{done.stderr[-3000:]}")
    summary: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        "ttft": [summary[k] for k in ("mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms")],
        "tpot_p50": summary["median_tpot_ms"],
        "e2e_p50": summary["median_e2e_latency_ms"],
        "hit": summary["first_admission_prefix_cache_reused_ratio"],
        "completed": summary["completed_requests"],
        "wall_s": summary["outer_wall_s"],
    }


def run_copse(trace: list[Any], *, policy: str, args: argparse.Namespace) -> dict[str, Any]:
    settings = ReplaySettings(
        policy=policy,
        workers=args.workers,
        speedup=args.speedup,
        engines=EngineSetup(
            config=EngineConfig(block_size=args.block_size, num_blocks=args.blocks), block_size_set=True
        ),
        engine_noise=0.0,
        kv_event_lag_ms=args.kv_event_lag_ms,
    )
    started = time.perf_counter()
    report = replay(trace, settings)
    ttft = report.ttft_ms
    return {
        "ttft": [ttft.mean, ttft.p50, ttft.p90, ttft.p99],
        "tpot_p50": report.itl_ms.p50,
        "e2e_p50": report.e2e_ms.p50,
        "hit": report.cache_hit_rate,
        "completed": report.requests,
        "wall_s": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--requests", type=int, default=None, help="Replay only the first N requests.")
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--speedup", type=float, default=6.0)
    parser.add_argument("--blocks", type=int, default=2048, help="KV blocks per engine.")
    parser.add_argument("--block-size", type=int, default=512, help="Tokens per KV block (divides 512).")
    parser.add_argument("--kv-event-lag-ms", type=float, default=50.0)
    parser.add_argument("--dynamo-repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="Also write every row here.")
    args = parser.parse_args()
    inputs.require(args.trace)
    if 512 % args.block_size:
        parser.error("--block-size must divide the trace's 512-token blocks")

    python = dynamo_python()
    trace = load_trace(args.trace)[: args.requests]
    trace_file = cache_dir() / f"{args.trace.name.removesuffix('.gz')}.first{len(trace)}"
    if not trace_file.exists():
        opener = gzip.open if args.trace.suffix == ".gz" else open
        with opener(args.trace, "rt") as source, trace_file.open("w") as out:
            for _, line in zip(range(len(trace)), source, strict=False):
                out.write(line)
    _, bound = offline_bound(trace, trace_block_size=512)
    print(f"Dynamo: {dynamo_versions(python)}")
    print(
        f"{args.trace.name}: first {len(trace)} requests at {args.speedup:g}x, {args.workers} workers x "
        f"{args.blocks} blocks of {args.block_size} tokens, KV events {args.kv_event_lag_ms:g} ms late; "
        f"offline bound {bound:.1%} of prompt tokens; load average {os.getloadavg()[0]:.1f}"
    )
    rows: list[tuple[str, str, dict[str, Any]]] = []
    for repeat in range(args.dynamo_repeats):
        rows.append(
            (
                "dynamo",
                f"kv_router #{repeat + 1}",
                run_dynamo(python, trace_file, router_mode="kv_router", args=args),
            )
        )
    rows.append(
        ("dynamo", "round_robin", run_dynamo(python, trace_file, router_mode="round_robin", args=args))
    )
    for policy in ("kv", "dynamo", "round_robin"):
        rows.append(("copse", policy, run_copse(trace, policy=policy, args=args)))

    rr_p50 = {system: row["ttft"][1] for system, policy, row in rows if policy == "round_robin"}
    rr_p99 = {system: row["ttft"][3] for system, policy, row in rows if policy == "round_robin"}
    print(
        f"{'system':<7}{'router':<15}{'TTFT mean':>10}{'p50':>8}{'p90':>8}{'p99':>8}{'TPOT p50':>9}"
        f"{'e2e p50':>9}{'hit':>7}{'/bound':>7}{'rr/p50':>7}{'rr/p99':>7}{'done':>7}{'wall s':>7}"
    )
    for system, policy, row in rows:
        mean, p50, p90, p99 = row["ttft"]
        print(
            f"{system:<7}{policy:<15}{mean:>10,.0f}{p50:>8,.0f}{p90:>8,.0f}{p99:>8,.0f}{row['tpot_p50']:>9.1f}"
            f"{row['e2e_p50']:>9,.0f}{row['hit']:>7.1%}{row['hit'] / bound:>7.2f}"
            f"{rr_p50[system] / p50:>7.2f}{rr_p99[system] / p99:>7.2f}"
            f"{row['completed']:>7}{row['wall_s']:>7.0f}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps([{"system": s, "router": p, **r} for s, p, r in rows], indent=1))


if __name__ == "__main__":
    main()
