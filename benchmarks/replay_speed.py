"""On-CPU and wall time of ``copse bench replay`` over a whole trace (or, with ``--twin LOAD``, of
``copse bench planner``'s closed-loop twin over a slice of a named load), for one or more source
trees run alternately, and whether their JSON reports are byte-identical.

Each tree is a checkout of this repository (``git archive <commit> | tar -x -C DIR`` for an old
commit; a tree whose router needs its compiled module must have it built, as ``make venv`` does
for the working tree: ``.venv/bin/python setup.py build_ext --inplace`` in the tree) run with
``PYTHONPATH=<tree>/{operator,planner,router,workers,sim}`` by this venv's Python (``sim`` when
the tree has it: older trees kept the twin in ``router``). On-CPU = user + sys of the replay
process (``RUSAGE_CHILDREN``), so time spent waiting for a core shared with other processes is
left out; wall = ``time.perf_counter``. The
trees run in turn, round after round, so that a change in the machine's load hits all of them.
``--instructions`` also counts each tree's instructions once under ``valgrind --tool=cachegrind``
(about 50x slower, but independent of the load). ``--shares`` also runs each tree's ``replay()``
once in a process that times (``time.thread_time``) the router's calls (``Router.submit``,
``prefill_done``, ``finish``, ``RadixIndexer.apply_events``), token synthesis, prompt hashing,
and the simulator's calls less the router calls made from them (= the mocked engines).

    .venv/bin/python benchmarks/replay_speed.py [--tree NAME=DIR ...] [--rounds 3] [--policy kv]
        [--speedup 6] [--workers 16] [--limit N] [--trace PATH] [--instructions] [--shares]
    .venv/bin/python benchmarks/replay_speed.py --twin burst-4h [--hours 1] [--static 6 | --delay 420]
        [--tree NAME=DIR ...] [--rounds 3]

With ``--twin`` the figure of merit is requests simulated per on-CPU second (every request of the
slice, warm-up included): a static fleet (``--static N``) or the default planner (``--delay S``, its
start-up delay), TTFT 2,000 ms, ITL 50 ms, seed 0, the named load's traces from ../shared/traces.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import inputs

REPO = Path(__file__).resolve().parents[1]
TRACE = inputs.CONVERSATION
ROOTS = ("operator", "planner", "router", "workers")
OPTIONAL_ROOTS = ("sim",)
#: Run in each tree's process for --shares: argv = trace, workers, policy, speedup, limit ("" = all).
SHARES = """
import collections, sys, time
try:
    from copse.sim import replay as R
except ImportError:  # trees from before the sim/ source root
    from copse.router import replay as R
from copse.router.core import Router
from copse.router.indexer import RadixIndexer
try:
    from copse.sim.trace import TokenSynth, load_trace
except ImportError:
    from copse.router.trace import TokenSynth, load_trace
from copse.workers.mocker import Simulator
clock, spent, depth = time.thread_time, collections.Counter(), collections.Counter()
def timed(owner, name, key):
    call = getattr(owner, name)
    def wrapper(*args, **kwargs):
        if depth[key]:  # counted by the outer call already
            return call(*args, **kwargs)
        start = clock()
        depth[key] += 1
        try:
            return call(*args, **kwargs)
        finally:
            depth[key] -= 1
            took = clock() - start
            spent[key] += took
            if key == "router" and depth["simulator"]:
                spent["router inside simulator"] += took
    setattr(owner, name, wrapper)
for name in ("submit", "prefill_done", "finish"):
    timed(Router, name, "router")
timed(RadixIndexer, "apply_events", "router")
timed(TokenSynth, "tokens", "token synthesis")
for name in ("hash_blocks", "tokens_hashes", "chain_hashes"):  # what the tree's replay module hashes with
    if hasattr(R, name):
        timed(R, name, "prompt hashing")
for name in ("run_until", "submit", "run"):
    timed(Simulator, name, "simulator")
trace = load_trace(sys.argv[1])[: int(sys.argv[5]) if sys.argv[5] else None]
settings = R.ReplaySettings(policy=sys.argv[3], workers=int(sys.argv[2]), speedup=float(sys.argv[4]), seed=0)
start = clock()
R.replay(trace, settings)
total = clock() - start
engines = spent["simulator"] - spent["router inside simulator"]
rest = total - engines - spent["router"] - spent["token synthesis"] - spent["prompt hashing"]
parts = {"engines": engines, "router": spent["router"], "token synthesis": spent["token synthesis"]}
parts |= {"prompt hashing": spent["prompt hashing"], "replay loop": rest, "replay()": total}
for key, value in parts.items():
    print(f"{key}\t{value:.3f}")
"""
VALGRIND = ("valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null")
CLI = "import sys; from copse.cli import main; sys.argv[0] = 'copse'; sys.exit(main())"


@dataclass
class Tree:
    name: str
    path: Path
    cpu_s: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    reports: set[bytes] = field(default_factory=set)
    instructions: int | None = None
    shares: dict[str, float] = field(default_factory=dict)


def _env(tree: Tree) -> dict[str, str]:
    roots = [*ROOTS, *(root for root in OPTIONAL_ROOTS if (tree.path / root / "copse").is_dir())]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(str(tree.path / root) for root in roots)}


def _twin_args(args: argparse.Namespace) -> list[str]:
    command = ["bench", "planner", "--load", args.twin, "--traces", str(inputs.WHOLE), "--seed", "0"]
    command += ["--hours", str(args.hours), "--ttft-ms", "2000", "--itl-ms", "50", "--max-replicas", "24"]
    if args.static is not None:
        return [*command, "--static", str(args.static), "-o", "json"]
    return [*command, "--startup-delay", str(args.delay), "--no-frontier", "-o", "json"]


def _replay_args(args: argparse.Namespace) -> list[str]:
    if args.twin is not None:
        return _twin_args(args)
    command = ["bench", "replay", "--trace", str(args.trace), "--workers", str(args.workers)]
    # --json, not -o json: the trees compared include ones from before -o (the new tree warns).
    command += ["--policy", args.policy, "--speedup", str(args.speedup), "--seed", "0", "--json"]
    if args.limit is not None:
        command += ["--limit", str(args.limit)]
    return command


def _run(tree: Tree, args: argparse.Namespace) -> None:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", CLI, *_replay_args(args)],
        env=_env(tree),
        capture_output=True,
        check=True,
        cwd="/",  # nothing of the current directory on the path
    )
    tree.wall_s.append(time.perf_counter() - started)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    tree.cpu_s.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    tree.reports.add(done.stdout)


def _count_instructions(tree: Tree, args: argparse.Namespace) -> None:
    done = subprocess.run(
        [*VALGRIND, sys.executable, "-c", CLI, *_replay_args(args)],
        env=_env(tree),
        capture_output=True,
        check=True,
        text=True,
        cwd="/",
    )
    match = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    if match is None:
        raise SystemExit(f"no instruction count in valgrind's output for {tree.name}:\n{done.stderr}")
    tree.instructions = int(match.group(1).replace(",", ""))


def _measure_shares(tree: Tree, args: argparse.Namespace) -> None:
    limit = "" if args.limit is None else str(args.limit)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            SHARES,
            str(args.trace),
            str(args.workers),
            args.policy,
            str(args.speedup),
            limit,
        ],
        env=_env(tree),
        capture_output=True,
        check=True,
        text=True,
        cwd="/",
    )
    for line in done.stdout.splitlines():
        key, value = line.split("\t")
        tree.shares[key] = float(value)


def _tree(spec: str) -> Tree:
    name, sep, path = spec.partition("=")
    root = Path(path)
    if not sep or not name or not all((root / r / "copse").is_dir() for r in ROOTS):
        raise argparse.ArgumentTypeError(f"--tree {spec!r}: expected NAME=DIR, DIR a checkout of copse")
    return Tree(name=name, path=root)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tree", type=_tree, action="append", help="NAME=DIR (repeatable; default: this tree)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--policy", default="kv")
    parser.add_argument("--speedup", type=float, default=6.0)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--instructions", action="store_true", help="also count instructions (valgrind)")
    parser.add_argument("--shares", action="store_true", help="also time the parts of one replay per tree")
    parser.add_argument("--twin", metavar="LOAD", help="time the closed-loop twin on this named load instead")
    parser.add_argument("--hours", type=float, default=1.0, help="--twin: the first hours of the load")
    parser.add_argument("--static", type=int, help="--twin: a static fleet of this many replicas")
    parser.add_argument("--delay", type=float, default=420.0, help="--twin: the planner's start-up delay, s")
    args = parser.parse_args()
    requests = None
    if args.twin is not None:
        if args.shares:
            parser.error("--shares times replays, not the twin")
        from copse.sim.load import build_load  # noqa: PLC0415

        requests = len(build_load(args.twin, seed=0, traces=inputs.WHOLE, hours=args.hours).requests)
        print(f"{args.twin}, first {args.hours:g} h: {requests:,} requests")
    else:
        inputs.require(args.trace)
    trees: list[Tree] = args.tree or [Tree(name="this tree", path=REPO)]
    for round_ in range(args.rounds):
        # alternate the order too, so that no tree always runs first in a round
        for tree in trees if round_ % 2 == 0 else trees[::-1]:
            _run(tree, args)
            print(
                f"round {round_ + 1}: {tree.name}: {tree.cpu_s[-1]:.2f} s on-CPU,"
                f" {tree.wall_s[-1]:.2f} s wall"
            )
    if args.instructions:
        for tree in trees:
            _count_instructions(tree, args)
    if args.shares:
        for tree in trees:
            _measure_shares(tree, args)
    base = trees[0]
    print(f"\n{'tree':<24}{'on-CPU median':>15}{'min':>8}{'wall median':>13}{'min':>8}{'speed-up':>10}")
    for tree in trees:
        ratio = statistics.median(base.cpu_s) / statistics.median(tree.cpu_s)
        rate = "" if requests is None else f"{requests / statistics.median(tree.cpu_s):>10,.0f} req/CPU-s"
        print(
            f"{tree.name:<24}{statistics.median(tree.cpu_s):>14.2f}s{min(tree.cpu_s):>7.2f}s"
            f"{statistics.median(tree.wall_s):>12.2f}s{min(tree.wall_s):>7.2f}s{ratio:>9.2f}x{rate}"
        )
    if args.instructions:
        assert base.instructions is not None
        for tree in trees:
            assert tree.instructions is not None
            print(
                f"{tree.name:<24}{tree.instructions / 1e9:>8.2f} G instructions"
                f" ({base.instructions / tree.instructions:.2f}x fewer than the first)"
            )
    if args.shares:
        print("\non-CPU seconds inside replay() (share of replay())")
        for tree in trees:
            total = tree.shares["replay()"]
            parts = ", ".join(
                f"{k} {v:.2f} ({v / total:.0%})" for k, v in tree.shares.items() if k != "replay()"
            )
            print(f"{tree.name}: {total:.2f} s: {parts}")
    reports = {report for tree in trees for report in tree.reports}
    print(f"identical JSON reports across trees and rounds: {len(reports) == 1}")


if __name__ == "__main__":
    main()
