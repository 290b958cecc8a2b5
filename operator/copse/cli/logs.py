"""Logging for every ``copse`` command: plain text for people, JSON lines for log pipelines.

Components attach context with ``logger.info(..., extra={"deployment": ..., "role": ...,
"group": ...})``; both formats print those fields on every line that has them.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

#: Context fields a log line may carry, in the order they are printed.
CONTEXT_FIELDS = ("namespace", "deployment", "role", "group", "worker")


def _context(record: logging.LogRecord) -> dict[str, str]:
    return {
        name: str(getattr(record, name)) for name in CONTEXT_FIELDS if getattr(record, name, None) is not None
    }


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        context = _context(record)
        if context:
            line += " [" + " ".join(f"{key}={value}" for key, value in context.items()) + "]"
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **_context(record),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure(*, fmt: str, level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # HTTP clients log every request at INFO: noise next to our decisions.
    for chatty in ("httpx", "httpcore", "aiohttp.access"):
        logging.getLogger(chatty).setLevel(max(logging.WARNING, root.level))
