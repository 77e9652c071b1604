"""The one create handler every generation route runs (issue 22 step 2; SPEC P3, P4, L5).

A protocol is an :class:`Adapter`: its ``parse`` turns its body into a frozen
:class:`~coda.server.params.Parsed` (the engine requests, the error renames and the typed
render spec; it ends with :func:`~coda.server.params.plan_call`), its renderer is rebuilt from
a record, and ``final`` writes the answer of a call that did not stream. A route parses and
hands the result on: :func:`create` never calls back into the adapter's parse, and does the
rest the same way for all protocols: submit (all or none), the record in the store, the P4
policy, streaming or waiting. Adapters: chat and completions
(:mod:`~coda.server.openai_routes`), Messages (:mod:`~coda.server.anthropic_routes`),
Responses (:mod:`~coda.server.responses_routes`), Ollama (:mod:`~coda.server.ollama_routes`).
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from fastapi import Request
from starlette.responses import Response

from coda.server.common import now, state_of, stream_or_wait
from coda.server.params import Parsed
from coda.server.render_spec import RecordKind
from coda.server.schemas import CodaExtensions
from coda.server.state import Record, ServerState
from coda.stream import Terminal

B = TypeVar("B", bound=CodaExtensions, contravariant=True)


class Adapter(Protocol[B]):
    """One protocol's create route. ``id_header``: the response header carrying the id.
    ``parse`` checks the model first (``ServerState.check_model``: with several models it
    routes the rest of the call), then everything else, and returns the frozen plan."""

    # NOTE: read-only, so an adapter's narrower class attribute (``kind = "chat"``,
    # ``id_header = "x-request-id"``) satisfies it: a mutable protocol member is invariant
    @property
    def kind(self) -> RecordKind: ...

    @property
    def id_prefix(self) -> str: ...

    @property
    def id_header(self) -> str | None: ...

    async def parse(self, st: ServerState, body: B) -> Parsed: ...

    def final(self, record: Record, terminals: list[Terminal] | None) -> Response:
        """The answer of a call that did not stream (``terminals`` None: a background call
        answered at once, still running)."""
        ...


async def create(request: Request, parsed: Parsed, adapter: Adapter[B]) -> Response:
    """Submit → store → stream or wait → final, for any protocol (``parsed``: the adapter's)."""
    st = state_of(request)
    handles = st.submit_all(parsed.requests, parsed.rename)
    record = Record(parsed.id, adapter.kind, handles, now(), st.engine.model_name, parsed.spec,
                    background=parsed.background)
    st.store.put(record)
    if not parsed.keep:
        st.forget_when_done(record)  # NOTE: not kept for resume once it ended (privacy)
    if parsed.background:
        for h in handles:
            st.keep_draining(h)  # NOTE: acks the log so nobody-reading never overflows
        if not parsed.stream:
            return adapter.final(record, None)
    headers = {adapter.id_header: parsed.id} if adapter.id_header else None
    done = await stream_or_wait(request, st, record, stream=parsed.stream,
                                policy=parsed.on_disconnect or st.settings.on_disconnect,
                                headers=headers)
    if isinstance(done, Response):
        return done
    return adapter.final(record, done)
