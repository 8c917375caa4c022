"""The gateway's generation log: one ``GenerationRecord`` per choice, published to the generations topic.

Each record is keyed by its generation id and carries the policy version that sampled it, or, for a request a
hot-swap overlapped, the node's per-token version spans (``version_spans``; unreadable spans make it untrainable,
``version_unknown``). The broker's acks are counted, and the response waits for them at most ``serving.log_wait_s``.

A record over ``ingest.max_event_bytes`` (a long completion: its token ids and log-probs come to about 32 bytes a
token) would be logged, then refused by ingest unparsed, and its feedback would expire as ``unknown_generation``: long
answers would silently never count nor train. Such a record is logged without its text, token ids and log-probs,
untrainable with reason ``too_large`` and its length in ``completion_tokens``: ingest joins its feedback, counts the
judgement for its version (the canary's arms, at its true length) and counts the sample it cannot make
(``drop:too_large``).

A record with a unit (the request named its user) is sealed under the user's data key (``core.shred``) before it is
logged, when the node has the deployment's key-encryption key (``security.shred_key``): the topic, ingest's join
store and everything downstream hold only the sealed text, which destroying the key makes unreadable. The keys come
from a bounded in-process cache (``KeyCache``): the registry is read once per user per ``KEY_TTL_S``. A key the cache
holds seals the record at once; any other is read on a thread of the log's own (the event loop never waits on the
database), and the record is held until its key comes: while the registry's database does not answer, for at most
``hold_s`` (``record_hold_s``: the slack ingest's ``pending_ttl_s`` leaves beyond the producer's delivery timeout, so
the feedback on it still waits when it is logged) and at most ``serving.log_hold_max`` records at once. A record that
cannot be sealed then is not logged (counted as a log failure, its feedback dead-lettered ``unknown_generation``),
never logged in plain text. A sealed record also holds its edit key (``liverl_sdk.edits``: the key the gateway gave
the client to seal the user's edit under), so that the edit in the feedback topic is forgotten with the record.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import sqlalchemy as sa

from core.config import DELIVERY_MARGIN_S, LiverlConfig
from core.schemas import GenerationRecord
from core.shred import KeyCache, seal_record
from serving.node import openai_api as oa
from serving.node.gateway_metrics import GatewayMetrics
from serving.node.producer import AsyncProducer

log = logging.getLogger("liverl.serving.gateway")


def mixed(spans: list[list[int]] | None) -> bool:
    """Whether a choice's version spans name more than one version."""
    return spans is not None and len({v for v, _, _ in spans}) > 1


def first_version(spans: list[list[int]] | None, default: int) -> int:
    return spans[0][0] if spans else default


def too_large(record: GenerationRecord) -> GenerationRecord:
    """``record`` without its text, token ids and log-probs: untrainable (``too_large``), its length kept in
    ``completion_tokens``."""
    return GenerationRecord.model_validate(
        {
            **record.model_dump(),
            "prompt": "",
            "completion": "",
            "prompt_token_ids": [],
            "completion_token_ids": [],
            "completion_logprobs": [],
            "routed_experts": None,
            "sealed": None,
            "version_spans": None if record.version_spans is None else [],  # mixed or unknown: no version claims it
            "trainable": False,
            "untrainable_reason": "too_large",
            "completion_tokens": len(record.completion_logprobs),  # (one a token; a sealed record has no ids)
        }
    )


KEY_THREADS = 4
"""Threads that read users' keys from the registry (a read that waits on a cut-off database holds one)."""
KEY_RETRY_S = 1.0
"""The least wait between two tries at a held record's key."""


def record_hold_s(cfg: LiverlConfig) -> float:
    """How long a record may wait for its user's key: what ``ingest.pending_ttl_s`` leaves beyond
    ``broker.delivery_timeout_s`` and its margin (the config's check), so feedback on it is still waiting when the
    producer delivers it at the latest."""
    delivery = cfg.broker.delivery_timeout_s
    return max(0.0, cfg.ingest.pending_ttl_s - delivery - min(DELIVERY_MARGIN_S, delivery))


class GenerationLog:
    """Publishes the records of one gateway (``node_name``) through its started producer."""

    def __init__(
        self,
        producer: AsyncProducer,
        topic: str,
        node_name: str,
        max_model_len: int,
        metrics: GatewayMetrics,
        wait_s: float,
        max_bytes: int | None = None,
        keys: KeyCache | None = None,
        hold_s: float = 0.0,
        hold_max: int = 10000,
    ):
        self.producer, self.topic, self.node_name = producer, topic, node_name
        self.keys = keys  # users' data keys: a record with a unit is sealed (None: no key-encryption key)
        self.hold_s, self.hold_max = hold_s, hold_max  # a record waits this long for its key, this many at once
        self._held: set[asyncio.Task] = set()
        self._next_warn = 0.0
        self._key_pool = ThreadPoolExecutor(KEY_THREADS, thread_name_prefix="liverl-keys") if keys else None
        self.max_bytes = max_bytes  # ingest.max_event_bytes: a larger record is logged without its token lists
        self.max_model_len = max_model_len  # the node's context length: a record's max_tokens when none was asked
        self.metrics = metrics
        self.wait_s = wait_s  # serving.log_wait_s

    def log(
        self,
        req: oa._GenerationRequest,
        choice: oa.Choice | None,
        generation_id: str,
        version: int,
        latency_s: float | None = None,
        unit: str | None = None,
        crossed: bool = False,
        spans: list[list[int]] | None = None,
        routed_experts: str | None = None,
        edit_key: str | None = None,
    ) -> asyncio.Future | None:
        """Publish one generation's record (``unit``: the user's ``fleet.unit_id``; ``crossed``: the request overlapped
        a swap, and ``spans`` are this choice's version spans read from the node, None when they could not be read;
        ``routed_experts``: its routing, ``serving.node.gateway_routing``; ``edit_key``: the key the gateway gave the
        client for this choice's edit, sealed into the record with its text, ``liverl_sdk.edits``);
        returns the broker's ack, or for a record waiting for its user's key a future that settles when the broker
        has it or it was given up on (None when it could not even be queued)."""
        m = self.metrics
        try:
            if choice is None:
                raise ValueError("the node's response has no such choice")
            reason = req.untrainable_reason()
            version_spans = None
            if crossed:
                version_spans = spans
                if version_spans is None:  # not read: no version may claim it, and the learner skips it
                    version_spans, reason = [], reason or "version_unknown"
                    m.m_mixed.labels(spans="unknown").inc()
                elif mixed(version_spans):
                    m.m_mixed.labels(spans="read").inc()
                    version = version_spans[0][0]
                else:
                    version, version_spans = first_version(version_spans, version), None
            record = GenerationRecord(
                generation_id=generation_id,
                policy_version=version,
                version_spans=version_spans,
                node=self.node_name,
                prompt=choice.prompt,
                completion="".join(choice.text),
                prompt_token_ids=choice.prompt_token_ids,
                completion_token_ids=choice.token_ids,
                completion_logprobs=choice.logprobs,
                sampling=req.sampling(req.max_tokens_for(self.max_model_len, len(choice.prompt_token_ids))),
                finish_reason=choice.finish_reason,
                trainable=reason is None,
                untrainable_reason=reason,
                latency_s=latency_s,
                unit=unit,
                routed_experts=routed_experts,
            )
            if unit is not None and self.keys is not None:
                key = self.keys.peek(unit)
                if key is None:  # read on a thread; the record waits for it
                    return self._hold(record, reason, edit_key)
                record = seal_record(key, record, edit_key)
            return self._produce(record, reason)
        # a malformed node response, or Kafka refused: count, serve
        except (ValueError, TypeError, BufferError) as e:
            m.m_log_fail.inc()
            log.error("generation %s not logged: %s", generation_id, e)
            return None

    def _produce(self, record: GenerationRecord, reason: str | None) -> asyncio.Future:
        """Queue ``record`` (sealed where it must be); its ack. Raises what ``AsyncProducer.produce`` raises."""
        generation_id = record.generation_id
        raw = record.to_bytes()
        if self.max_bytes is not None and len(raw) > self.max_bytes:
            log.warning(
                "generation %s: its record is %d bytes, over ingest.max_event_bytes %d: logged without its text, "
                "token ids and log-probs (untrainable: too_large)",
                generation_id,
                len(raw),
                self.max_bytes,
            )
            reason = "too_large"
            raw = too_large(record).to_bytes()
        ack = self.producer.produce(self.topic, generation_id, raw)
        if reason is not None:
            self.metrics.m_untrainable.labels(reason=reason).inc()
        ack.add_done_callback(self._on_ack)
        return ack

    def _hold(self, record: GenerationRecord, reason: str | None, edit_key: str | None) -> asyncio.Future | None:
        """Hold ``record`` until its user's key is read (``_seal_and_produce``); a future that settles when the
        broker has it or it was given up on (None: too many held already, not logged)."""
        if len(self._held) >= self.hold_max:
            self.metrics.m_log_fail.inc()
            log.error(
                "generation %s not logged: the key of unit %s is not at hand and serving.log_hold_max (%d) records "
                "already wait for theirs",
                record.generation_id,
                record.unit,
                self.hold_max,
            )
            return None
        done = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._seal_and_produce(record, reason, edit_key, done), name="liverl-log-held")
        self._held.add(task)
        task.add_done_callback(self._held.discard)
        self.metrics.m_log_held.set(len(self._held))
        task.add_done_callback(lambda _t: self.metrics.m_log_held.set(len(self._held)))
        return done

    async def _seal_and_produce(
        self, record: GenerationRecord, reason: str | None, edit_key: str | None, done: asyncio.Future
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.hold_s
        assert self.keys is not None and record.unit is not None
        try:
            while True:
                try:
                    key = await loop.run_in_executor(self._key_pool, self.keys.get, record.unit)
                    break
                except sa.exc.SQLAlchemyError as e:
                    wait = max(KEY_RETRY_S, self.keys.retry_in())
                    if loop.time() + wait > deadline:
                        raise
                    if loop.time() >= self._next_warn:  # once a minute, not once a record
                        self._next_warn = loop.time() + 60
                        log.warning(
                            "%d generation record(s) wait for their users' keys (%s); asking again in %.0f s",
                            len(self._held),
                            e,
                            wait,
                        )
                    await asyncio.sleep(wait)
            ack = self._produce(seal_record(key, record, edit_key), reason)
        except (ValueError, TypeError, BufferError, sa.exc.SQLAlchemyError) as e:
            self.metrics.m_log_fail.inc()
            log.error("generation %s not logged: %s", record.generation_id, e)
            done.set_result(None)
            return
        ack.add_done_callback(lambda _f: done.done() or done.set_result(None))

    async def close(self, timeout_s: float) -> None:
        """Wait for the held records (at most ``timeout_s``); those still waiting for a key are not logged."""
        held = list(self._held)
        if held:
            _, late = await asyncio.wait(held, timeout=timeout_s)
            for t in late:
                t.cancel()
            await asyncio.gather(*late, return_exceptions=True)
            if late:
                self.metrics.m_log_fail.inc(len(late))
                log.error("%d generation records still waited for their users' keys at shutdown: not logged", len(late))
        if self._key_pool is not None:
            self._key_pool.shutdown(wait=False, cancel_futures=True)

    def _on_ack(self, fut: asyncio.Future) -> None:
        if fut.cancelled() or fut.exception() is not None:
            self.metrics.m_log_fail.inc()
            log.error(
                "generation record not acknowledged by Kafka: %s", "cancelled" if fut.cancelled() else fut.exception()
            )
        else:
            self.metrics.m_logged.inc()

    async def wait_acks(self, acks: list[asyncio.Future | None]) -> None:
        """Wait for the records' acks, at most ``wait_s`` (0: not at all); the responses sent before are counted."""
        if self.wait_s > 0:
            self.metrics.m_log_slow.inc(await self.producer.wait([a for a in acks if a is not None], self.wait_s))
