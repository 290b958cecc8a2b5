"""Who sent a request, and how much of the router one client may hold at once.

:func:`tenant_of` is the one derivation of a request's tenant (fair share, rate limits, metrics:
:mod:`copse.router.objectives`) and :func:`client_key` of its client for the bounds here: the API
key (hashed: the key itself is never kept, logged or exported), else the gateway's
``x-gateway-inference-fairness-id``; a client without either is told apart by its peer address.

:class:`ClientGate` bounds, per client, the requests in the router at once (waiting for a worker or
served) and the streams among them, and across all clients the bytes of request bodies held: a
client past its bound gets 429 with ``Retry-After`` and takes nothing from the others. Pure
accounting, no I/O; every entry goes when its client's last request ends, so its memory follows
the requests in flight, not the clients ever seen.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
"""The Gateway API Inference Extension's tenant header."""
MAX_ID_CHARS = 128
"""Longest fairness id kept as it is (longer ones are hashed: a client cannot make the key large)."""


def _header(headers: Mapping[str, str], name: str) -> str:
    """A header's value whatever the case of its name (aiohttp's headers, or a lower-cased dict)."""
    value = headers.get(name)
    if value is None:
        value = next((v for k, v in headers.items() if k.lower() == name), "")
    return value


def bearer_token(headers: Mapping[str, str]) -> str | None:
    """The API key of an ``Authorization: Bearer <key>`` header, if there is one."""
    scheme, _, token = _header(headers, "authorization").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode("utf-8", errors="replace")).hexdigest()[:16]


def tenant_of(headers: Mapping[str, str]) -> str:
    """The tenant of a request: ``key-<hash of its API key>`` (the key itself is never kept), else
    its fairness id (``id-<hash>`` past :data:`MAX_ID_CHARS`), else "" (the one anonymous tenant)."""
    token = bearer_token(headers)
    if token is not None:
        return f"key-{_digest(token)}"
    tenant = _header(headers, FAIRNESS_HEADER).strip()
    return tenant if len(tenant) <= MAX_ID_CHARS else f"id-{_digest(tenant)}"


def client_key(headers: Mapping[str, str], *, peer: str | None) -> str:
    """The client of a request: its tenant, else ``peer:<address>`` (``peer:unknown`` when the
    transport has none), so anonymous clients are still told apart for their bounds."""
    return tenant_of(headers) or f"peer:{peer or 'unknown'}"


CLIENT_KEEPALIVE_S = 5.0
"""How long a client of the router should keep an idle connection for reuse: below
:attr:`ClientLimits.header_timeout_s`, so it never sends a request on a connection the router is
closing as idle (the client would see its write fail, not an answer). httpx's default; aiohttp's
client keeps 15 s unless told."""


class ClientLimits(BaseModel):
    """Bounds per client and on what all clients' requests hold together."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_requests: int = Field(default=512, ge=1)
    """Requests of one client in the router at once (queued or served): one client cannot fill
    the queue or every worker slot. Clients without an API key or fairness id are told apart by
    address: behind a proxy that adds neither, they share this bound."""
    max_streams: int = Field(default=512, ge=1)
    """Streamed requests of one client at once (each holds a connection to a worker)."""
    max_body_bytes_held: int = Field(default=1024 * 1024 * 1024, ge=1024)
    """Bytes of request bodies the router holds at once, all clients together (a body is held from
    its first byte until its answer ends); past it new requests get 429."""
    body_timeout_s: float = Field(default=30.0, gt=0)
    """Longest a client may take to send a request's body; a slower one gets 408 and its
    connection is closed."""
    header_timeout_s: float = Field(default=10.0, gt=0)
    """Longest a connection may stay open without sending a whole request head (slow headers, or
    an idle keep-alive connection): it is then closed. Keep it above clients' keep-alive expiry
    (httpx, under the ``openai`` client: 5 s; aiohttp: 15 s, see :data:`CLIENT_KEEPALIVE_S`), or a
    client may send on a connection being closed."""
    write_timeout_s: float = Field(default=30.0, gt=0)
    """Longest a write to a client may wait for it to read (a client that stops reading its
    stream): the stream is then ended and its engine request aborted."""


@dataclass(slots=True)
class _Held:
    requests: int = 0
    streams: int = 0


class Refused(Exception):
    """A request over a client bound (429)."""


class ClientGate:
    """The accounting of :class:`ClientLimits`."""

    def __init__(self, limits: ClientLimits) -> None:
        self.limits = limits
        self._held: dict[str, _Held] = {}
        self.body_bytes = 0
        """Bytes of bodies held now."""

    def clients(self) -> int:
        """Clients with a request in the router now."""
        return len(self._held)

    def enter(self, key: str, *, body_bytes: int) -> None:
        """Admit a request of ``key`` whose body takes ``body_bytes``; raises :class:`Refused`."""
        held = self._held.get(key)
        if held is not None and held.requests >= self.limits.max_requests:
            raise Refused(
                f"this client has {held.requests} requests in the router, its limit "
                f"(clients.max_requests {self.limits.max_requests})"
            )
        if self.body_bytes + body_bytes > self.limits.max_body_bytes_held:
            raise Refused(
                f"the router holds {self.body_bytes} bytes of request bodies; this one's {body_bytes} "
                f"would pass clients.max_body_bytes_held ({self.limits.max_body_bytes_held})"
            )
        if held is None:
            held = self._held[key] = _Held()
        held.requests += 1
        self.body_bytes += body_bytes

    def grow(self, extra: int) -> None:
        """A body held so far takes ``extra`` more bytes (a body counted as it arrives); raises
        :class:`Refused` past ``max_body_bytes_held``."""
        if self.body_bytes + extra > self.limits.max_body_bytes_held:
            raise Refused(
                f"the router holds {self.body_bytes} bytes of request bodies; {extra} more would pass "
                f"clients.max_body_bytes_held ({self.limits.max_body_bytes_held})"
            )
        self.body_bytes += extra

    def resize(self, *, reserved: int, actual: int) -> None:
        """A body reserved at ``reserved`` bytes (its announced or largest size) took ``actual``."""
        self.body_bytes += actual - reserved

    def leave(self, key: str, *, body_bytes: int) -> None:
        """A request admitted by :meth:`enter` ended."""
        held = self._held[key]
        held.requests -= 1
        self.body_bytes -= body_bytes
        if held.requests == 0:
            del self._held[key]

    def open_stream(self, key: str) -> None:
        """A request of ``key`` (inside :meth:`enter`) streams; raises :class:`Refused`."""
        held = self._held[key]
        if held.streams >= self.limits.max_streams:
            raise Refused(
                f"this client has {held.streams} streams open, its limit "
                f"(clients.max_streams {self.limits.max_streams})"
            )
        held.streams += 1

    def close_stream(self, key: str) -> None:
        self._held[key].streams -= 1
