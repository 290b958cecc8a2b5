"""Every copse command logs as text or JSON lines, with deployment/role/group context."""

from __future__ import annotations

import json
import logging

import pytest

from copse.cli import logs


def record(**extra: str) -> logging.LogRecord:
    logger = logging.getLogger("copse.test")
    return logger.makeRecord(
        "copse.test", logging.INFO, __file__, 1, "placed %s", ("g-0",), None, extra=extra
    )


def test_json_lines_carry_context() -> None:
    line = logs.JsonFormatter().format(record(deployment="llama", role="worker", group="llama-worker-0"))
    entry = json.loads(line)
    assert entry["message"] == "placed g-0"
    assert (entry["deployment"], entry["role"], entry["group"]) == ("llama", "worker", "llama-worker-0")
    assert entry["level"] == "INFO"


def test_text_lines_append_context() -> None:
    line = logs.TextFormatter().format(record(deployment="llama", group="llama-worker-0"))
    assert line.endswith("placed g-0 [deployment=llama group=llama-worker-0]")


def test_lines_without_context_stay_plain() -> None:
    assert "[" not in logs.TextFormatter().format(record())
    assert set(json.loads(logs.JsonFormatter().format(record()))) == {"time", "level", "logger", "message"}


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_configure_replaces_root_handlers(fmt: str) -> None:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        logs.configure(fmt=fmt, level="warning")
        [handler] = root.handlers
        assert isinstance(handler.formatter, logs.JsonFormatter if fmt == "json" else logs.TextFormatter)
        assert root.level == logging.WARNING
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
