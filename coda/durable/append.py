"""One flush of the stream log in one round trip (issue 12 items 2, 6; SPEC P1, P2, P3).

:func:`runs` cuts a batch of events into runs (consecutive events of one request, a terminal
ending its run; the mirror has them already, one per request of a flush); :func:`frame` writes
the ``EVALSHA`` calls of :data:`coda.durable.lua.APPEND` for those runs straight as RESP
bytes; :func:`outcomes` maps the replies back to one outcome per run.

Why RESP by hand: redis-py's generic command packer costs ~4 µs per argument (type checks and
an encoder per argument), and an append has ten per run — more than everything else a token
costs. Here each argument is one bytes formatting operation. ``EVALSHA``: ``EVAL`` with the
~2 KB body made Redis hash the body on every flush (SHA-1, a few µs of its one thread) and
the client send it; a ``NOSCRIPT`` reply (a restarted or flushed Redis) is answered by
resending that call with the body (:func:`with_body`): the script did not run, so the retry
is safe and, the script being cached again, the last one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

from coda.durable import lua
from coda.durable.codec import pack_run
from coda.stream import EventType, StreamEvent

# NOTE: one script call holds at most this many runs (a script blocks Redis while it runs)
RUNS_PER_CALL = 128

_SCRIPT = lua.APPEND.encode()
_EVAL = b"$4\r\nEVAL\r\n$%d\r\n%s\r\n" % (len(_SCRIPT), _SCRIPT)
_EVALSHA = b"$7\r\nEVALSHA\r\n$40\r\n%s\r\n" % hashlib.sha1(_SCRIPT).hexdigest().encode()

# NOTE: a run: consecutive events of one request (a terminal only last), and its record id
Run = tuple[list[StreamEvent], str | None]


def runs(items: list[tuple[StreamEvent, str | None]]) -> list[Run]:
    """``items`` (each request's events in seq order) cut into runs of consecutive events of
    one request; a terminal ends its run; a run's record id is its first item's."""
    out: list[Run] = []
    prev: StreamEvent | None = None
    for ev, record_id in items:
        if (prev is not None and prev.request_id == ev.request_id
                and ev.seq == prev.seq + 1 and prev.type is not EventType.TERMINAL):
            out[-1][0].append(ev)
        else:
            out.append(([ev], record_id))
        prev = ev
    return out


def _bulk(b: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(b), b)


def frame(batch: list[Run], prefix: str, retention_ms: int, fence: str,
          first_key: int) -> list[bytes]:
    """The RESP bytes of the ``EVALSHA`` calls appending ``batch`` (one per
    :data:`RUNS_PER_CALL` runs); argument layout as :data:`coda.durable.lua.APPEND`. Run
    ``i``'s merge key is ``first_key + i`` (P3, :func:`coda.reader.merge_order`)."""
    pre = prefix.encode()
    opened = _bulk(pre + b"open")
    head = _bulk(b"%d" % retention_ms) + _bulk(fence.encode())
    calls = []
    for k in range(0, len(batch), RUNS_PER_CALL):
        chunk = batch[k:k + RUNS_PER_CALL]
        keys: list[bytes] = [opened]
        args: list[bytes] = [head]
        for j, (evs, record_id) in enumerate(chunk):
            ev = evs[0]
            rid = ev.request_id.encode()
            last = evs[-1]
            end = last.type is EventType.TERMINAL
            rec = b"%srec:{%s}" % (pre, record_id.encode()) if record_id and end else b""
            # NOTE: one formatting operation per run for its three keys and one for its six
            # arguments (redis-py's packer is a function call and type checks per argument)
            n = len(rid) + len(pre) + 6
            keys.append(b"$%d\r\n%slog:{%s}\r\n$%d\r\n%smeta:{%s}\r\n$%d\r\n%s\r\n"
                        % (n, pre, rid, n + 1, pre, rid, len(rec), rec))
            blob, offsets = pack_run(evs)
            first, count = b"%d" % ev.seq, b"%d" % len(evs)
            key = b"%d" % (first_key + k + j)
            args.append(b"$%d\r\n%s\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$1\r\n%s\r\n"
                        b"$%d\r\n%s\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n"
                        % (len(rid), rid, len(first), first, len(count), count,
                           b"1" if end else b"0", len(blob), blob, len(offsets), offsets,
                           len(key), key))
        n_keys = 1 + 3 * len(chunk)
        calls.append(b"".join([b"*%d\r\n" % (3 + n_keys + 2 + 7 * len(chunk)), _EVALSHA,
                               _bulk(b"%d" % n_keys), *keys, *args]))
    return calls


def with_body(call: bytes) -> bytes:
    """``call`` (from :func:`frame`) as ``EVAL`` with the script's body (after ``NOSCRIPT``)."""
    return call.replace(_EVALSHA, _EVAL, 1)


def outcomes(replies: list[bytes]) -> Iterator[tuple[int, int]]:
    """Per run, in order: ``(code, last seq before the call)`` (codes as the script's)."""
    for reply in replies:
        for part in reply.split(b","):
            code, prev_last = part.split(b":")
            yield int(code), int(prev_last)
