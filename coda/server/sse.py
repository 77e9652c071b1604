"""Server-sent events over the engine's sequence-numbered streams (SPEC P2, P3, P4, P5, P6).

:class:`~coda.reader.StreamReader` (the one stream reader) reads one or more
:class:`~coda.stream.RequestStream` logs from any position (replay + live, P3); the pump
acknowledges only what reached the socket (backpressure credit, P6). :class:`SSEResponse` is a raw ASGI response that pumps a :class:`Renderer`'s frames,
writes a keepalive comment whenever the request is quiet (queued, prefilling), and is itself
the :class:`~coda.server.connection.Connection` it writes through (one object per streamed
response, issue 22: the connection is the response's, opened when the ASGI server calls it),
which watches the client while every write is pending and bounds how long one write may block: a disconnect or a stall is reported
to ``on_disconnect`` at once as a transport event (P4) — it never ends the stream as if the
model had finished, and no credit is acknowledged after it (P6).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from coda.reader import ReaderInterrupted, StreamReader
from coda.server.connection import ClientGone, Connection
from coda.server.integrity import DeltaIntegrity
from coda.stream import EventType, RequestStream, StreamEvent

log = logging.getLogger("coda.server")

# NOTE: no blank line after the comment: a blank line dispatches an event, and SDK decoders
# that keep the last event id (openai, anthropic) would then yield an empty-data event.
KEEPALIVE = b": keepalive\n"


@dataclass(frozen=True)
class Frame:
    """One SSE event; ``data`` is a JSON-ready object or a literal string (``[DONE]``)."""

    data: Any
    event: str | None = None
    id: str | None = None

    def encode(self) -> bytes:
        lines = []
        if self.id is not None:
            lines.append(f"id: {self.id}")
        if self.event is not None:
            lines.append(f"event: {self.event}")
        body = self.data if isinstance(self.data, str) else json.dumps(
            self.data, ensure_ascii=False, separators=(",", ":"))
        lines.append(f"data: {body}")
        return ("\n".join(lines) + "\n\n").encode()


class Renderer:
    """Turns engine events into protocol frames. ``after`` holds, per stream, the engine
    sequence number to resume after (``-1``: from the start)."""

    # NOTE: ids are engine positions (P3): the pump gives a group's earlier frames sub-ids
    # (frame_id); a renderer numbering its own frames (Responses) turns this off
    position_ids = True
    # NOTE: the wire framing is the renderer's (its frames encode themselves): SSE here,
    # NDJSON in coda.server.ndjson, which has no keepalive line (None: none written)
    media_type = "text/event-stream; charset=utf-8"
    keepalive: bytes | None = KEEPALIVE

    def __init__(self, n: int, after: Sequence[int] | None = None, held: int = 0) -> None:
        self.after = list(after) if after is not None else [-1] * n
        self.held = held  # NOTE: frames of the first group after ``after`` the client holds
        # NOTE: updated by the pump (P5 "network send"); rendered through the request's
        # record (Record.network_send_s) so a replay shows the first delivery's value (P3).
        self.network_send_s = 0.0

    verify: DeltaIntegrity | None = None  # NOTE: set when the request opted in (P3)

    def enable_verify(self, streams: Sequence[RequestStream]) -> None:
        self.verify = DeltaIntegrity(streams, self.after)

    def stamp(self, index: int, ev: StreamEvent) -> dict[str, Any]:
        """``{"coda": {offset, length, digest}}`` for a delta of an opted-in request, else {}."""
        return {} if self.verify is None else {"coda": self.verify.stamp(index, ev)}

    def take(self, index: int, ev: StreamEvent) -> None:
        """With tools: count a delta whose frames (if any) come from the tool-call parser."""
        if self.verify is not None:
            self.verify.take(index, ev)

    def stamp_into(self, index: int, coda: dict[str, Any]) -> None:
        """Add the stamp of the bytes taken since the last stamp to ``coda`` in place (a final
        frame's ``coda`` object; nothing when no byte is pending)."""
        stamp = self.verify.stamp_pending(index) if self.verify is not None else None
        if stamp is not None:
            coda.update(stamp)

    def stamp_last(self, index: int, objects: Sequence[Any],
                   carries: Callable[[dict[str, Any]], bool] = lambda o: True) -> None:
        """Put the stamp of the bytes taken since the last stamp on the last of ``objects``
        (frame data) that ``carries`` one (issue 20 D5); when none does, the bytes wait for a
        later object. Offsets count the engine's output bytes, tool-call markup included."""
        if self.verify is None:
            return
        for obj in reversed(objects):
            if isinstance(obj, dict) and carries(obj):
                stamp = self.verify.stamp_pending(index)
                if stamp is not None:
                    obj["coda"] = {**obj.get("coda", {}), **stamp}
                return

    def header(self) -> list[Frame]:
        return []

    def on_event(self, index: int, ev: StreamEvent, positions: list[int]) -> list[Frame]:
        raise NotImplementedError

    def footer(self) -> list[Frame]:
        return []


def position_id(positions: Sequence[int]) -> str:
    """SSE id of a merged stream: each request's last engine seq, comma separated (n=1: the
    seq itself), so ``Last-Event-ID`` resumes every choice where it stopped (P3)."""
    return ",".join(str(p) for p in positions)


def frame_id(before: Sequence[int], delivered: int) -> str:
    """SSE id of a frame that is not the last of its group: the positions before the group's
    event, and how many of the group's frames the client holds with this one (``12.2``). One
    engine event can render several frames (a tool call's block start, delta and stop); a
    client cut between them resumes after ``before`` and is sent the group's frames past
    ``delivered`` - none lost, none repeated (P3)."""
    return f"{position_id(before)}.{delivered}"


_SEQ = re.compile(r"-?[0-9]+")


def parse_seq(text: str) -> int | None:
    """A sequence number as a stream writes it in an id (ASCII digits, a minus sign at most);
    None for anything else — never ``int()``'s wider reading (``+5``, ``1_0`` as 10, ``²``
    or ``--5`` raising), so a cursor the stream never sent is a 400, not a resume elsewhere
    or a crash (P3)."""
    return int(text) if _SEQ.fullmatch(text) else None


def parse_position_id(value: str | None, n: int) -> tuple[list[int], int] | None:
    """``(positions, frames of the next group already held)`` from an SSE id (see
    :func:`position_id` and :func:`frame_id`); None if it is not one of this stream's ids."""
    if value is None or not value.strip():
        return None
    head, dot, tail = value.strip().rpartition(".")
    if not dot:
        head, tail = tail, "0"
    parts, held = [parse_seq(p) for p in head.split(",")], parse_seq(tail)
    if held is None or held < 0 or len(parts) != n:
        return None
    ok = [p for p in parts if p is not None and p >= -1]
    return (ok, held) if len(ok) == n else None


def id_ahead(later: tuple[list[int], int], earlier: tuple[list[int], int]) -> bool:
    """Whether the parsed id ``later`` (:func:`parse_position_id`) is at or past ``earlier``
    in the stream: every choice's number at or past it, and, at the same numbers, as many
    frames of the next group held or more (ids only grow along a stream, P3)."""
    (pos, held), (pos0, held0) = later, earlier
    return (all(a >= b for a, b in zip(pos, pos0, strict=True))
            and (pos != pos0 or held >= held0))


class SSEResponse(Connection, Response):
    """Streams ``renderer`` frames for ``streams``; see the module docstring. It is its own
    :class:`~coda.server.connection.Connection`: the connection's part is opened with the
    ASGI channel when the response is called (a response is called once)."""

    media_type = "text/event-stream"

    def __init__(self, streams: Sequence[RequestStream], renderer: Renderer, *,
                 keepalive_s: float, on_disconnect: Callable[[], None] | None = None,
                 headers: dict[str, str] | None = None, write_timeout_s: float = 30.0) -> None:
        self.status_code = 200
        self.background = None
        self._streams = streams
        self._renderer = renderer
        self._keepalive_s = keepalive_s
        self._on_disconnect = on_disconnect
        self._write_timeout_s = write_timeout_s
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no",
                           "content-type": renderer.media_type, **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        Connection.__init__(self, receive, send, write_timeout_s=self._write_timeout_s)
        watch = asyncio.ensure_future(self.watch())
        lost: ClientGone | None = None
        try:
            await self._pump(self)
        except ClientGone as exc:
            lost = exc
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
        if lost is None:
            return
        log.info("client %s", "stalled past the write bound" if lost.stalled else "gone",
                 extra={"request_id": ",".join(s.request_id for s in self._streams)})
        if self._on_disconnect is not None:
            # NOTE: P4: a lost client is a transport event, handled by the declared policy,
            # at once: nothing waits for a pump that a stalled socket could hold.
            self._on_disconnect()

    async def _pump(self, conn: Connection) -> None:
        r = self._renderer
        await conn.start(200, self.raw_headers)
        source = StreamReader(self._streams, r.after)
        positions = list(r.after)  # NOTE: advanced event by event, for the frames' ids
        conn.on_gone(source.interrupt)
        ended = 0  # NOTE: streams whose terminal event reached the socket
        try:
            head = r.header()
            if head:
                await conn.write(b"".join(f.encode() for f in head))
            while True:
                try:
                    batch = await source.next(self._keepalive_s)
                except ReaderInterrupted:
                    if ended == len(self._streams):
                        break  # NOTE: it left after the last terminal event: a normal end
                    raise ClientGone(stalled=conn.stalled) from None
                if batch is None:
                    break
                if not batch:
                    if r.keepalive is not None:
                        await conn.write(r.keepalive)
                    continue
                frames: list[Frame] = []
                for index, ev in batch:
                    if frames and is_terminal(ev):
                        # NOTE: P5: what precedes a terminal is sent before it is rendered, so
                        # its network_send_s counts that send (a batch may hold a whole output)
                        await conn.write(b"".join(f.encode() for f in frames))
                        r.network_send_s = conn.send_s
                        frames = []
                    before = list(positions)
                    positions[index] = ev.seq  # NOTE: each frame's id is its own cut (P3)
                    frames.extend(self._group(r.on_event(index, ev, list(positions)), before))
                if frames:
                    # NOTE: one write per batch: a frame group reaches the client whole or not.
                    await conn.write(b"".join(f.encode() for f in frames))
                    r.network_send_s = conn.send_s
                ended += sum(1 for _, ev in batch if is_terminal(ev))
                # NOTE: credit (P6) only for what reached the socket, never after the client left.
                source.ack()
            tail = self._group(r.footer(), positions)
            try:
                await conn.write(b"".join(f.encode() for f in tail), more_body=False)
            except ClientGone:
                if ended < len(self._streams):
                    raise
                # NOTE: a client that read every terminal event may close before the footer
                # (the anthropic SDK stops at message_stop): not a lost client, nothing to log
        finally:
            r.network_send_s = conn.send_s
            source.close()


    def _group(self, frames: list[Frame], before: list[int]) -> list[Frame]:
        """One event's frames (or the footer) with their ids (:func:`frame_id`), less those
        the resuming client already holds."""
        r = self._renderer
        # NOTE: the footer too (a usage chunk then [DONE]): a client cut after its usage
        # chunk holds a sub-id and is sent [DONE] alone; the last frame keeps the plain id,
        # so a resume after the terminal event (or after [DONE]) is sent the footer again
        if r.position_ids:
            frames = [replace(f, id=frame_id(before, j + 1))
                      if j < len(frames) - 1 and f.id is not None else f
                      for j, f in enumerate(frames)]
        if r.held and frames:
            # NOTE: the first group after the resume point is the one the client was cut in
            frames, r.held = frames[r.held:], 0
        return frames


def is_terminal(ev: StreamEvent) -> bool:
    return ev.type is EventType.TERMINAL
