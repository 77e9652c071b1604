"""How an orphan ends: the one terminal written for a request whose producer is gone (issue 12
item 3; SPEC P4, L2, L5, L6).

A reaper (:meth:`~coda.durable.redis_log.RedisStreamLog.reap`) ends an open request whose
owner's lease is gone, choosing the terminal from the request's meta hash:

- the dead owner is the **ingress** that opened the request for a replica (meta ``ingress``
  names it: it routes, it runs no model) and the request is not ``detach``ed: no replica holds
  it (a claim moves the owner to the replica), so what died is the client's connection, held
  by that ingress. P4's declared policy for such a request is ``cancel``: ``CANCELLED``,
  ``transport_error`` (:attr:`~coda.finish.CancelCause.DISCONNECT`; a disconnect is never a
  model failure, L5), the terminal the replica's orphan watch writes for the same request
  once it holds it (:mod:`coda.scaleout.producer`);
- the dead owner is that ingress and the request **is** ``detach``ed (background, P4
  ``continue``): the client was promised it runs without its connection, and no model ran it
  yet. It is **adopted** (:func:`adoptable`): a surviving front end with replicas, whose log
  has an ``adopter`` (:class:`~coda.scaleout.remote.RemoteEngine`), takes it over in one
  fenced script (:data:`coda.durable.lua.ADOPT`: it becomes the request's ingress) and submits
  it from the request the dead ingress stored at open (meta ``req``) to a replica, which claims
  it from the adopter; the client reading the stream by id sees it run to its end. A reaper
  that cannot adopt (a replica's, a server without replicas) leaves it to one that can for
  :data:`ADOPT_GRACE_LEASES` leases from when a reaper first saw it orphaned (meta
  ``orphan_ms``, Redis's clock), then ends it: ``FAILED``, ``transport_error`` naming the lost
  ingress (no model failed, L5) — as it ends at once one that cannot be adopted (no ``req``;
  a ``req`` no front end reads, :mod:`coda.durable.request_codec`, waits out the grace);
- otherwise the process running the model died (a server without replicas, a replica):
  ``FAILED``, ``model_error``.

Each bills the committed tokens: those of the durable deltas (L6).
"""

from __future__ import annotations

from coda.errors import ErrorCode
from coda.finish import CancelCause, FinishReason, Terminal, Usage
from coda.lifecycle import State
from coda.stream import EventType, StreamEvent

# NOTE: how long (in leases) a reaper that cannot adopt leaves an adoptable orphan to one that
# can: adopters try every lease / 3, so three leases are nine of their rounds
ADOPT_GRACE_LEASES = 3


def ingress_orphan(meta: dict[bytes, bytes]) -> bool:
    """The request is still owned by the ingress that opened it for a replica: no replica
    claimed it (a claim moves the owner)."""
    owner = meta.get(b"owner", b"")
    return bool(owner) and meta.get(b"ingress", b"") == owner


def adoptable(meta: dict[bytes, bytes]) -> bool:
    """A detached request no replica claimed whose ingress stored what it was asked (``req``):
    a surviving front end can run it (the module's rules)."""
    return ingress_orphan(meta) and b"detach" in meta and b"req" in meta


def committed_usage(events: list[StreamEvent], prompt_tokens: int) -> Usage:
    """What a request ended by someone other than its producer bills: the tokens and bytes
    of its deltas in ``events`` (the durable ones), and its prompt (L6)."""
    deltas = [e for e in events if e.type is EventType.DELTA]
    committed = sum(len(e.tokens) for e in deltas)
    return Usage(prompt_tokens=prompt_tokens, selected_tokens=committed,
                 processed_output_tokens=committed, returned_tokens=committed,
                 returned_bytes=sum(len(e.data) for e in deltas))


def failed_terminal(events: list[StreamEvent], prompt_tokens: int, message: str) -> Terminal:
    """The one ``model_error`` terminal of a request whose producer is gone: ``FAILED``,
    billing the committed tokens — those of the deltas in ``events`` (L5, L6)."""
    return Terminal(State.FAILED, FinishReason.MODEL_ERROR,
                    committed_usage(events, prompt_tokens), ErrorCode.MODEL_ERROR, message)


def orphan_terminal(meta: dict[bytes, bytes], events: list[StreamEvent]) -> Terminal:
    """The terminal a reaper writes for the orphan whose meta hash is ``meta`` and whose
    durable events are ``events`` (the rules above)."""
    owner = meta.get(b"owner", b"").decode()
    prompt = int(meta.get(b"prompt", 0))
    if ingress_orphan(meta) and b"detach" in meta:
        return Terminal(State.FAILED, FinishReason.TRANSPORT_ERROR,
                        committed_usage(events, prompt), ErrorCode.TRANSPORT_ERROR,
                        f"the ingress that accepted this detached request ({owner}) stopped "
                        "(its lease expired) before any replica claimed it, and no front end "
                        "adopted it; no model ran it")
    if ingress_orphan(meta):
        return Terminal(State.CANCELLED, CancelCause.DISCONNECT.finish_reason,
                        committed_usage(events, prompt), None,
                        f"client connection lost: the ingress that held it ({owner}) stopped "
                        "(its lease expired) while no replica held the request; "
                        "on_disconnect=cancel")
    return failed_terminal(events, prompt, f"the server that owned this request ({owner}) "
                                           "stopped; its lease expired")
