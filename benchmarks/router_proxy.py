"""What the router's HTTP proxy costs a client: the same streamed completions sent straight to the
mocked engines and through ``copse router run``, alternately, in one run.

Engines: ``copse worker mock`` (one process, ``--engines`` engines on loopback, decode slowed by
``--decode-speedup`` so that a stream's tokens come at the pace of a loaded GPU engine). Router:
``copse router run`` as its own process in front of them (static workers, ``round_robin``, no NATS),
so what the direct client does (round-robin over the engines) and what the router does pick the
same spread of load and only the proxy hop differs. Client: this process, ``--concurrency`` streams
in a closed loop (each sends its next request when the last one ended), every prompt distinct
(``--prompt-tokens`` random token ids), ``--max-tokens`` each; it reads the SSE lines and parses
nothing but the first one's arrival.

Per concurrency and path: TTFT and end-to-end latency (p50, p99) as the client sees them; the
router's added TTFT p50 (ms) and its end-to-end p50 as a ratio of the direct one; the router
process's CPU seconds and the streamed tokens/s per router core (tokens relayed / router CPU s).
Rounds alternate direct, router, direct, router... so both see the same machine load.

``--router-tree NAME=DIR`` (repeatable) also runs the router of another checkout of copse (e.g.
``git archive <commit> | tar -x -C DIR``, with the compiled ``router/copse/router/_native*.so``
copied in) in front of the same engines, a round of it after each round of this tree's router: a
change to the router measured before and after in one run, on the same machine load.

``--router-set KEY=VALUE`` (repeatable) sets a router config key for every router, e.g.
``busy_prefill_tokens=1e12 --router-set busy_kv_fraction=1e6`` to take the router's admission
control (its queue in front of busy workers) out of the comparison and leave the proxy alone.

``--profile FILE`` also samples this tree's router with ``py-spy`` (when installed) during one
routed round at the highest concurrency and prints where its time goes.

Usage: ``.venv/bin/python benchmarks/router_proxy.py [--concurrency 64,256] [--rounds 2]
[--requests-per-stream 4] [--engines 4] [--prompt-tokens 1024] [--max-tokens 128]
[--decode-speedup 0.25] [--router-tree before=/tmp/copse-before] [--router-set KEY=VALUE]
[--profile /tmp/router.prof]``
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import numpy as np
import uvloop
import yaml

from copse.workers.testing import free_port_range

MODEL = "proxy-bench"
ROOTS = ("operator", "planner", "router", "workers", "sim")
"""A checkout's source roots (its ``PYTHONPATH`` for ``--router-tree``)."""


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _wait_ready(http: aiohttp.ClientSession, url: str, *, path: str, deadline_s: float = 60) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(f"{url}{path}") as response:
                if response.status == 200:
                    return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{url}{path} did not answer 200 within {deadline_s} s")


@contextlib.asynccontextmanager
async def _processes(args: argparse.Namespace) -> AsyncIterator[tuple[list[str], dict[str, tuple[str, int]]]]:
    """The engines and the routers; yields (engine URLs, router name -> (URL, pid))."""
    trees: list[tuple[str, Path | None]] = [("router", None), *args.router_tree]
    base = free_port_range(args.engines + len(trees))  # the engines', then the routers' ports
    engines = subprocess.Popen(
        [
            sys.executable, "-m", "copse.cli", "worker", "mock",
            "--engines", str(args.engines), "--port-base", str(base), "--model", MODEL,
            "--decode-speedup", str(args.decode_speedup), "--max-num-seqs", "512",
        ],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    urls = [f"http://127.0.0.1:{base + i}" for i in range(args.engines)]
    routers: dict[str, tuple[str, int]] = {}
    processes: list[subprocess.Popen[bytes]] = []
    files: list[str] = []
    try:
        for port, (name, tree) in enumerate(trees, start=base + args.engines):
            config = {
                "model": MODEL,
                "engine": "mock",
                "port": port,
                "policy": "round_robin",
                "discovery": {"kind": "static", "workers": [{"url": url} for url in urls]},
                "seed": 0,
                **dict(args.router_set),
            }
            with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as file:
                yaml.safe_dump(config, file)
            files.append(file.name)
            env = dict(os.environ)
            if tree is not None:
                env["PYTHONPATH"] = os.pathsep.join(str(tree / root) for root in ROOTS)
            router = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "copse.cli",
                    "router",
                    "run",
                    "--config",
                    file.name,
                    "--log-level",
                    "WARNING",
                ],
                env=env,
            )
            processes.append(router)
            routers[name] = (f"http://127.0.0.1:{port}", router.pid)
        async with aiohttp.ClientSession() as http:
            for url in urls:
                await _wait_ready(http, url, path="/health")
            for url, _ in routers.values():
                await _wait_ready(http, url, path="/health")
        yield urls, routers
    finally:
        processes.append(engines)
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            process.wait(timeout=30)
        for name in files:
            os.unlink(name)


async def _one(
    http: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int
) -> tuple[float, float, int]:
    """(TTFT s, end-to-end s, SSE data lines) of one streamed completion."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    started = time.perf_counter()
    first = 0.0
    lines = 0
    async with http.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {(await response.text())[:200]}")
        async for line in response.content:
            if line.startswith(b"data:"):
                lines += 1
                if lines == 1:
                    first = time.perf_counter()
    return first - started, time.perf_counter() - started, lines


async def _round(
    targets: list[str],
    *,
    concurrency: int,
    per_stream: int,
    prompt_tokens: int,
    max_tokens: int,
    seed: int,
    ramp_s: float = 2.0,
) -> tuple[np.ndarray, np.ndarray, int, float]:
    """``concurrency`` closed-loop streams spread over ``targets`` in turn, started over ``ramp_s``;
    (TTFTs, e2es, lines, wall)."""
    rng = random.Random(seed)
    ttfts: list[float] = []
    e2es: list[float] = []
    lines = 0
    turns = itertools.count()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:

        async def stream(index: int) -> None:
            nonlocal lines
            await asyncio.sleep(ramp_s * index / concurrency)  # a ramp, not one burst of prefills
            for _request in range(per_stream):
                prompt = [rng.randrange(1000, 100000) for _ in range(prompt_tokens)]
                # round-robin in the order requests are sent, as the router's policy does (streams
                # of one wave must not pile onto a few engines)
                target = targets[next(turns) % len(targets)]
                ttft, e2e, count = await _one(http, target, prompt, max_tokens)
                ttfts.append(ttft)
                e2es.append(e2e)
                lines += count

        started = time.perf_counter()
        await asyncio.gather(*(stream(i) for i in range(concurrency)))
        wall = time.perf_counter() - started
    return np.array(ttfts), np.array(e2es), lines, wall


def _py_spy() -> str:
    """``py-spy`` next to this interpreter (``pip install py-spy``), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise SystemExit("--profile needs py-spy: .venv/bin/pip install py-spy")
    return found


def _profile_report(path: Path) -> None:
    """Share of the router's samples per function (self and inclusive), from py-spy's raw output."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    print(f"\nrouter profile ({total} samples): self time")
    for frame, n in own.most_common(15):
        print(f"  {n / total:6.1%}  {frame}")
    print("inclusive, copse's frames")
    ours = [(frame, n) for frame, n in inclusive.most_common() if "router/" in frame or "protocol/" in frame]
    for frame, n in ours[:25]:
        print(f"  {n / total:6.1%}  {frame}")


async def main(args: argparse.Namespace) -> None:
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    async with _processes(args) as (engines, routers):
        print(
            f"{args.engines} engines, prompts {args.prompt_tokens} tokens, {args.max_tokens} tokens out, "
            f"{args.requests_per_stream} requests per stream; load average {os.getloadavg()[0]:.1f}"
        )
        paths: dict[str, tuple[list[str], int | None]] = {"direct": (engines, None)}
        paths.update({name: ([url], pid) for name, (url, pid) in routers.items()})
        # warm every path (connections, imports, first-call costs)
        for targets, _ in paths.values():
            await _round(targets, concurrency=8, per_stream=1, prompt_tokens=64, max_tokens=4, seed=1)
        width = max(7, *(len(name) for name in paths))
        header = (
            f"{'streams':>7} {'path':<{width}} {'TTFT p50':>9} {'p99':>8} {'e2e p50':>9} {'p99':>8}"
            f" {'tokens/s':>9} {'router CPU s':>12} {'tok/s per router core':>22}"
        )
        print(header)
        summary = []
        for concurrency in concurrencies:
            results: dict[str, list[tuple[np.ndarray, np.ndarray, int, float, float]]] = {
                path: [] for path in paths
            }
            for round_ in range(args.rounds):
                for path, (targets, pid) in paths.items():
                    profiling = (
                        args.profile is not None
                        and path == "router"
                        and concurrency == concurrencies[-1]
                        and round_ == args.rounds - 1
                    )
                    spy = None
                    if profiling:
                        spy = subprocess.Popen(
                            [_py_spy(), "record", "-p", str(pid), "-r", "200",
                             "--format", "raw", "-o", str(args.profile), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                        )  # fmt: skip
                    cpu = _cpu_s(pid) if pid is not None else 0.0
                    ttft, e2e, lines, wall = await _round(
                        targets,
                        concurrency=concurrency,
                        per_stream=args.requests_per_stream,
                        prompt_tokens=args.prompt_tokens,
                        max_tokens=args.max_tokens,
                        seed=round_,
                    )
                    used = _cpu_s(pid) - cpu if pid is not None else 0.0
                    if spy is not None:
                        spy.send_signal(signal.SIGINT)
                        spy.wait(timeout=60)
                    results[path].append((ttft, e2e, lines, wall, used))
                    routed = pid is not None
                    per_core = f"{lines / used:>22,.0f}" if routed and used > 0 else f"{'':>22}"
                    print(
                        f"{concurrency:>7} {path:<{width}} {np.percentile(ttft, 50) * 1e3:>9.1f}"
                        f" {np.percentile(ttft, 99) * 1e3:>8.1f} {np.percentile(e2e, 50) * 1e3:>9.1f}"
                        f" {np.percentile(e2e, 99) * 1e3:>8.1f} {lines / wall:>9,.0f}"
                        f" {used if routed else float('nan'):>12.2f}{per_core}",
                        flush=True,
                    )
            pooled = {
                path: (
                    np.concatenate([r[0] for r in rows]),
                    np.concatenate([r[1] for r in rows]),
                    sum(r[2] for r in rows),
                    sum(r[4] for r in rows),
                )
                for path, rows in results.items()
            }
            d_ttft, d_e2e = (np.percentile(a, 50) * 1e3 for a in pooled["direct"][:2])
            for path in routers:
                r_ttft, r_e2e = (np.percentile(a, 50) * 1e3 for a in pooled[path][:2])
                tokens, cpu = pooled[path][2], pooled[path][3]
                summary.append(
                    f"{concurrency} streams, {path}: adds {r_ttft - d_ttft:+.1f} ms to TTFT p50 "
                    f"({r_ttft:.1f} vs {d_ttft:.1f} ms), end-to-end p50 x{r_e2e / d_e2e:.3f} "
                    f"({r_e2e:.0f} vs {d_e2e:.0f} ms); {tokens / cpu:,.0f} streamed tokens per router"
                    " CPU-second"
                )
        print("\n" + "\n".join(summary))
        print(f"load average at the end {os.getloadavg()[0]:.1f}")
    if args.profile is not None and args.profile.exists():
        _profile_report(args.profile)


def _setting(spec: str) -> tuple[str, object]:
    key, sep, value = spec.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--router-set {spec!r}: expected KEY=VALUE")
    return key, yaml.safe_load(value)


def _tree(spec: str) -> tuple[str, Path]:
    name, sep, path = spec.partition("=")
    root = Path(path)
    if (
        not sep
        or not name
        or name in ("direct", "router")
        or not (root / "router" / "copse" / "router").is_dir()
    ):
        raise argparse.ArgumentTypeError(
            f"--router-tree {spec!r}: expected NAME=DIR (NAME not direct/router), DIR a checkout of copse"
        )
    return name, root


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--concurrency", default="64,256", help="Comma-separated numbers of concurrent streams."
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="Rounds per path and concurrency (alternating)."
    )
    parser.add_argument("--requests-per-stream", type=int, default=4)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--decode-speedup",
        type=float,
        default=0.25,
        help="Engines' decode_speedup_ratio (<1: slower decode).",
    )
    parser.add_argument(
        "--router-tree",
        type=_tree,
        action="append",
        default=[],
        help="NAME=DIR: also this checkout's router.",
    )
    parser.add_argument(
        "--router-set",
        type=_setting,
        action="append",
        default=[],
        help="KEY=VALUE (YAML value): a config setting of every router.",
    )
    parser.add_argument("--profile", type=Path, default=None, help="py-spy raw profile of the router here.")
    uvloop.run(main(parser.parse_args()))
