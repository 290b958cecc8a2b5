"""The binary cache: nothing is built when everything is present; a missing Go is a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest

from copse.cluster.build import ensure_binaries
from copse.cluster.errors import GoNotFoundError
from copse.cluster.logs import tail
from copse.cluster.versions import Versions, binaries_for, cache_root


def test_complete_cache_is_returned_without_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    binaries = binaries_for(Versions(), root=tmp_path)
    binaries.directory.mkdir(parents=True)
    for name in binaries.names:
        binaries.path(name).write_text("")
    binaries.kwok_stages.write_text("kind: Stage\n")
    messages: list[str] = []
    assert ensure_binaries(Versions(), root=tmp_path, report=messages.append) == binaries
    assert messages == []


def test_missing_binaries_without_go_say_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    binaries = binaries_for(Versions(), root=tmp_path)
    binaries.directory.mkdir(parents=True)
    binaries.path("etcd").write_text("")
    assert "etcd" not in binaries.missing()
    assert {"kube-apiserver", "kwok-stages"} <= set(binaries.missing())
    with pytest.raises(GoNotFoundError, match=r"go was not found on PATH.*\$KUBECONFIG"):
        ensure_binaries(Versions(), root=tmp_path, report=lambda _: None)


def test_cache_root_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COPSE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "copse"
    monkeypatch.setenv("COPSE_CACHE_DIR", str(tmp_path / "explicit"))
    assert cache_root() == tmp_path / "explicit"
    assert binaries_for(Versions()).directory == tmp_path / "explicit" / "bin" / Versions().key


def test_unknown_binary_name_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="unknown binary 'kubelet'"):
        binaries_for(Versions(), root=tmp_path).path("kubelet")


def test_tail_returns_the_last_lines_or_says_the_log_is_missing(tmp_path: Path) -> None:
    log = tmp_path / "etcd.log"
    log.write_text("".join(f"line {n}\n" for n in range(100)))
    assert tail(log, lines=2) == "line 98\nline 99\n"
    assert tail(tmp_path / "nope.log") == f"(no log at {tmp_path / 'nope.log'})"
