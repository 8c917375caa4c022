"""Kafka's default partitioner (murmur2 of the key), as the Java client, aiokafka and kafka-python compute it.

The join needs a generation and its feedback on the same partition, and the changelog partitioned like the inputs:
ingest computes the partition of every generation id it reads (to refuse misplaced input) and of every table change
it writes, so the hash is done in bulk (numpy) and cached.
"""

from __future__ import annotations

import struct
from typing import cast

import numpy as np

_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (org.apache.kafka.common.utils.Utils.murmur2), as aiokafka and kafka-python compute it, in half
    their time: four bytes at a time from one ``struct`` call (tests/ingest/test_bounds.py checks it against both)."""
    n = len(data)
    h = (0x9747B28C ^ n) & _MASK
    n4 = n >> 2
    if n4:
        for k in struct.unpack_from(f"<{n4}I", data):
            k = (k * _M) & _MASK
            k ^= k >> 24
            h = ((h * _M) & _MASK) ^ ((k * _M) & _MASK)
    rest = n & 3
    if rest:
        tail = n & ~3
        if rest >= 3:
            h ^= data[tail + 2] << 16
        if rest >= 2:
            h ^= data[tail + 1] << 8
        h = ((h ^ data[tail]) * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    return h ^ (h >> 15)


def murmur2_many(keys: list[bytes]) -> list[int]:
    """``murmur2`` of many keys at once: numpy over the keys of each length, a fiftieth of the per-key time on a
    batch (the worker hashes every new generation id it reads). tests/ingest/test_bounds.py checks it against
    ``murmur2``."""
    m = np.uint32(_M)
    out = [0] * len(keys)
    by_len: dict[int, list[int]] = {}
    for i, key in enumerate(keys):
        by_len.setdefault(len(key), []).append(i)
    for n, idx in by_len.items():
        h = np.full(len(idx), (0x9747B28C ^ n) & _MASK, dtype=np.uint32)
        if n:
            rows = np.frombuffer(b"".join([keys[i] for i in idx]), dtype=np.uint8).reshape(len(idx), n)
            n4 = n >> 2
            if n4:
                words = np.ascontiguousarray(rows[:, : n4 * 4]).view("<u4")
                for j in range(n4):
                    k = words[:, j] * m
                    k ^= k >> np.uint32(24)
                    k *= m
                    h *= m
                    h ^= k
            rest, tail = n & 3, n & ~3
            if rest:
                if rest >= 3:
                    h ^= rows[:, tail + 2].astype(np.uint32) << np.uint32(16)
                if rest >= 2:
                    h ^= rows[:, tail + 1].astype(np.uint32) << np.uint32(8)
                h ^= rows[:, tail].astype(np.uint32)
                h *= m
        h ^= h >> np.uint32(13)
        h *= m
        h ^= h >> np.uint32(15)
        for i, v in zip(idx, h.tolist(), strict=True):
            out[i] = v
    return out


_HASHES: dict[bytes, int] = {}  # murmur2 is pure Python (~3 us); a batch asks for the same keys several times
_HASHES_OLD: dict[
    bytes, int
] = {}  # the previous generation of the cache: a key hashed just before it filled still hits
_HASHES_MAX = 65_536  # keys per generation (two generations)


def _cached_hash(key: bytes) -> int | None:
    h = _HASHES.get(key)
    return _HASHES_OLD.get(key) if h is None else h


def _new_generation() -> None:
    global _HASHES, _HASHES_OLD
    _HASHES_OLD, _HASHES = _HASHES, {}


def partition_of(key: bytes, partitions: int) -> int:
    """The partition Kafka's default (murmur2) partitioner gives ``key``: Java client, aiokafka, kafka-python."""
    h = _HASHES.get(key)
    if h is None:
        h = _HASHES_OLD.get(key)
        if h is None:
            if len(_HASHES) >= _HASHES_MAX:
                _new_generation()
            h = _HASHES[key] = murmur2(key) & 0x7FFFFFFF
    return h % partitions


def partitions_of(keys: list[bytes], partitions: int) -> list[int]:
    """``partition_of`` of many keys: cached ones looked up in place, the rest hashed at once (``murmur2_many``)."""
    cur = _HASHES
    hashes = [cur.get(k) for k in keys]
    if None not in hashes:
        return [h % partitions for h in cast("list[int]", hashes)]  # every key cached: no None in the list
    warm_hashes([k for k, h in zip(keys, hashes, strict=True) if h is None])
    return [h % partitions if h is not None else partition_of(k, partitions) for k, h in zip(keys, hashes, strict=True)]


def warm_hashes(keys: list[bytes]) -> None:
    """Put the hashes of many keys in the partitioner's cache in one pass (``murmur2_many``)."""
    todo = list({k for k in keys if _cached_hash(k) is None})
    if len(todo) < 64:  # the per-key path is as fast for a few
        return
    todo = todo[:_HASHES_MAX]
    if len(_HASHES) + len(todo) > _HASHES_MAX:
        _new_generation()
    for k, h in zip(todo, murmur2_many(todo), strict=True):
        _HASHES[k] = h & 0x7FFFFFFF
