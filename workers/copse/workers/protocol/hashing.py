"""Block hashing shared by engines (the mocker, the KV relay) and the router.

Two hashes per full block of ``block_size`` tokens, both XXH3-64 with seed :data:`HASH_SEED`,
as unsigned 64-bit Python ints:

* **tokens hash** (``tokens_hash``): XXH3-64 over the block's token ids, each as a little-endian
  unsigned 32-bit integer, in order (``block_size * 4`` bytes). It depends on the block alone.
* **block hash** (``block_hash``): the hash of the whole prefix up to and including this block.
  The first block of a sequence has ``block_hash = tokens_hash``; every later block has
  ``block_hash = XXH3-64(LE_u64(parent block_hash) || LE_u64(tokens_hash))`` (16 bytes).

A trailing partial block is never hashed (it is not shareable). These are the same conventions
NVIDIA Dynamo uses (seed 1337, ``u32`` tokens, ``u64`` chaining), so equal prefixes get equal
block hashes in every component.

**LoRA adapters.** A prompt served through an adapter has other KV than the same prompt on the
base model, so its blocks must never match the base model's (or another adapter's). The tokens
hash of a block served through adapter ``a`` uses the seed :func:`adapter_seed` ``(lora_int_id(a))``
instead of :data:`HASH_SEED` (Dynamo likewise offsets the seed by a hash of the adapter's name);
the chaining is unchanged. The adapter's integer id is a stable hash of its name
(:func:`lora_int_id`), the id the router sends ``trtllm-serve`` in ``lora_request.lora_int_id``
and the one TensorRT-LLM's KV events carry as ``lora_id``: an engine, the KV relay and the router
derive the same seed from what each of them sees.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import xxhash

HASH_SEED = 1337
"""Seed of every XXH3-64 computed here."""

_PAIR = struct.Struct("<QQ")
_U64 = (1 << 64) - 1
_LORA_ID_MASK = (1 << 31) - 1
_xxh3 = xxhash.xxh3_64_intdigest


def lora_int_id(name: str) -> int:
    """The integer id of the adapter called ``name``: a stable 31-bit hash of the name, so that every
    router replica, engine and relay agree on it without sharing a table (TensorRT-LLM keys its
    adapter caches by this id: ``LoRARequest.lora_int_id``)."""
    if not name:
        raise ValueError("an adapter name must not be empty")
    return _xxh3(name.encode(), seed=HASH_SEED) & _LORA_ID_MASK


def adapter_seed(lora_id: int | None) -> int:
    """The seed of the tokens hashes of blocks served through the adapter with integer id
    ``lora_id`` (:data:`HASH_SEED` for the base model, ``None``)."""
    if lora_id is None:
        return HASH_SEED
    return (HASH_SEED + lora_id) & _U64


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> memoryview:
    try:
        array = np.ascontiguousarray(tokens, dtype="<u4")
    except OverflowError as exc:
        raise ValueError(f"token ids must lie in [0, 2**32): {exc}") from exc
    return array.data.cast("B")  # no copy when ``tokens`` already is a uint32 array


def tokens_hashes(tokens: Sequence[int] | np.ndarray, *, block_size: int, seed: int = HASH_SEED) -> list[int]:
    """The tokens hash of every full block of ``tokens`` (``seed``: :func:`adapter_seed` of the
    adapter that serves them)."""
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be at least 1")
    view = _token_bytes(tokens)
    stride = block_size * 4
    full = len(view) // stride
    xxh3 = _xxh3
    return [xxh3(view[i : i + stride], seed=seed) for i in range(0, full * stride, stride)]


def chain_hash(parent: int | None, tokens_hash: int) -> int:
    """The block hash of a block with ``tokens_hash`` after a block whose block hash is ``parent``
    (``None`` for the first block of a sequence)."""
    if parent is None:
        return tokens_hash
    return _xxh3(_PAIR.pack(parent, tokens_hash), seed=HASH_SEED)


def chain_hashes(tokens_hashes: Sequence[int], *, parent: int | None = None) -> list[int]:
    """Block hashes of consecutive blocks with the given tokens hashes, after ``parent``."""
    out: list[int] = []
    for local in tokens_hashes:
        parent = chain_hash(parent, local)
        out.append(parent)
    return out


def hash_blocks(
    tokens: Sequence[int] | np.ndarray,
    *,
    block_size: int,
    parent: int | None = None,
    lora_id: int | None = None,
) -> tuple[list[int], list[int]]:
    """``(block hashes, tokens hashes)`` of every full block of ``tokens``, in one pass, served
    through the adapter with integer id ``lora_id`` (``None``: the base model)."""
    local = tokens_hashes(tokens, block_size=block_size, seed=adapter_seed(lora_id))
    chained: list[int] = []
    pack = _PAIR.pack
    xxh3 = _xxh3
    for value in local:
        parent = value if parent is None else xxh3(pack(parent, value), seed=HASH_SEED)
        chained.append(parent)
    return chained, local


def block_hashes(
    tokens: Sequence[int] | np.ndarray,
    *,
    block_size: int,
    parent: int | None = None,
    lora_id: int | None = None,
) -> list[int]:
    """Block hashes of every full block of ``tokens`` (the prefix identities a router matches on),
    served through the adapter with integer id ``lora_id`` (``None``: the base model)."""
    return hash_blocks(tokens, block_size=block_size, parent=parent, lora_id=lora_id)[0]
