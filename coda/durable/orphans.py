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
- otherwise the process running the model died (a server without replicas, a replica), or the
  request was to run on without a client and nothing runs it: ``FAILED``, ``model_error``.

Both bill the committed tokens: those of the durable deltas (L6).
"""

from __future__ import annotations

from coda.errors import ErrorCode
from coda.finish import CancelCause, FinishReason, Usage
from coda.lifecycle import State
from coda.stream import EventType, StreamEvent, Terminal


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
    if owner and meta.get(b"ingress", b"").decode() == owner and b"detach" not in meta:
        return Terminal(State.CANCELLED, CancelCause.DISCONNECT.finish_reason,
                        committed_usage(events, prompt), None,
                        f"client connection lost: the ingress that held it ({owner}) stopped "
                        "(its lease expired) while no replica held the request; "
                        "on_disconnect=cancel")
    return failed_terminal(events, prompt, f"the server that owned this request ({owner}) "
                                           "stopped; its lease expired")
