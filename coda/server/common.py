"""Helpers shared by the route modules: ids, the per-app state, waiting for a non-streaming
request while watching its connection (SPEC P4), and reading a finished stream's log."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.responses import Response

from coda.reader import replay, terminal_of
from coda.server.logprobs import reported_trailing
from coda.server.sse import SSEResponse
from coda.server.state import DisconnectPolicy, Record, ServerState
from coda.stream import EventType, RequestStream, Terminal, TokenInfo


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def state_of(request: Request) -> ServerState:
    st: ServerState = request.app.state.coda
    return st


class ClientGone(Exception):
    """The client disconnected while a non-streaming request was running."""


async def wait_results(request: Request, st: ServerState, record: Record,
                       policy: DisconnectPolicy) -> list[Terminal]:
    """Wait for every handle's terminal; a disconnect first applies the P4 policy."""
    results = asyncio.ensure_future(asyncio.gather(*(terminal_of(h.stream) for h in record.handles)))
    watch = asyncio.ensure_future(_disconnected(request))
    # NOTE: typed as one kind of future: the set of both was a set[object] to mypy
    either: set[asyncio.Future[Any]] = {results, watch}
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not results.done():
        st.disconnect_handler(record, policy)()
        results.cancel()
        await asyncio.gather(results, watch, return_exceptions=True)
        raise ClientGone(record.id)
    await asyncio.gather(watch, return_exceptions=True)
    return list(results.result())


async def stream_or_wait(request: Request, st: ServerState, record: Record, *, stream: bool,
                         policy: DisconnectPolicy,
                         headers: dict[str, str] | None = None) -> Response | list[Terminal]:
    """The shared tail of every create route: the SSE response of a streaming call, or the
    terminals of a non-streaming one (a 499 if the client left first, after the P4 policy)."""
    # NOTE: made up front: a continue policy is recorded in the durable log at once
    on_disconnect = st.disconnect_handler(record, policy)
    if stream:
        return SSEResponse(record.streams, record.make_renderer(None),
                           keepalive_s=st.settings.keepalive_s,
                           write_timeout_s=st.settings.write_timeout_s,
                           on_disconnect=on_disconnect, headers=headers)
    try:
        return await wait_results(request, st, record, policy)
    except ClientGone:
        return Response(status_code=499)


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


@dataclass(frozen=True)
class Collected:
    """What a finished stream returned: text, per-delta tokens, and its terminal."""

    text: str
    deltas: list[tuple[str, tuple[TokenInfo, ...]]]
    terminal: Terminal
    reasoning: str = ""  # issue 23: the reasoning deltas' text (their tokens are in deltas)


def collect(stream: RequestStream) -> Collected:
    events = [e for e in replay(stream) if e.type is EventType.DELTA]
    # NOTE: issue 23: reasoning deltas keep their tokens (logprobs) but not their text
    deltas = [("" if e.reasoning else e.text, e.tokens) for e in events]
    terminal = stream.terminal
    assert terminal is not None, "collect() needs a finished stream"
    trailing = reported_trailing(terminal)
    if trailing:  # NOTE: textless last tokens still get their logprobs (never the stop itself)
        deltas.append(("", trailing))
    return Collected("".join(t for t, _ in deltas), deltas, terminal,
                     "".join(e.text for e in events if e.reasoning))


def partial_text(stream: RequestStream, reasoning: bool = False) -> str:
    """The answer's text so far (``reasoning``: the reasoning's, issue 23)."""
    return "".join(e.text for e in replay(stream)
                   if e.type is EventType.DELTA and e.reasoning is reasoning)


def text_before(stream: RequestStream, seq: int) -> int:
    """Characters returned by deltas up to and including ``seq`` (for resumed offsets)."""
    return sum(len(e.text) for e in replay(stream)
               if e.type is EventType.DELTA and e.seq <= seq and not e.reasoning)
