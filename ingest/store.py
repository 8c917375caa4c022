"""The join table's on-disk store: faust's RocksDB store (rocksdict), one database per partition, keyed the way the
changelog is partitioned.

Why a subclass: faust's store puts a key written by the stream into the database of the *current event's*
partition, and refuses writes made outside an event (the timers expire entries). The join table uses
the producer's partitioner (``use_partitioner=True``: murmur2 of the generation id, the same function the
generation and feedback producers use), so the database of a key is computed from the key, the same way its
changelog partition is. A restart then opens the databases under ``<state_dir>/faust`` and reads only the
changelog written after the offset each database last stored, instead of the whole changelog.
"""

from __future__ import annotations

from typing import Any

from aiokafka.partitioner import murmur2
from faust.stores import STORES
from faust.stores.rocksdb import Store as _RocksDBStore

SCHEME = "liverlrocksdb"


def partition_of(key: bytes, partitions: int) -> int:
    """The partition Kafka's default (murmur2) partitioner gives ``key``: Java client, aiokafka, kafka-python."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


class KeyPartitionedStore(_RocksDBStore):
    """RocksDB store whose key -> partition database mapping is the changelog's partitioner."""

    def _partition(self, key: bytes) -> int:
        return partition_of(key, self.table.partitions or self.app.conf.topic_partitions)

    def _set(self, key: bytes, value: Any) -> None:
        partition = self._partition(key)
        self._key_index[key] = partition
        self._db_for_partition(partition).put(key, value)

    def _get(self, key: bytes) -> bytes | None:
        db = self._dbs.get(self._partition(key))
        return None if db is None else db.get(key)

    def _contains(self, key: bytes) -> bool:
        return self._get(key) is not None

    def _del(self, key: bytes) -> None:
        db = self._dbs.get(self._partition(key))
        if db is not None:
            db.delete(key)


def register() -> str:
    """Make ``liverlrocksdb://`` a faust store URL; returns the scheme."""
    STORES.aliases.setdefault(SCHEME, f"{__name__}:KeyPartitionedStore")
    return SCHEME
