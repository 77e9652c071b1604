"""What the route modules share: ids, the per-app state, the one create handler every
generation route runs (issue 22 step 2; SPEC P3, P4, L5), waiting for a non-streaming request
while watching its connection (P4), and reading a finished stream's log.

A protocol is an :class:`Adapter`: its ``parse`` turns its body into the call's
:class:`~coda.server.records.Record`, not yet submitted (the engine requests, the error renames
and the typed render spec; it ends with :func:`~coda.server.params.plan_call`), its renderer is rebuilt from
a record, and ``final`` writes the answer of a call that did not stream. A route parses and
hands the result on: :func:`create` never calls back into the adapter's parse, and does the
rest the same way for all protocols: submit (all or none), the record in the store, the P4
policy, streaming or waiting. Adapters: chat and completions
(:mod:`~coda.server.openai_routes`), Messages (:mod:`~coda.server.anthropic_routes`),
Responses (:mod:`~coda.server.responses_routes`), Ollama (:mod:`~coda.server.ollama_routes`).
(Merged from ``create.py``: the handler and the delivery it runs were one path in two files.)
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from fastapi import Request
from starlette.responses import Response

from coda.finish import Terminal
from coda.reader import replay, terminal_of
from coda.server.logprobs import reported_trailing
from coda.server.records import DisconnectPolicy, Record
from coda.server.render_spec import RecordKind
from coda.server.schemas import CodaExtensions
from coda.server.sse import SSEResponse
from coda.server.state import ServerState
from coda.stream import EventType, RequestStream, TokenInfo


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
    watch = asyncio.ensure_future(disconnected(request))
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


async def disconnected(request: Request) -> None:
    """Return once the client has disconnected (the ASGI channel's ``http.disconnect``)."""
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


B = TypeVar("B", bound=CodaExtensions, contravariant=True)


class Adapter(Protocol[B]):
    """One protocol's create route. ``id_header``: the response header carrying the id.
    ``parse`` checks the model first (``ServerState.check_model``: with several models it
    routes the rest of the call), then everything else, and returns the call's record."""

    # NOTE: read-only, so an adapter's narrower class attribute (``kind = "chat"``,
    # ``id_header = "x-request-id"``) satisfies it: a mutable protocol member is invariant
    @property
    def kind(self) -> RecordKind: ...

    @property
    def id_prefix(self) -> str: ...

    @property
    def id_header(self) -> str | None: ...

    async def parse(self, st: ServerState, body: B) -> Record: ...

    def final(self, record: Record, terminals: list[Terminal] | None) -> Response:
        """The answer of a call that did not stream (``terminals`` None: a background call
        answered at once, still running)."""
        ...


async def create(request: Request, record: Record, adapter: Adapter[B]) -> Response:
    """Submit → store → stream or wait → final, for any protocol (``record``: the adapter's
    parse, not yet submitted)."""
    st = state_of(request)
    handles = st.submit_all(record.requests, record.rename, record.prompt_of)
    record.handles.extend(handles)
    record.requests = ()  # NOTE: submitted: the engine holds them; the store keeps no prompts
    st.store.put(record)
    if not record.keep:
        st.forget_when_done(record)  # NOTE: not kept for resume once it ended (privacy)
    if record.background:
        for h in handles:
            st.keep_draining(h)  # NOTE: acks the log so nobody-reading never overflows
        if not record.stream:
            return adapter.final(record, None)
    headers = {adapter.id_header: record.id} if adapter.id_header else None
    done = await stream_or_wait(request, st, record, stream=record.stream,
                                policy=record.on_disconnect or st.settings.on_disconnect,
                                headers=headers)
    if isinstance(done, Response):
        return done
    return adapter.final(record, done)
