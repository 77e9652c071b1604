"""The one create handler every generation route runs (issue 22 step 2; SPEC P3, P4, L5).

A protocol is an :class:`Adapter`: ``parse`` turns its body into a :class:`Parsed` (the
prompts' token ids, the knobs the engine requests are built from, and the typed render spec),
``renderer`` rebuilds its renderer from a record, and ``final`` writes the answer of a call
that did not stream. :func:`create` does the rest the same way for all of them: model check,
engine requests, submit (all or none), the record in the store, the P4 policy, streaming or
waiting. Adapters: chat and completions (:mod:`~coda.server.openai_routes`), Messages
(:mod:`~coda.server.anthropic_routes`), Responses (:mod:`~coda.server.responses_routes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar

from fastapi import Request
from starlette.responses import Response

from coda.engine.types import GenerationRequest
from coda.server.common import new_id, now, state_of, stream_or_wait
from coda.server.params import Knobs, build_requests, rename_map
from coda.server.render_spec import RecordKind, RenderSpec
from coda.server.schemas import CodaExtensions
from coda.server.state import DisconnectPolicy, Record, ServerState
from coda.stream import Terminal

B = TypeVar("B", bound=CodaExtensions, contravariant=True)


@dataclass(frozen=True)
class Parsed:
    """What an adapter made of one body: everything :func:`create` needs from it.
    ``keep``: the record stays readable after it ended (False: forgotten at its end)."""

    prompts: list[list[int]]
    knobs: Knobs
    spec: RenderSpec
    stream: bool
    on_disconnect: DisconnectPolicy | None = None
    background: bool = False
    keep: bool = True


class Adapter(Protocol[B]):
    """One protocol's create route. ``id_header``: the response header carrying the id."""

    kind: RecordKind
    id_prefix: str
    id_header: str | None

    async def parse(self, st: ServerState, body: B) -> Parsed: ...

    def final(self, record: Record, terminals: list[Terminal] | None) -> Response:
        """The answer of a call that did not stream (``terminals`` None: a background call
        answered at once, still running)."""
        ...


async def create(request: Request, body: B, adapter: Adapter[B]) -> Response:
    """Parse → submit → store → stream or wait → final, for any protocol."""
    st = state_of(request)
    st.check_model(body.model)  # type: ignore[attr-defined]  # NOTE: every create body has one
    parsed = await adapter.parse(st, body)
    rid = new_id(adapter.id_prefix)
    requests: list[GenerationRequest] = []
    for k, ids in enumerate(parsed.prompts):
        requests += build_requests(
            body, parsed.knobs, ids, request_id=rid if len(parsed.prompts) == 1 else f"{rid}-p{k}",
            default_max_tokens=st.engine_config.default_max_tokens,
            backpressure=st.settings.backpressure)
    handles = st.submit_all(requests, rename_map(parsed.knobs))
    record = Record(rid, adapter.kind, handles, now(), st.engine.model_name, parsed.spec,
                    background=parsed.background)
    st.store.put(record)
    if not parsed.keep:
        st.forget_when_done(record)  # NOTE: not kept for resume once it ended (privacy)
    if parsed.background:
        for h in handles:
            st.keep_draining(h)  # NOTE: acks the log so nobody-reading never overflows
        if not parsed.stream:
            return adapter.final(record, None)
    headers = {adapter.id_header: rid} if adapter.id_header else None
    done = await stream_or_wait(request, st, record, stream=parsed.stream,
                                policy=parsed.on_disconnect or st.settings.on_disconnect,
                                headers=headers)
    if isinstance(done, Response):
        return done
    return adapter.final(record, done)

