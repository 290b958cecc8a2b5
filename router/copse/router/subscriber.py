"""The NATS subscription both router syncs (KV events, replica load) hold."""

from __future__ import annotations

import abc

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from copse.router.nats_link import NatsLink


class Subscriber(abc.ABC):
    """One subscription on ``subject``, made again on every connection of ``link`` (it ends with the
    connection): :meth:`start` registers it (subscribing at once when connected), :meth:`on_message`
    handles its messages."""

    def __init__(self, link: NatsLink, *, subject: str) -> None:
        self.link = link
        self.subject = subject

    async def start(self) -> None:
        self.link.on_connect.append(self.on_connect)
        if self.link.nc is not None:
            await self.on_connect(self.link.nc)

    async def on_connect(self, nc: NATS) -> None:
        """Subscribe on a new connection (subclasses extend it to resync)."""
        await nc.subscribe(self.subject, cb=self.on_message)

    @abc.abstractmethod
    async def on_message(self, msg: Msg) -> None:
        """Handle one message (malformed ones are logged and dropped, never raised)."""
