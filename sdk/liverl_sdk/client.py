"""The feedback client: how a product's backend reports a user's judgement of a generation.

This package installs on its own (``pip install ./sdk``: pydantic, kafka-python and cryptography, none of the server's
dependencies)::

    from liverl_sdk import FeedbackClient

    with FeedbackClient("127.0.0.1:9092", "liverl.feedback") as fb:
        fid = fb.accept(generation_id)            # or fb.reject(...), fb.edit(generation_id, "fixed", edit_key=k)
        fb.flush()                                # block until the broker has it (acks=all)

``generation_id`` is what the gateway returned (``X-Liverl-Generation-Id`` header, or ``liverl.generation_id``
in the JSON body). Each call builds a ``FeedbackEvent`` with a fresh ``feedback_id`` (a uuid4 hex) unless you
pass one. Pass your own when you may retry: the ``feedback_id`` is the idempotency key, so a retried event
with the same id is counted and trained on once.

Wire format (any Kafka client can publish): topic ``<prefix>.feedback``, key = the generation id (UTF-8),
value = one JSON object (schema: ``liverl_sdk.wire.FeedbackEvent``, or ``liverl schema``)::

    {"schema_version": 1, "feedback_id": "f-123", "generation_id": "<id>", "kind": "accept",
     "edited_text": null, "segment": "free", "ts": 1760000000.0}

With kcat (use the Java client's murmur2 partitioner so the record lands on the same partition as its
generation record — librdkafka's default partitioner differs)::

    echo 'GEN_ID|{"feedback_id":"f-123","generation_id":"GEN_ID","kind":"reject"}' | \\
      kcat -P -b 127.0.0.1:9092 -t liverl.feedback -K '|' -X partitioner=murmur2_random

``kind`` is ``accept`` | ``reject`` | ``edit`` | ``revert``; an ``edit`` carries ``edited_text``, or
``edited_sealed``: the text sealed under the generation's edit key (``liverl_sdk.edits``), which the gateway returns
with each generation of a user it can forget (``X-Liverl-Edit-Key``, ``liverl.edit_key``). Seal it whenever there is
a key: a sealed edit becomes unreadable when liverl forgets the user. Invalid events are not lost: the ingest worker
dead-letters them to ``<prefix>.dead-letters`` with a reason.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Self

from kafka import KafkaProducer
from kafka.serializer import Serializer

from liverl_sdk.edits import seal_edit
from liverl_sdk.wire import EDIT_MAX_CHARS, FeedbackEvent, new_id

if TYPE_CHECKING:
    from kafka.producer.future import FutureRecordMetadata

DELIVERY_TIMEOUT_S = 60.0
"""How long a producer retries a record by default; the server's ``broker.delivery_timeout_s`` has the same default."""

PRODUCER_ORDER = """Why no producer liverl builds is idempotent: Tansu's object-store engine (the embedded broker)
writes an idempotent producer's next sequence number before the record batch. A broker killed between the two comes back
with the sequence counted and the batch missing; the producer retries the batch with the same sequence, the broker
answers DUPLICATE_SEQUENCE_NUMBER, and every Kafka client takes that as "already written": the record is acknowledged
and lost (``tests/liverl/test_broker_crash.py``, found by ``pytest -m chaos``). Without idempotence the retry is written
again. A retry after a lost acknowledgement may then write a record twice, which every consumer absorbs by the key it
already dedupes on (``feedback_id``, ``generation_id``, ``sample_id``). One request in flight per connection keeps a
producer's records in order across retries, as idempotence would."""


class KeySerializer(Serializer):
    """Keys are generation ids (str); bytes pass through. kafka-python 3 calls ``serialize(topic, headers, key)``."""

    def serialize(self, topic, headers, key):
        return key.encode() if isinstance(key, str) else key


def producer_options(
    bootstrap: str, delivery_timeout_s: float = DELIVERY_TIMEOUT_S, security: dict[str, Any] | None = None, **kw: Any
) -> dict[str, Any]:
    """kafka-python's options for every producer liverl builds, the SDK's and the server's: acks=all, values bytes and
    keys str (uncompressed: every consumer reads it), a record given up after ``delivery_timeout_s``; not idempotent,
    one request in flight (``PRODUCER_ORDER`` says why). ``security``: kafka-python's TLS/SASL keyword arguments."""
    opts: dict[str, Any] = dict(
        bootstrap_servers=bootstrap,
        acks="all",
        enable_idempotence=False,
        max_in_flight_requests_per_connection=1,
        linger_ms=5,
        delivery_timeout_ms=int(delivery_timeout_s * 1000),
        key_serializer=KeySerializer(),
        **(security or {}),
    )
    opts.update(kw)
    opts.setdefault("request_timeout_ms", min(30_000, opts["delivery_timeout_ms"] - opts["linger_ms"]))
    return opts


class DeliveryError(RuntimeError):
    """Events the broker did not acknowledge; ``failed`` holds ``(feedback_id or key, exception)`` pairs."""

    def __init__(self, failed: list[tuple[str | None, BaseException]]):
        first = failed[0]
        super().__init__(
            f"{len(failed)} feedback event(s) were not delivered (first: {first[0]}: {first[1]!r}); "
            "send them again with the same feedback_id"
        )
        self.failed = failed


class FeedbackClient:
    """A thread-safe feedback publisher (kafka-python; acks=all, in order, at least once: a retry may write an event
    twice, and ingest counts it once by ``feedback_id``).

    ``send``/``accept``/... return once the event is buffered (blocking at most ``max_block_ms``, 5 s by default,
    when the buffer is full or the broker is unknown); ``flush()`` blocks until every event is acknowledged and
    raises ``DeliveryError`` naming the events the broker did not take, so nothing is lost silently. Resending an
    event with the same ``feedback_id`` is safe.
    """

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        *,
        security: dict[str, Any] | None = None,
        delivery_timeout_s: float = DELIVERY_TIMEOUT_S,
        **producer_kw: Any,
    ):
        if not bootstrap or not isinstance(bootstrap, str):
            raise ValueError(f"bootstrap must be 'host:port[,host:port]', got {bootstrap!r}")
        if not topic or not isinstance(topic, str):
            raise ValueError(f"topic must be the feedback topic name (cfg.topics.feedback), got {topic!r}")
        self.topic = topic
        producer_kw.setdefault("max_block_ms", 5000)
        self._producer: KafkaProducer | None = KafkaProducer(
            **producer_options(bootstrap, delivery_timeout_s, security, **producer_kw)
        )
        self._lock = threading.Lock()
        self._failed: list[tuple[str | None, BaseException]] = []

    # -- typed events ------------------------------------------------------------------------------

    def send(self, event: FeedbackEvent) -> FutureRecordMetadata:
        """Publish one event, keyed by its generation id; returns kafka-python's future of the record."""
        if not isinstance(event, FeedbackEvent):
            raise TypeError(f"send() takes a FeedbackEvent, got {type(event).__name__}; use send_raw() for bytes")
        return self._track(
            self._live().send(self.topic, key=event.generation_id, value=event.to_bytes()), event.feedback_id
        )

    def _track(self, fut: FutureRecordMetadata, name: str | None) -> FutureRecordMetadata:
        def failed(exc: BaseException) -> None:
            with self._lock:
                self._failed.append((name, exc))

        fut.add_errback(failed)
        return fut

    def _judge(
        self,
        generation_id: str,
        kind: str,
        *,
        edited_text: str | None = None,
        edited_sealed: str | None = None,
        segment: str | None = None,
        feedback_id: str | None = None,
        ts: float | None = None,
    ) -> str:
        fields: dict[str, Any] = {
            "feedback_id": feedback_id or new_id(),
            "generation_id": generation_id,
            "kind": kind,
            "edited_text": edited_text,
            "edited_sealed": edited_sealed,
            "segment": segment,
        }
        if ts is not None:
            fields["ts"] = ts
        event = FeedbackEvent(**fields)  # pydantic ValidationError (a ValueError) names the bad field
        self.send(event)
        return event.feedback_id

    def accept(
        self, generation_id: str, segment: str | None = None, feedback_id: str | None = None, ts: float | None = None
    ) -> str:
        """The user accepted the generation. Returns the feedback_id."""
        return self._judge(generation_id, "accept", segment=segment, feedback_id=feedback_id, ts=ts)

    def reject(
        self, generation_id: str, segment: str | None = None, feedback_id: str | None = None, ts: float | None = None
    ) -> str:
        """The user rejected (dismissed) the generation. Returns the feedback_id."""
        return self._judge(generation_id, "reject", segment=segment, feedback_id=feedback_id, ts=ts)

    def revert(
        self, generation_id: str, segment: str | None = None, feedback_id: str | None = None, ts: float | None = None
    ) -> str:
        """Later, the user undid or rewrote a generation they had accepted (what a product sees after the fact:
        the change was reverted, the answer replaced). Counted per version (the kept rate the gate guards); it
        trains nothing by itself. Returns the feedback_id."""
        return self._judge(generation_id, "revert", segment=segment, feedback_id=feedback_id, ts=ts)

    def edit(
        self,
        generation_id: str,
        edited_text: str,
        segment: str | None = None,
        feedback_id: str | None = None,
        ts: float | None = None,
        edit_key: str | None = None,
    ) -> str:
        """The user kept the generation after correcting it to ``edited_text``. Returns the feedback_id.

        ``edit_key``: the generation's edit key, as the gateway returned it (``X-Liverl-Edit-Key``, or
        ``liverl.edit_key`` in the body). Pass it whenever the gateway gave one: the edit is then sealed under it
        (``liverl_sdk.edits``) and unreadable once liverl forgets the user; without it the text travels and stays in
        the feedback topic in the clear until the topic's retention."""
        if not isinstance(edited_text, str):
            raise TypeError(f"edited_text must be a str, got {type(edited_text).__name__}")
        if edit_key is None:
            return self._judge(
                generation_id, "edit", edited_text=edited_text, segment=segment, feedback_id=feedback_id, ts=ts
            )
        if len(edited_text) > EDIT_MAX_CHARS:  # (checked before sealing: the sealed length only bounds it)
            raise ValueError(f"edited_text has {len(edited_text)} characters, at most {EDIT_MAX_CHARS}")
        sealed = seal_edit(edit_key, generation_id, edited_text)
        return self._judge(generation_id, "edit", edited_sealed=sealed, segment=segment, feedback_id=feedback_id, ts=ts)

    # -- raw ---------------------------------------------------------------------------------------

    def send_raw(self, value: bytes, key: str | None = None) -> FutureRecordMetadata:
        """Publish arbitrary bytes, unvalidated (tests, and the simulator's bad-input injection)."""
        if not isinstance(value, (bytes, bytearray)):
            raise TypeError(f"send_raw() takes bytes, got {type(value).__name__}")
        if key is not None and not isinstance(key, str):
            raise TypeError(f"key must be a str or None, got {type(key).__name__}")
        return self._track(self._live().send(self.topic, key=key, value=bytes(value)), key)

    def _live(self):
        if self._producer is None:
            raise RuntimeError("this FeedbackClient is closed; create a new one")
        return self._producer

    # -- lifecycle ---------------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> None:
        """Block until every buffered event is acknowledged by the broker (acks=all); raises ``DeliveryError`` for
        the events that failed since the last ``flush``."""
        self._live().flush(timeout=timeout)
        with self._lock:
            failed, self._failed = self._failed, []
        if failed:
            raise DeliveryError(failed)

    def close(self, timeout: float | None = 10.0) -> None:
        """Flush (raising ``DeliveryError`` for undelivered events), then stop the producer's I/O thread. Idempotent."""
        if self._producer is not None:
            try:
                self.flush(timeout=timeout)
            finally:
                self._producer.close(timeout=timeout)
                self._producer = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
