"""KV cache events as copse publishes them on NATS, and the dump used to resync.

Every engine (mocker or KV relay next to ``trtllm-serve``) publishes one
:class:`KvEventBatch` per flush on its deployment's events subject
(:func:`copse.workers.protocol.subjects.kv_events_subject`), JSON-encoded.

Ordering and gaps: within one engine incarnation (``worker_id``, ``epoch``) event ids start at
1 and increase by exactly 1 per event, across batches. A subscriber that sees a new ``epoch``
for a worker, or an ``event_id`` that is not ``last + 1``, has missed something: it drops what
it knows of that worker and asks for a :class:`KvDump` (request :class:`KvDumpRequest` on
:func:`~copse.workers.protocol.subjects.kv_dump_subject`), applies it, then applies only
events whose id is greater than ``KvDump.last_event_id``.

Lost engine events: a publisher that relays another engine's events (the KV relay next to
``trtllm-serve``) can itself miss some (the engine's event buffer overflowed, or the relay started
after the engine). It then publishes a :class:`KvReset`: the subscriber forgets that worker's
blocks, and the events that follow are still exact about the blocks they name (a stored block is
held, a removed one is not) but blocks stored before are unknown, so the subscriber treats that
worker as approximate (it may guess from where it sent requests) until a :class:`KvExact` or a
:class:`KvCleared` says the events describe everything again. Such a publisher never names a
block the engine does not hold; its dump carries ``exact=False`` meanwhile.

Block identities are the block hashes of :mod:`copse.workers.protocol.hashing`, so a router
computes the same values from a prompt's token ids.
"""

from __future__ import annotations

from typing import Annotated, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

U64 = Annotated[int, Field(ge=0, lt=2**64)]
"""An unsigned 64-bit hash."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StoredBlock(NamedTuple):
    """One block newly held by an engine; a ``[block_hash, tokens_hash]`` pair in JSON.

    (A named tuple rather than a model: engines create millions of them in a simulation.)
    """

    block_hash: U64
    """Hash of the whole prefix up to this block (chained); the block's identity."""
    tokens_hash: U64
    """Hash of this block's tokens alone."""


class KvStored(_Frozen):
    """Consecutive blocks of one sequence became cached; ``blocks[0]`` follows ``parent_hash``."""

    type: Literal["stored"] = "stored"
    parent_hash: U64 | None
    """Block hash of the block before ``blocks[0]``; ``None`` when ``blocks[0]`` starts a sequence."""
    blocks: tuple[StoredBlock, ...]
    """The new blocks in sequence order, each the parent of the next."""


class KvRemoved(_Frozen):
    """Blocks evicted from the cache (no cascade: descendants are removed by their own events)."""

    type: Literal["removed"] = "removed"
    block_hashes: tuple[U64, ...]


class KvUpdated(_Frozen):
    """Blocks an engine still holds moved from one tier of its cache to another: 0 the GPU, 1 host
    memory, 2 disk (TensorRT-LLM's ``updated`` event with a ``cache_level`` change from its old to
    its new value, one block per event there; :mod:`copse.workers.perf.tiers`). A block stored is
    on the GPU."""

    type: Literal["updated"] = "updated"
    block_hashes: tuple[U64, ...]
    tier: int = Field(ge=0, le=2)
    """The tier the blocks are on now."""
    previous_tier: int = Field(ge=0, le=2)
    """The tier they were on."""


class KvCleared(_Frozen):
    """The engine dropped every cached block."""

    type: Literal["cleared"] = "cleared"


class KvReset(_Frozen):
    """The publisher lost engine events: forget this worker's blocks; until a :class:`KvExact` or
    :class:`KvCleared`, the blocks it held before are unknown (the events that follow are exact
    about the blocks they name)."""

    type: Literal["reset"] = "reset"


class KvExact(_Frozen):
    """Since the last :class:`KvReset`, every block the engine holds has been announced: the
    events now describe its whole cache again."""

    type: Literal["exact"] = "exact"


KvEventData = Annotated[
    KvStored | KvRemoved | KvUpdated | KvCleared | KvReset | KvExact, Field(discriminator="type")
]


class KvEvent(_Frozen):
    """One numbered change to an engine's cache."""

    event_id: int = Field(ge=1)
    """1 for the first event of an engine incarnation, then +1 per event."""
    data: KvEventData


class KvEventBatch(_Frozen):
    """One NATS message: consecutive events of one engine."""

    worker_id: str = Field(min_length=1)
    """The engine's identity (pod name, or ``<prefix>-<index>`` for mocked engines)."""
    epoch: int = Field(ge=0)
    """Changes whenever the engine restarts (its start time in ns), so ids restarting at 1 are unambiguous."""
    events: tuple[KvEvent, ...]


class KvDumpRequest(_Frozen):
    """Body of a dump request (NATS request/reply on the worker's dump subject, or HTTP)."""

    worker_id: str | None = None
    """Worker asked; optional, only checked when present (the subject already names the worker)."""


class DumpBlock(NamedTuple):
    """One cached block in a dump; a ``[block_hash, parent_hash, tokens_hash, tier]`` list in JSON
    (the tier may be left out: the GPU)."""

    block_hash: U64
    parent_hash: U64 | None
    """Block hash of the previous block of the sequence that stored it; ``None`` for a first block."""
    tokens_hash: U64
    tier: Annotated[int, Field(ge=0, le=2)] = 0
    """Tier of the engine's cache the block is on (see :class:`KvUpdated`)."""


class KvDump(_Frozen):
    """Everything an engine holds at ``last_event_id``; parents are listed before their children."""

    worker_id: str = Field(min_length=1)
    epoch: int = Field(ge=0)
    block_size: int = Field(ge=1)
    """Tokens per block the engine hashes with; a router must hash prompts the same way."""
    last_event_id: int = Field(ge=0)
    """Id of the last event reflected here (0 before any event)."""
    blocks: tuple[DumpBlock, ...]
    exact: bool = True
    """False while the publisher has lost track (see :class:`KvReset`): every block listed is held,
    but the engine may hold others."""
