"""The NATS subscription both router syncs (KV events, replica load) hold."""

from __future__ import annotations

import abc

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription


class Subscriber(abc.ABC):
    """One subscription on ``subject``: :meth:`start` subscribes :meth:`on_message`, :meth:`stop` ends it."""

    def __init__(self, nc: NATS, *, subject: str) -> None:
        self._nc = nc
        self.subject = subject
        self._subscription: Subscription | None = None

    async def start(self) -> None:
        self._subscription = await self._nc.subscribe(self.subject, cb=self.on_message)

    async def stop(self) -> None:
        if self._subscription is not None:
            await self._subscription.unsubscribe()
            self._subscription = None

    @abc.abstractmethod
    async def on_message(self, msg: Msg) -> None:
        """Handle one message (malformed ones are logged and dropped, never raised)."""
