"""NATS subject names.

* ``copse.kv.events.<namespace>.<deployment>`` -- every engine of a deployment publishes its
  :class:`~copse.workers.protocol.kv_events.KvEventBatch` messages here (one subject per
  deployment; the message carries the worker id).
* ``copse.kv.dump.<namespace>.<deployment>.<worker_id>`` -- request/reply: send a
  :class:`~copse.workers.protocol.kv_events.KvDumpRequest`, get a
  :class:`~copse.workers.protocol.kv_events.KvDump` back.

Each name part becomes one subject token. Kubernetes names may hold dots, which separate NATS
tokens, so ``.`` is written as ``~`` (a character no Kubernetes name contains).
"""

from __future__ import annotations

import re

_TOKEN = re.compile(r"^[A-Za-z0-9_.-]+$")


def subject_token(part: str) -> str:
    """``part`` as one NATS subject token; raises ``ValueError`` for characters NATS or copse reserve."""
    if not _TOKEN.match(part):
        raise ValueError(
            f"{part!r} cannot name a NATS subject token (allowed: letters, digits, '_', '-', '.')"
        )
    return part.replace(".", "~")


def kv_events_subject(*, namespace: str, deployment: str) -> str:
    """Subject of every KV event batch of one deployment."""
    return f"copse.kv.events.{subject_token(namespace)}.{subject_token(deployment)}"


def kv_dump_subject(*, namespace: str, deployment: str, worker_id: str) -> str:
    """Subject on which one worker answers dump requests."""
    return f"copse.kv.dump.{subject_token(namespace)}.{subject_token(deployment)}.{subject_token(worker_id)}"
