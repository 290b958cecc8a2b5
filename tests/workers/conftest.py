"""Shared fixtures: a real nats-server for the whole session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from copse.workers.testing import nats_server


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    with nats_server() as url:
        yield url
