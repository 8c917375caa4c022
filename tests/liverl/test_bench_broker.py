"""``liverl bench broker``: each batcher setting runs on its own broker, and every acknowledged record is read back
with the bytes it was sent with."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from liverl.bench.broker import _Reader, _record, storage_url
from liverl.cli import main


def test_a_batcher_setting_becomes_the_brokers_storage_url_and_a_bad_one_is_refused():
    assert storage_url("liverl", "off", 1024) == "s3://liverl/"
    assert storage_url("liverl", "20ms", 1024) == "s3://liverl/?batch_min_size=1024&batch_max_delay=20ms"
    for bad in ("20", "fast", "ms", "-5ms"):
        with pytest.raises(ValueError, match="delay in milliseconds"):
            storage_url("liverl", bad, 1024)


def test_the_bench_consumes_every_acknowledged_record_with_and_without_the_batcher(tmp_path, capsys):
    out = tmp_path / "rows.json"
    rc = main(
        ["bench", "broker", "--settings", "off,10ms", "--seconds", "3", "--rate", "40", "--producers", "4"]
        + ["--partitions", "2", "--json", str(out)]
    )
    assert rc == 0
    rows = json.loads(out.read_text())
    assert [r["setting"] for r in rows] == ["off", "10ms"]
    for r in rows:
        assert r["acked"] > 0 and r["failed"] == 0
        assert r["consumed"] == r["acked"]  # nothing acknowledged is lost, nothing read twice by the one member
        assert r["intact"] == r["acked"] and r["corrupt"] == r["duplicates"] == 0 and r["read_error"] is None
        assert r["puts_per_1k"] >= 1000  # every record's batch is at least one object
    assert "| batcher |" in capsys.readouterr().out


def test_the_reader_tells_a_changed_byte_a_record_read_twice_and_a_record_the_client_refuses():
    pad = bytes(100)
    good = [_record(1.0, 0, i, pad) for i in (1, 2)]
    flipped = bytearray(_record(1.0, 1, 1, pad))
    flipped[-1] ^= 1  # one bit of the padding, after the digest was taken

    class Consumer:
        def __init__(self, polls):
            self.polls = polls

        def poll(self, timeout_ms):
            p = self.polls.pop(0)
            if isinstance(p, Exception):
                raise p
            return {"tp": [SimpleNamespace(value=v) for v in p]}

    reader = _Reader()
    consumer = Consumer([[*good, bytes(flipped)], [good[0]], ValueError("CRC mismatch"), [good[1]]])
    for _ in range(4):
        reader.poll(consumer)
    assert (reader.got, len(reader.seen), reader.corrupt, reader.duplicates) == (4, 2, 1, 1)
    assert reader.error == "ValueError: CRC mismatch"  # and nothing read after it
