"""Build the control-plane binaries from the Go module proxy, once, into the user cache.

Nothing here is committed or shipped: the binaries go to ``<cache>/bin/<versions>/``,
the throwaway wrapper modules to ``<cache>/build/``. A file lock makes concurrent
callers (two test sessions, ``make demo`` while ``make e2e`` runs) build once.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from copse.cluster.errors import BuildError, GoNotFoundError
from copse.cluster.gomod import (
    KWOK_STAGES,
    join_yaml_documents,
    kube_version_ldflags,
    parse_release_gomod,
    render_simple_gomod,
    render_wrapper_gomod,
)
from copse.cluster.logs import tail
from copse.cluster.versions import DEFAULT_VERSIONS, Binaries, Versions, binaries_for, cache_root

Reporter = Callable[[str], None]

KUBE_COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
HEARTBEAT_SECONDS = 60.0
"""How often a long compile prints 'still building' so CI logs and ``make demo`` do not look hung."""


def report_to_stderr(message: str) -> None:
    print(f"copse cluster build: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class _Step:
    name: str
    output: Path | None
    run: Callable[[], None]


class _Builder:
    def __init__(self, *, versions: Versions, root: Path, binaries: Binaries, report: Reporter) -> None:
        self.versions = versions
        self.binaries = binaries
        self.report = report
        self.work = root / "build"
        self.logs = self.work / "logs" / versions.key
        self.go = shutil.which("go")
        if self.go is None:
            raise GoNotFoundError()
        self.env: Mapping[str, str] = {
            **os.environ,
            # The machine's Go is new enough for every module here; never download a toolchain.
            "GOTOOLCHAIN": "local",
            # Static binaries, as upstream releases them (KUBE_STATIC_LIBRARIES, etcd's build_lib.sh).
            "CGO_ENABLED": "0",
            # The wrapper modules' go.sum starts empty; keep any flags the user set (e.g. -modcacherw).
            "GOFLAGS": " ".join(flag for flag in (os.environ.get("GOFLAGS", ""), "-mod=mod") if flag),
        }
        self._current = ""
        self.kube_dir: Path | None = None

    # -- running go -------------------------------------------------------------------------
    def _log_path(self) -> Path:
        return self.logs / f"{self._current}.log"

    def go_run(self, *args: str, cwd: Path | None = None, extra_env: Mapping[str, str] | None = None) -> None:
        """Run ``go args...`` with output appended to the step's log, printing a heartbeat."""
        assert self.go is not None
        argv = [self.go, *args]
        log_path = self._log_path()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with log_path.open("ab") as log:
            log.write(f"$ {' '.join(argv)}\n".encode())
            log.flush()
            process = subprocess.Popen(
                argv,
                cwd=cwd,
                env={**self.env, **(extra_env or {})},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            while True:
                try:
                    code = process.wait(timeout=HEARTBEAT_SECONDS)
                    break
                except subprocess.TimeoutExpired:
                    minutes = (time.monotonic() - started) / 60
                    self.report(f"  ... still building {self._current} ({minutes:.0f} min)")
        if code != 0:
            raise BuildError(
                component=self._current, command=" ".join(argv), log=log_path, tail=tail(log_path, lines=30)
            )

    def go_json(self, *args: str, cwd: Path | None = None) -> dict[str, object]:
        assert self.go is not None
        completed = subprocess.run(
            [self.go, *args],
            cwd=cwd,
            env=dict(self.env),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
        )
        if completed.returncode != 0:
            log_path = self._log_path()
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with log_path.open("a") as log:
                log.write(completed.stderr)
            raise BuildError(
                component=self._current,
                command=f"go {' '.join(args)}",
                log=log_path,
                tail=completed.stderr[-3000:],
            )
        parsed = json.loads(completed.stdout)
        if not isinstance(parsed, dict):
            raise BuildError(
                component=self._current,
                command=f"go {' '.join(args)}",
                log=self._log_path(),
                tail=f"unexpected output: {completed.stdout[:500]}",
            )
        return parsed

    def module_file(self, module: str, key: str) -> Path:
        """A path (``Dir`` or ``GoMod``) of ``module@version`` in the module cache, downloading it."""
        info = self.go_json("mod", "download", "-json", module)
        value = info.get(key)
        if not isinstance(value, str):
            raise BuildError(
                component=self._current,
                command=f"go mod download -json {module}",
                log=self._log_path(),
                tail=f"no {key} in {info}",
            )
        return Path(value)

    def wrapper_dir(self, name: str, gomod: str) -> Path:
        directory = self.work / name
        directory.mkdir(parents=True, exist_ok=True)
        gomod_path = directory / "go.mod"
        if not gomod_path.is_file() or gomod_path.read_text() != gomod:
            gomod_path.write_text(gomod)
            (directory / "go.sum").unlink(missing_ok=True)
        return directory

    def build_to(self, output: Path, *args: str, cwd: Path) -> None:
        """``go build -o`` to a temporary name and rename, so a half-written file never counts as built."""
        partial = output.with_name(f".{output.name}.partial")
        self.go_run("build", "-trimpath", "-o", str(partial), *args, cwd=cwd)
        partial.replace(output)

    def install_to(self, output: Path, package: str, *, ldflags: str) -> None:
        staging = self.binaries.directory / f".gobin-{output.name}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        self.go_run("install", "-trimpath", "-ldflags", ldflags, package, extra_env={"GOBIN": str(staging)})
        (staging / package.split("@", maxsplit=1)[0].rsplit("/", 1)[-1]).replace(output)
        shutil.rmtree(staging)

    # -- components ---------------------------------------------------------------------------
    def etcd(self) -> None:
        directory = self.wrapper_dir(
            f"etcd-{self.versions.etcd}", render_simple_gomod(module="local/copse-etcd", go="1.24")
        )
        self.go_run("get", f"go.etcd.io/etcd/server/v3@{self.versions.etcd}", cwd=directory)
        self.build_to(
            self.binaries.path("etcd"), "-ldflags", "-s -w", "go.etcd.io/etcd/server/v3", cwd=directory
        )

    def kwok(self) -> None:
        self.install_to(
            self.binaries.path("kwok"), f"sigs.k8s.io/kwok/cmd/kwok@{self.versions.kwok}", ldflags="-s -w"
        )

    def kwok_stages(self) -> None:
        module_dir = self.module_file(f"sigs.k8s.io/kwok@{self.versions.kwok}", "Dir")
        stage_dir = module_dir / "kustomize" / "stage"
        texts = []
        for stage in KWOK_STAGES:
            path = stage_dir / f"{stage}.yaml"
            if not path.is_file():
                raise BuildError(
                    component="kwok-stages",
                    command=f"read {path}",
                    log=self._log_path(),
                    tail=f"stage file missing from sigs.k8s.io/kwok@{self.versions.kwok}",
                )
            texts.append(path.read_text())
        partial = self.binaries.kwok_stages.with_name(".kwok-stages.yaml.partial")
        partial.write_text(join_yaml_documents(texts))
        partial.replace(self.binaries.kwok_stages)

    def helm(self) -> None:
        major = self.versions.helm.split(".")[0]
        module = f"helm.sh/helm/{major}" if major != "v1" else "helm.sh/helm"
        self.install_to(
            self.binaries.path("helm"),
            f"{module}/cmd/helm@{self.versions.helm}",
            ldflags=f"-s -w -X {module}/internal/version.version={self.versions.helm}",
        )

    def kube_module(self) -> None:
        release_gomod = self.module_file(f"k8s.io/kubernetes@{self.versions.kubernetes}", "GoMod")
        release = parse_release_gomod(release_gomod.read_text(), source=str(release_gomod))
        directory = self.wrapper_dir(
            f"kubernetes-{self.versions.kubernetes}",
            render_wrapper_gomod(
                module="local/copse-kubernetes",
                release=release,
                requires={"k8s.io/kubernetes": self.versions.kubernetes},
                staging_version=self.versions.staging,
            ),
        )
        self.go_run("get", f"k8s.io/kubernetes@{self.versions.kubernetes}", cwd=directory)
        self.kube_dir = directory

    def kube_command(self, command: str) -> None:
        # Set by the module step, which precedes every command step that is not cached.
        assert self.kube_dir is not None
        ldflags = kube_version_ldflags(
            version=self.versions.kubernetes,
            minor=self.versions.kube_minor,
            build_date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        )
        self.build_to(
            self.binaries.path(command),
            "-tags",
            "selinux,notest",
            "-ldflags",
            ldflags,
            f"k8s.io/kubernetes/cmd/{command}",
            cwd=self.kube_dir,
        )

    # -- driver -------------------------------------------------------------------------------
    def steps(self) -> list[_Step]:
        steps = [
            _Step("etcd", self.binaries.path("etcd"), self.etcd),
            _Step("kwok", self.binaries.path("kwok"), self.kwok),
            _Step("kwok-stages", self.binaries.kwok_stages, self.kwok_stages),
            _Step("helm", self.binaries.helm, self.helm),
        ]
        if any(not self.binaries.path(command).is_file() for command in KUBE_COMMANDS):
            steps.append(
                _Step(f"k8s.io/kubernetes@{self.versions.kubernetes} module", None, self.kube_module)
            )
        steps.extend(
            _Step(command, self.binaries.path(command), functools.partial(self.kube_command, command))
            for command in KUBE_COMMANDS
        )
        return steps

    def run(self) -> None:
        steps = self.steps()
        total = len(steps)
        for index, step in enumerate(steps, start=1):
            prefix = f"[{index}/{total}] {step.name}"
            if step.output is not None and step.output.is_file():
                self.report(f"{prefix}: cached")
                continue
            self._current = step.name.split(" ")[0].replace("/", "_").replace("@", "-")
            self.report(f"{prefix}: building (log: {self._log_path()})")
            started = time.monotonic()
            step.run()
            self.report(f"{prefix}: done in {_minutes(time.monotonic() - started)}")


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


@contextlib.contextmanager
def _build_lock(path: Path, report: Reporter) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            report(f"another build holds {path}; waiting for it")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_binaries(
    versions: Versions = DEFAULT_VERSIONS,
    *,
    root: Path | None = None,
    report: Reporter = report_to_stderr,
) -> Binaries:
    """Return the cached binaries of ``versions``, building whatever is missing first.

    Raises :class:`GoNotFoundError` when a build is needed and Go is absent, and
    :class:`BuildError` (naming the component and its log) when a build fails.
    """
    root = root or cache_root()
    binaries = binaries_for(versions, root=root)
    if not binaries.missing():
        return binaries
    binaries.directory.mkdir(parents=True, exist_ok=True)
    with _build_lock(binaries.directory.with_name(f"{versions.key}.lock"), report):
        if binaries.missing():
            started = time.monotonic()
            report(f"building {', '.join(binaries.missing())} into {binaries.directory}")
            _Builder(versions=versions, root=root, binaries=binaries, report=report).run()
            report(f"all binaries ready in {_minutes(time.monotonic() - started)}")
    return binaries
