"""API keys of the router's OpenAI paths (HTTP mode): a file of keys, one per line (blank lines
and ``#`` comments ignored), as the operator mounts it from the Secret of ``spec.router.auth``.

The file is re-read when its modification time changes (a Secret's update reaches a mounted file
within the kubelet's sync period), checked at most once per ``RELOAD_CHECK_S``. A key is compared
in constant time against every key; keys are never logged, and an unreadable or empty file
refuses every request (fail closed) and says so in the log by path only.
"""

from __future__ import annotations

import hmac
import logging
import time
from pathlib import Path

log = logging.getLogger(__name__)

RELOAD_CHECK_S = 1.0
"""How often the key file's modification time is checked."""


class ApiKeys:
    """The accepted keys, from ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._keys: tuple[bytes, ...] = ()
        self._mtime: float | None = None
        self._checked = float("-inf")
        self._reload()

    def _reload(self) -> None:
        self._checked = time.monotonic()
        try:
            mtime = self.path.stat().st_mtime
            if mtime == self._mtime:
                return
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            if self._keys or self._mtime is None:
                log.error(
                    "API key file %s unreadable (%s): every request is refused", self.path, type(exc).__name__
                )
            self._keys, self._mtime = (), None
            return
        lines = (line.strip() for line in text.splitlines())
        self._keys = tuple(line.encode() for line in lines if line and not line.startswith("#"))
        self._mtime = mtime
        if not self._keys:
            log.error("API key file %s holds no key: every request is refused", self.path)
        else:
            log.info("loaded %d API keys from %s", len(self._keys), self.path)

    def accepts(self, token: str) -> bool:
        """Whether ``token`` is one of the keys (compared in constant time with each)."""
        if time.monotonic() - self._checked > RELOAD_CHECK_S:
            self._reload()
        candidate = token.encode()
        found = False
        for key in self._keys:
            found |= hmac.compare_digest(candidate, key)
        return found
