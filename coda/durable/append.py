"""One flush of the stream log in one round trip (issue 12 items 2, 6; SPEC P1, P2, P3).

:func:`runs` cuts a batch of events into runs (consecutive events of one request, a terminal
ending its run); :func:`frame` writes the ``EVAL`` calls of :data:`coda.durable.lua.APPEND`
for those runs straight as RESP bytes; :func:`outcomes` maps the replies back to one outcome
per event.

Why RESP by hand: redis-py's generic command packer costs ~4 µs per argument (type checks and
an encoder per argument), and an append has nine per run — more than everything else a token
costs. Here each argument is one bytes formatting operation. ``EVAL`` with the script body,
not ``EVALSHA``: Redis caches the compiled script by its digest either way, and the ~2 KB body
per flush (not per event) spares the ``NOSCRIPT`` retry after a Redis restart.
"""

from __future__ import annotations

from collections.abc import Iterator

from coda.durable import lua
from coda.durable.codec import pack_run
from coda.stream import EventType, StreamEvent

# NOTE: one script call holds at most this many runs (a script blocks Redis while it runs)
RUNS_PER_CALL = 128

_SCRIPT = lua.APPEND.encode()
_EVAL = b"$4\r\nEVAL\r\n$%d\r\n%s\r\n" % (len(_SCRIPT), _SCRIPT)

Run = list[tuple[StreamEvent, str | None]]


def runs(items: list[tuple[StreamEvent, str | None]]) -> list[Run]:
    """``items`` (each request's events in seq order) cut into runs of consecutive events of
    one request; a terminal ends its run."""
    out: list[Run] = []
    for item in items:
        prev = out[-1][-1][0] if out else None
        if (prev is not None and prev.request_id == item[0].request_id
                and item[0].seq == prev.seq + 1 and prev.type is not EventType.TERMINAL):
            out[-1].append(item)
        else:
            out.append([item])
    return out


def _bulk(b: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(b), b)


def frame(batch: list[Run], prefix: str, retention_ms: int, fence: str) -> list[bytes]:
    """The RESP bytes of the ``EVAL`` calls appending ``batch`` (one per
    :data:`RUNS_PER_CALL` runs); argument layout as :data:`coda.durable.lua.APPEND`."""
    pre = prefix.encode()
    opened = _bulk(pre + b"open")
    head = _bulk(b"%d" % retention_ms) + _bulk(fence.encode())
    calls = []
    for k in range(0, len(batch), RUNS_PER_CALL):
        chunk = batch[k:k + RUNS_PER_CALL]
        keys: list[bytes] = [opened]
        args: list[bytes] = [head]
        for run in chunk:
            ev, record_id = run[0]
            rid = ev.request_id.encode()
            last = run[-1][0]
            end = last.type is EventType.TERMINAL
            rec = b"%srec:{%s}" % (pre, record_id.encode()) if record_id and end else b""
            # NOTE: one formatting operation per run for its three keys and one for its six
            # arguments (redis-py's packer is a function call and type checks per argument)
            n = len(rid) + len(pre) + 6
            keys.append(b"$%d\r\n%slog:{%s}\r\n$%d\r\n%smeta:{%s}\r\n$%d\r\n%s\r\n"
                        % (n, pre, rid, n + 1, pre, rid, len(rec), rec))
            blob, offsets = pack_run([e for e, _ in run])
            first, count = b"%d" % ev.seq, b"%d" % len(run)
            args.append(b"$%d\r\n%s\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$1\r\n%s\r\n"
                        b"$%d\r\n%s\r\n$%d\r\n%s\r\n"
                        % (len(rid), rid, len(first), first, len(count), count,
                           b"1" if end else b"0", len(blob), blob, len(offsets), offsets))
        n_keys = 1 + 3 * len(chunk)
        calls.append(b"".join([b"*%d\r\n" % (3 + n_keys + 2 + 6 * len(chunk)), _EVAL,
                               _bulk(b"%d" % n_keys), *keys, *args]))
    return calls


def outcomes(batch: list[Run], replies: list[bytes]) -> Iterator[tuple[Run, int, int]]:
    """Per run: ``(run, code, last seq before the call)`` (codes as the script's)."""
    parts = [p for reply in replies for p in reply.split(b",")]
    for run, part in zip(batch, parts, strict=True):
        code, prev_last = part.split(b":")
        yield run, int(code), int(prev_last)
