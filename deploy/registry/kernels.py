"""Per-element kernels of the base-conditioned delta coder (numba; called by ``deploy.registry.delta``).

The model. Every receiver already holds one end of the delta (the base, or the target when rolling back),
and whether a float element changes depends on its exponent: an update survives rounding only when it
is larger than about half an ulp, and the ulp doubles with each exponent step. So elements are grouped by
their exponent field, read from the end the decoder holds, and each group gets its own statistics:

- **Which elements changed**: per group, the number of changes ``k_g`` among its ``n_g`` elements (Elias
  gamma), then the gaps between changes inside the group (Rice codes, parameter from ``n_g`` and ``k_g``,
  which both sides know). A group where most elements changed codes the gaps between *unchanged* ones.
- **How they changed**: the difference of the two ends on the ordered-integer line (float bits mapped to a
  monotone integer; -0 and +0 are neighbours, NaN payloads and infinities are just integers), zigzagged,
  Rice-coded with one parameter per group. A one-ulp step costs about one and a half bits.
- **Inversion**: the grouping must come out the same from either end, so elements whose exponent differs
  between the ends (the rare crossings of a power of two) are coded first, apart, by position; every other
  element has the same exponent at both ends. The difference is added going forward and subtracted going
  back, so one delta takes A to B and B to A.

Codes go into one stream per chunk (layout in ``cond_encode``), in the order a single forward scan of the
chunk reads them, so decoding is one pass over the elements (small chunks add a histogram pass; big ones
carry their group sizes). Rice quotients longer than ``LIMIT`` escape to a fixed-width field, so no code
is ever longer than about 70 bits. The decoders are written for data
that already passed the container's checksum, yet they never read or write outside their arrays and
report inconsistent streams as an error code rather than crashing.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# The small helpers below are plain @njit functions: numba links them into their callers, where LLVM inlines them.
# Inlining them at numba's IR level (inline="always") as well compiled the kernels in 195 s instead of 30 s and coded
# no faster (liverl bench delta, 0.25 GiB, alternated rounds; BENCHMARKS.md).

LIMIT = 24  # Rice quotient at or above which a code escapes to a fixed-width field
GAP_BITS = 32  # fixed width of an escaped gap (chunks hold fewer than 2**31 elements)
BIG_CHUNK = 1 << 16  # chunks of at least this many elements carry their group sizes in the stream

# error codes returned by the decoders (negative), turned into DeltaError messages by deploy.registry.delta
E_TRUNCATED, E_POSITION, E_COUNTS, E_TRAILING = -1, -2, -3, -4


# ------------------------------------------------------------------------------------------------ bit I/O
# The writer/reader state lives in a small uint64 array: [accumulator, bits in accumulator, byte position].
@njit
def _put(buf, st, value, nbits):
    """Append the low ``nbits`` (<= 32) of ``value``, least significant bit first."""
    if nbits == 0:
        return
    acc = st[0] | ((np.uint64(value) & ((np.uint64(1) << np.uint64(nbits)) - np.uint64(1))) << st[1])
    fill = st[1] + np.uint64(nbits)
    pos = st[2]
    while fill >= np.uint64(8):
        buf[pos] = np.uint8(acc & np.uint64(0xFF))
        acc >>= np.uint64(8)
        fill -= np.uint64(8)
        pos += np.uint64(1)
    st[0], st[1], st[2] = acc, fill, pos


@njit
def _put_wide(buf, st, value, nbits):
    if nbits > 32:
        _put(buf, st, value & np.uint64(0xFFFFFFFF), 32)
        _put(buf, st, np.uint64(value) >> np.uint64(32), nbits - 32)
    else:
        _put(buf, st, value, nbits)


@njit
def _flush(buf, st):
    if st[1] > 0:
        buf[st[2]] = np.uint8(st[0] & np.uint64(0xFF))
        st[2] += np.uint64(1)
        st[0], st[1] = np.uint64(0), np.uint64(0)
    return st[2]


@njit
def _refill(buf, st):
    """Top the accumulator up to at least 57 bits. Past the end it shifts in zeros; the caller checks at the
    end that the bits consumed match the stream's length (``_consumed``), which catches truncation."""
    acc, fill, pos = st[0], st[1], st[2]
    size = np.uint64(buf.size)
    while fill <= np.uint64(56):
        if pos < size:
            acc |= np.uint64(buf[pos]) << fill
        pos += np.uint64(1)
        fill += np.uint64(8)
    st[0], st[1], st[2] = acc, fill, pos


@njit
def _get(buf, st, nbits):
    """Read ``nbits`` (<= 56)."""
    if nbits == 0:
        return np.uint64(0)
    if st[1] < np.uint64(nbits):
        _refill(buf, st)
    out = st[0] & ((np.uint64(1) << np.uint64(nbits)) - np.uint64(1))
    st[0] >>= np.uint64(nbits)
    st[1] -= np.uint64(nbits)
    return out


@njit
def _get_wide(buf, st, nbits):
    if nbits > 32:
        lo = _get(buf, st, 32)
        return lo | (_get(buf, st, nbits - 32) << np.uint64(32))
    return _get(buf, st, nbits)


@njit
def _consumed(st):
    """Bytes of the stream actually used (the reader may have fetched a few ahead)."""
    bits = st[2] * np.uint64(8) - st[1]
    return (bits + np.uint64(7)) // np.uint64(8)


@njit
def _put_rice(buf, st, v, r, esc_bits):
    q = np.uint64(v) >> np.uint64(r)
    if q < LIMIT:
        _put(buf, st, (np.uint64(1) << q) - np.uint64(1), int(q) + 1)  # q ones then a zero
        _put_wide(buf, st, v, r)
    else:
        _put(buf, st, (np.uint64(1) << np.uint64(LIMIT)) - np.uint64(1), LIMIT + 1)  # escape: LIMIT ones, a zero
        _put_wide(buf, st, v, esc_bits)


@njit
def _get_rice(buf, st, r, esc_bits):
    if st[1] < np.uint64(LIMIT + 1):
        _refill(buf, st)
    acc = st[0]
    q = 0
    while acc & np.uint64(1) and q < LIMIT:  # count the unary ones (all within the 57 fetched bits)
        acc >>= np.uint64(1)
        q += 1
    st[0] = acc >> np.uint64(1)  # drop the terminating zero (or, at LIMIT, the escape's zero)
    st[1] -= np.uint64(q + 1)
    if q == LIMIT:  # escape: LIMIT ones, a zero, then the value in full
        return _get_wide(buf, st, esc_bits)
    return (np.uint64(q) << np.uint64(r)) | _get(buf, st, r)


@njit
def _put_gamma(buf, st, v):
    """Elias gamma of v >= 1."""
    nb = 0
    x = np.uint64(v)
    while x > 1:
        x >>= np.uint64(1)
        nb += 1
    _put_wide(buf, st, 0, nb)
    _put(buf, st, 1, 1)
    _put_wide(buf, st, v, nb)


@njit
def _get_gamma(buf, st):
    nb = 0
    while _get(buf, st, 1) == 0:
        nb += 1
        if nb > 63:
            st[3] = np.uint64(1)
            return np.uint64(1)
    return (np.uint64(1) << np.uint64(nb)) | _get_wide(buf, st, nb)


@njit
def _rice_param(total, count):
    """Smallest r with count * 2**r >= total (the JPEG-LS rule): the Rice parameter for values averaging total/count."""
    r = 0
    if count == 0:
        return 0
    while (np.uint64(count) << np.uint64(r)) < np.uint64(total) and r < 40:
        r += 1
    return r


# Register-resident variants for the hot loops: the state travels as (acc, fill, pos) values, which numba
# keeps in registers (an array-held state is reloaded after every byte store, as arrays may alias).
@njit
def _wr(buf, acc, fill, pos, value, nbits):
    """Append the low ``nbits`` (<= 32) of ``value``; returns the new (acc, fill, pos)."""
    acc |= (np.uint64(value) & ((np.uint64(1) << np.uint64(nbits)) - np.uint64(1))) << fill
    fill += np.uint64(nbits)
    while fill >= np.uint64(8):
        buf[pos] = np.uint8(acc & np.uint64(0xFF))
        acc >>= np.uint64(8)
        fill -= np.uint64(8)
        pos += 1
    return acc, fill, pos


@njit
def _wr_rice(buf, acc, fill, pos, v, r, esc_bits):
    q = np.uint64(v) >> np.uint64(r)
    if q < LIMIT:
        acc, fill, pos = _wr(buf, acc, fill, pos, (np.uint64(1) << q) - np.uint64(1), int(q) + 1)
        if r > 32:
            acc, fill, pos = _wr(buf, acc, fill, pos, v, 32)
            acc, fill, pos = _wr(buf, acc, fill, pos, np.uint64(v) >> np.uint64(32), r - 32)
        else:
            acc, fill, pos = _wr(buf, acc, fill, pos, v, r)
    else:
        acc, fill, pos = _wr(buf, acc, fill, pos, (np.uint64(1) << np.uint64(LIMIT)) - np.uint64(1), LIMIT + 1)
        if esc_bits > 32:
            acc, fill, pos = _wr(buf, acc, fill, pos, v, 32)
            acc, fill, pos = _wr(buf, acc, fill, pos, np.uint64(v) >> np.uint64(32), esc_bits - 32)
        else:
            acc, fill, pos = _wr(buf, acc, fill, pos, v, esc_bits)
    return acc, fill, pos


@njit
def _rd(buf, acc, fill, pos, nbits):
    """Read ``nbits`` (<= 32); returns (value, acc, fill, pos). Past the end it reads zeros."""
    if fill < np.uint64(nbits):
        size = buf.size
        while fill <= np.uint64(56):
            if pos < size:
                acc |= np.uint64(buf[pos]) << fill
            pos += 1
            fill += np.uint64(8)
    out = acc & ((np.uint64(1) << np.uint64(nbits)) - np.uint64(1))
    return out, acc >> np.uint64(nbits), fill - np.uint64(nbits), pos


@njit
def _rd_rice(buf, acc, fill, pos, r, esc_bits):
    if fill < np.uint64(LIMIT + 1):
        size = buf.size
        while fill <= np.uint64(56):
            if pos < size:
                acc |= np.uint64(buf[pos]) << fill
            pos += 1
            fill += np.uint64(8)
    q = 0
    while acc & np.uint64(1) and q < LIMIT:
        acc >>= np.uint64(1)
        q += 1
    acc >>= np.uint64(1)
    fill -= np.uint64(q + 1)
    if q == LIMIT:
        n1 = min(esc_bits, 32)
        lo, acc, fill, pos = _rd(buf, acc, fill, pos, n1)
        if esc_bits > 32:
            hi, acc, fill, pos = _rd(buf, acc, fill, pos, esc_bits - 32)
            lo |= hi << np.uint64(32)
        return lo, acc, fill, pos
    if r > 32:
        lo, acc, fill, pos = _rd(buf, acc, fill, pos, 32)
        hi, acc, fill, pos = _rd(buf, acc, fill, pos, r - 32)
        return (np.uint64(q) << np.uint64(r)) | lo | (hi << np.uint64(32)), acc, fill, pos
    lo, acc, fill, pos = _rd(buf, acc, fill, pos, r)
    return (np.uint64(q) << np.uint64(r)) | lo, acc, fill, pos


# ------------------------------------------------------------------------------------ ordered integers
@njit
def _ord(u, sign, allm):
    """Float bits -> a monotone unsigned integer (negatives below positives, -0 next to +0)."""
    return (~u) & allm if u & sign else u | sign


@njit
def _unord(k, sign, allm):
    return k ^ sign if k & sign else (~k) & allm


@njit
def _diff_code(b, t, sign, allm, w):
    """(target - base) on the ordered line, wrapped to w bits, zigzagged, minus one (the elements differ)."""
    d = np.int64((_ord(t, sign, allm) - _ord(b, sign, allm)) & allm)
    if d >= np.int64(sign):
        d -= np.int64(allm) + 1
    zz = (d << 1) ^ (d >> 63)
    return np.uint64(zz - 1)


@njit
def _apply_code(x, v, forward, sign, allm):
    zz = np.int64(v + np.uint64(1))
    d = (zz >> 1) ^ -(zz & 1)
    k = _ord(x, sign, allm)
    k = (k + np.uint64(d & np.int64(allm))) & allm if forward else (k - np.uint64(d & np.int64(allm))) & allm
    return _unord(k, sign, allm)


# --------------------------------------------------------------------------------------------- encoder
@njit(cache=True, nogil=True)
def cond_encode(b, t, w, mbits, ebits, out, stats, scratch, dense_buf):
    """Code the change from ``b`` to ``t`` (same-size unsigned arrays of w-bit float patterns) into ``out``.

    Returns the number of bytes written, or -1 when ``out`` is too small (the caller then uses another
    coding). ``stats[0]`` receives the number of changed elements. ``scratch`` (int32, shape (4, >= n)) and
    ``dense_buf`` (uint8, >= 2n + 64) are working memory the caller keeps and reuses across chunks.

    Stream layout (bit-packed, least significant bit first)::

        prefix : exceptions (count, then gap + value each), group sizes (big chunks only), per present
                 group its number of changes and value parameter, the first gap of each group with events,
                 the byte length of each dense group's gap stream; padded to a byte
        dense  : per dense group with more than one event, its gaps in order (byte-aligned each)
        main   : in element order, per changed element: the gap to its group's next change (sparse
                 groups) and its value code

    One pass over the elements collects the changed ones with their rank inside their group; everything
    after works on those records only.
    """
    n = b.size
    G = 1 << ebits
    emask = np.uint64(G - 1)
    sign = np.uint64(1) << np.uint64(w - 1)
    allm = (np.uint64(1) << np.uint64(w)) - np.uint64(1)
    sh = np.uint64(mbits)
    big = np.uint64(1) << np.uint64(40)
    n_g = np.zeros(G, np.int64)
    k_g = np.zeros(G, np.int64)
    vsum_g = np.zeros(G, np.uint64)
    rec_pos = scratch[0]  # changed elements (not exceptions): position, rank in their group
    rec_rank = scratch[1]
    exc = scratch[2]
    n_rec, n_exc, exc_vsum = 0, 0, np.uint64(0)
    for i in range(n):
        bi = np.uint64(b[i])
        g = (bi >> sh) & emask
        if b[i] == t[i]:
            n_g[g] += 1
            continue
        ti = np.uint64(t[i])
        if g != ((ti >> sh) & emask):
            exc[n_exc] = i
            n_exc += 1
            exc_vsum += min(_diff_code(bi, ti, sign, allm, w), big)
            continue
        rec_pos[n_rec] = i
        rec_rank[n_rec] = n_g[g]
        n_rec += 1
        n_g[g] += 1
        k_g[g] += 1
        vsum_g[g] += min(_diff_code(bi, ti, sign, allm, w), big)
    stats[0] = n_rec + n_exc
    if n_rec + n_exc == 0:
        return np.int64(0)  # an empty stream: nothing changed in this chunk
    # events per group: the changed elements, or in a mostly-changed group the unchanged ones
    dense = 2 * k_g > n_g
    e_g = np.where(dense, n_g - k_g, k_g)
    r_gap = np.zeros(G, np.int64)
    r_val = np.zeros(G, np.int64)
    for g in range(G):
        r_gap[g] = _rice_param(n_g[g] - e_g[g], e_g[g])
        r_val[g] = _rice_param(vsum_g[g], k_g[g])
    # sparse groups: gap after each change = rank of the group's next change - its rank - 1
    gap_after = np.full(max(n_rec, 1), -1, np.int32)
    next_rank = np.full(G, -1, np.int64)
    first_rank = np.full(G, -1, np.int64)
    for j in range(n_rec - 1, -1, -1):
        g = (np.uint64(b[rec_pos[j]]) >> sh) & emask
        if next_rank[g] >= 0:
            gap_after[j] = next_rank[g] - rec_rank[j] - 1
        next_rank[g] = rec_rank[j]
        first_rank[g] = rec_rank[j]
    # dense groups: events are the unchanged elements, whose ranks are the complement of the changed ones
    dense_len = np.zeros(G, np.int64)
    first_gap = np.where(dense, 0, first_rank)
    dst = np.zeros(4, np.uint64)
    any_dense = False
    for g in range(G):
        if dense[g] and e_g[g] > 0:
            any_dense = True
    if any_dense:
        ranks = scratch[3]  # changed ranks of one dense group, in order
        order_g = np.empty(n_rec, np.int32)
        cnt = np.zeros(G + 1, np.int64)  # records grouped by group (counting sort, stable)
        for j in range(n_rec):
            cnt[((np.uint64(b[rec_pos[j]]) >> sh) & emask) + np.uint64(1)] += 1
        for g in range(G):
            cnt[g + 1] += cnt[g]
        fill = cnt.copy()
        for j in range(n_rec):
            g = (np.uint64(b[rec_pos[j]]) >> sh) & emask
            order_g[fill[g]] = j
            fill[g] += 1
        for g in range(G):
            if not dense[g] or e_g[g] == 0:
                continue
            nr = 0
            for q in range(cnt[g], cnt[g + 1]):
                ranks[nr] = rec_rank[order_g[q]]
                nr += 1
            start = dst[2]
            p, prev_u, seen = 0, -1, 0
            for r in range(n_g[g]):
                if p < nr and ranks[p] == r:
                    p += 1
                    continue
                if seen == 0:
                    first_gap[g] = r
                else:
                    _put_rice(dense_buf, dst, np.uint64(r - prev_u - 1), r_gap[g], GAP_BITS)
                prev_u = r
                seen += 1
            _flush(dense_buf, dst)
            dense_len[g] = dst[2] - start

    st = np.zeros(4, np.uint64)
    buf = out
    cap = out.size
    if cap < 1024 + dst[2]:
        return np.int64(-1)
    _put_gamma(buf, st, n_exc + 1)
    if n_exc > 0:
        r_exc_gap = _rice_param(exc[n_exc - 1] + 1 - n_exc, n_exc)
        r_exc_val = _rice_param(exc_vsum, n_exc)
        _put(buf, st, r_exc_gap, 6)
        _put(buf, st, r_exc_val, 6)
        prev = -1
        for e in range(n_exc):
            if st[2] + 32 > cap:
                return np.int64(-1)
            i = exc[e]
            _put_rice(buf, st, np.uint64(i - prev - 1), r_exc_gap, GAP_BITS)
            _put_rice(buf, st, _diff_code(np.uint64(b[i]), np.uint64(t[i]), sign, allm, w), r_exc_val, w)
            prev = i
    if n >= BIG_CHUNK:  # big chunks carry their group sizes, sparing the decoder a histogram pass
        for g in range(G):
            if st[2] + 64 > cap:
                return np.int64(-1)
            _put_gamma(buf, st, n_g[g] + 1)
    for g in range(G):
        if st[2] + 64 > cap:
            return np.int64(-1)
        if n_g[g] > 0:
            _put_gamma(buf, st, k_g[g] + 1)
        if k_g[g] > 0:
            _put(buf, st, r_val[g], 6)
        if e_g[g] > 0:  # the first gap of each group with events, up front
            _put_rice(buf, st, np.uint64(first_gap[g]), r_gap[g], GAP_BITS)
            if dense[g]:
                _put_gamma(buf, st, dense_len[g] + 1)
    _flush(buf, st)
    if st[2] + dst[2] + 64 > cap:
        return np.int64(-1)
    buf[st[2] : st[2] + dst[2]] = dense_buf[: dst[2]]
    st[2] += dst[2]
    # main stream, in element order: sparse gaps and values
    done = np.zeros(G, np.int64)
    acc, fill, pos = st[0], st[1], np.int64(st[2])
    for j in range(n_rec):
        if pos + 32 > cap:
            return np.int64(-1)
        i = rec_pos[j]
        bi = np.uint64(b[i])
        g = (bi >> sh) & emask
        if not dense[g]:
            done[g] += 1
            if done[g] < e_g[g]:
                acc, fill, pos = _wr_rice(buf, acc, fill, pos, np.uint64(gap_after[j]), r_gap[g], GAP_BITS)
        acc, fill, pos = _wr_rice(buf, acc, fill, pos, _diff_code(bi, np.uint64(t[i]), sign, allm, w), r_val[g], w)
    st[0], st[1], st[2] = acc, fill, np.uint64(pos)
    if st[2] + 16 > cap:
        return np.int64(-1)
    return np.int64(_flush(buf, st))


# --------------------------------------------------------------------------------------------- decoder
@njit(cache=True, nogil=True)
def cond_decode(x, buf, w, mbits, ebits, forward, pos_out, val_out):
    """Decode a chunk's stream against ``x`` (the end the caller holds) without writing to ``x``.

    Fills ``pos_out``/``val_out`` with the changed positions and their XOR with ``x`` (so applying is
    ``x[pos] ^= val`` and undoing is the same). Returns the number of changed elements, or a negative error.
    """
    n = x.size
    G = 1 << ebits
    emask = np.uint64(G - 1)
    sign = np.uint64(1) << np.uint64(w - 1)
    allm = (np.uint64(1) << np.uint64(w)) - np.uint64(1)
    sh = np.uint64(mbits)
    if buf.size == 0:
        return np.int64(0)  # nothing changed in this chunk
    size = np.uint64(buf.size)
    st = np.zeros(4, np.uint64)
    cap = pos_out.size
    m = 0
    n_exc = np.int64(_get_gamma(buf, st)) - 1
    if st[3] or _consumed(st) > size or n_exc < 0 or n_exc > n:
        return np.int64(E_TRUNCATED)
    r_exc_gap, r_exc_val = 0, 0
    if n_exc > 0:
        r_exc_gap = int(_get(buf, st, 6))
        r_exc_val = int(_get(buf, st, 6))
    exc_pos = np.empty(n_exc + 1, np.int64)
    exc_pos[n_exc] = n  # sentinel
    prev = -1
    for e in range(n_exc):
        p = prev + 1 + np.int64(_get_rice(buf, st, r_exc_gap, GAP_BITS))
        v = _get_rice(buf, st, r_exc_val, w)
        if _consumed(st) > size:
            return np.int64(E_TRUNCATED)
        if p >= n or m >= cap:
            return np.int64(E_POSITION)
        xp = np.uint64(x[p])
        new = _apply_code(xp, v, forward, sign, allm)
        if ((new >> sh) & emask) == ((xp >> sh) & emask):
            return np.int64(E_COUNTS)  # not an exponent crossing: the stream does not belong to this end
        exc_pos[e] = p
        pos_out[m] = p
        val_out[m] = new ^ xp
        m += 1
        prev = p
    # group sizes (exceptions excluded: their exponent differs between the ends): counted from the end we
    # hold, or for big chunks read from the stream
    n_g = np.zeros(G, np.int64)
    if n >= BIG_CHUNK:
        total = 0
        for g in range(G):
            n_g[g] = np.int64(_get_gamma(buf, st)) - 1
            total += n_g[g]
        if total != n - n_exc:
            return np.int64(E_COUNTS)
    else:
        for i in range(n):
            n_g[(np.uint64(x[i]) >> sh) & emask] += 1
        for e in range(n_exc):
            n_g[(np.uint64(x[exc_pos[e]]) >> sh) & emask] -= 1
    k_g = np.zeros(G, np.int64)
    r_val = np.zeros(G, np.int64)
    r_gap = np.zeros(G, np.int64)
    left = np.zeros(G, np.int64)  # events still to come per group
    dense_len = np.zeros(G, np.int64)
    # counter[g]: same-group non-events before the group's next event; stored as -1 - count in dense groups,
    # so that the common case (an unchanged element of a sparse group) is one test: counter > 0
    never = np.int64(1) << 62
    counter = np.full(G, never)
    for g in range(G):
        if n_g[g] > 0:
            k_g[g] = np.int64(_get_gamma(buf, st)) - 1
            if k_g[g] > n_g[g] or k_g[g] < 0:
                return np.int64(E_COUNTS)
        if k_g[g] > 0:
            r_val[g] = int(_get(buf, st, 6))
        dense = 2 * k_g[g] > n_g[g]
        left[g] = n_g[g] - k_g[g] if dense else k_g[g]
        r_gap[g] = _rice_param(n_g[g] - left[g], left[g])
        if left[g] > 0:
            counter[g] = np.int64(_get_rice(buf, st, r_gap[g], GAP_BITS))
            if dense:
                dense_len[g] = np.int64(_get_gamma(buf, st)) - 1
        if dense:
            counter[g] = -1 - counter[g]
    if st[3] or _consumed(st) > size:
        return np.int64(E_TRUNCATED)
    # dense groups' gap streams follow the byte-aligned prefix
    at = np.int64(_consumed(st))
    dstart = np.zeros(G, np.int64)
    dend = np.zeros(G, np.int64)
    for g in range(G):
        dstart[g] = at
        at += dense_len[g]
        dend[g] = at
    if at > buf.size or dense_len.min() < 0:
        return np.int64(E_TRUNCATED)
    drd = np.zeros((G, 4), np.uint64)  # per dense group: its gap stream's reader (acc, fill, byte position)
    for g in range(G):
        drd[g, 2] = np.uint64(dstart[g])
    acc, fill, pos = np.uint64(0), np.uint64(0), at  # the main stream
    next_exc = exc_pos[0]
    e = 0
    for i in range(n):
        if i == next_exc:
            e += 1
            next_exc = exc_pos[e]
            continue
        xi = np.uint64(x[i])
        g = (xi >> sh) & emask
        c = counter[g]
        if c > 0:  # the common case: an unchanged element of a sparse group
            counter[g] = c - 1
            continue
        is_dense = c < 0
        if is_dense:
            c = -1 - c
        event = c == 0
        if event:
            left[g] -= 1
            if left[g] <= 0:
                c = never
            elif is_dense:
                gap, da, df, dp = _rd_rice(
                    buf[: dend[g]], drd[g, 0], drd[g, 1], np.int64(drd[g, 2]), r_gap[g], GAP_BITS
                )
                drd[g, 0], drd[g, 1], drd[g, 2] = da, df, np.uint64(dp)
                c = np.int64(gap)
            else:
                gap, acc, fill, pos = _rd_rice(buf, acc, fill, pos, r_gap[g], GAP_BITS)
                c = np.int64(gap)
        else:
            c -= 1
        counter[g] = -1 - c if is_dense else c
        if event != is_dense:  # changed
            v, acc, fill, pos = _rd_rice(buf, acc, fill, pos, r_val[g], w)
            if m >= cap:
                return np.int64(E_COUNTS)
            new = _apply_code(xi, v, forward, sign, allm)
            if ((new >> sh) & emask) != g:
                return np.int64(E_COUNTS)
            pos_out[m] = i
            val_out[m] = new ^ xi
            m += 1
    st[0], st[1], st[2] = acc, fill, np.uint64(pos)
    if st[3] or _consumed(st) > size:
        return np.int64(E_TRUNCATED)
    for g in range(G):
        if left[g] != 0:
            return np.int64(E_COUNTS)
        if dense_len[g] and _consumed(drd[g]) != np.uint64(dend[g]):
            return np.int64(E_COUNTS)
    if _consumed(st) != size:
        return np.int64(E_TRUNCATED if _consumed(st) > size else E_TRAILING)
    return np.int64(m)


@njit(cache=True, nogil=True)
def xor_scatter(x, pos, val, m):
    """x[pos[:m]] ^= val[:m] (applies a decoded chunk; applying it twice undoes it)."""
    for j in range(m):
        x[pos[j]] ^= val[j]
