"""ingest: join live feedback with the generation it judges, shape a reward, emit one training sample per judgement.

Read this page first; each module below holds one idea and says the rest.

Inputs, both keyed by ``generation_id`` (co-partitioned, Kafka's murmur2): ``<prefix>.generations`` (the gateway logs
every generation) and ``<prefix>.feedback`` (accept / reject / edit / revert). Outputs: ``<prefix>.samples`` (the
learner's), ``<prefix>.heldout`` (a fixed hash-share, the gate's), ``<prefix>.dead-letters`` (every refused input,
with why), the live counters in Redis, and the join table's changelog ``<prefix>-ingest-join-changelog``.

One event's path, a batch at a time (``app.IngestWorker``, the poll loop; Kafka Streams' StreamThread):

1. **poll**: ``getmany`` returns up to ``BATCH_MAX`` records of the assigned partitions of both inputs.
2. **pace** (``pacing.Pacer``; Kafka Streams' timestamp sync): feedback more than a second ahead of the generations
   read on its partition is held back (not lost: handed to a later batch, its offset not committed).
3. **decide** (``join.Ingest.decide_some``, plain calls; the rules are ``decide``'s): each event against the table
   entry of its generation id (``entry``: waiting ``W``, pending ``P``, judged ``J``), giving table writes, samples and
   dead letters (a ``batch.Batch``).
4. **send** (``outbox.Outbox``): the batch's samples and dead letters leave as one record batch per partition.
5. **acknowledge**: the broker has them (``Ingest.acknowledged``).
6. **count**: the batch's counters go to Redis, the live counters exactly once per ``feedback_id``
   (``metrics``, a Lua script with a guard key).
7. **buffer**: once the batch before it has settled, its table writes join the table's write buffer
   (``table.JoinTable``; Kafka Streams' record cache).
8. **flush, then commit**: about once a second the buffer goes to the changelog, is acknowledged, then to the
   partition databases with the changelog offset in the same atomic write (``store``); only then are the input
   offsets of the batches it holds committed.

Steps 4-8 run in the background while the next batch is decided (``commit.Committer``, ``SETTLING_MAX`` batches at
most), in order. Rebalances (``tasks.Tasks``): settle and commit on a revocation, restore on an assignment.
``join.Ingest`` holds the join's state; the others see only what they need of it, given at construction: the
committer its three settling methods (``batch.Settle``), the pacer ``generations_read``, the rebalance listener
``revoked`` and ``restore``.

Three ordering invariants, and why each holds across a kill -9:

- **Output before state.** The table says "judged" only after the broker has the judgement's sample (5 before 7).
  Killed in between, the table still says waiting or pending, the uncommitted input is replayed and joins again; the
  learner refuses the second sample by ``sample_id``. Killed after, the replayed input finds "judged": a duplicate.
- **State before offsets.** An input offset is committed only after the changelog has the table writes it caused
  (8). Killed before the commit, the input is replayed; whatever part of its writes reached the changelog is
  idempotent to replay (the same entry again). Nothing is committed that the table could lose.
- **Changelog before database.** A database writes a change together with the changelog offset it reaches, without
  a write-ahead log (``store``). Killed before RocksDB flushed, the database reopens at an earlier offset and
  ``restore`` reads the changelog from there; a database ahead of its changelog is from another broker history
  and is read again from the start.

Bounded at volume: after an assignment the worker reads the changelog's tail only (``restore``, in chunks), then the
pending feedback from its own index (``store``: O(pending), never the whole table). The expiry timer reads an index
ordered by time, visiting only the entries due; a judged accept keeps its sample ``revert_sample_ttl_s``, then only
the judgement. tests/ingest/test_volume.py counts both.

A generation whose tokens more than one version sampled (a hot-swap mid-generation, ``GenerationRecord.mixed_versions``)
trains, but counts for no version: not in the live counters or the per-user sums the canary reads (``mixed_versions``).

Modules: ``app`` (the poll loop, batches, timers), ``pacing`` (input pacing), ``commit`` (settling, the write buffer,
the offset commit), ``tasks`` (task assignment: rebalances, the state folder's lock), ``join`` (the join's state and
its one door, ``Ingest``: Kafka-free, no callbacks, an ``Output`` to send to, values in; the entry kinds), ``decide``
(the per-event decisions: generation, feedback, revert), ``pending`` (the pending index and the generations read, the
pending sweep's rules), ``batch`` (a decided batch, its output and acknowledgement, ``Settle``, ``InfraError``),
``evict`` (the table's TTLs), ``records`` (samples, dead letters), ``entry`` (an entry's bytes), ``table`` (write
buffer and flush), ``store`` (a partition's database and its indexes), ``restore`` (changelog to database),
``outbox`` (batched produce), ``partitioner`` (murmur2), ``metrics`` (Prometheus and Redis), ``web`` (/metrics,
/healthz), ``worker`` (the process entry point). The product's feedback client is ``liverl_sdk`` (``sdk/``), installable
on its own.
"""
