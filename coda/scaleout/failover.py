"""What a failed replica call means for its request (issue 12 item 3; seed 004; SPEC L2, L5,
L6): resubmit it, or end it exactly once.

"The first frame" (seed 004) is, with a durable log, the first delta durably appended — the
ingress asks the log, never its own copy, and takes the request back by compare-and-set on its
fencing token before deciding (:mod:`coda.scaleout.producer`); without a log it is the first
delta the ingress received. Before it, the request is resubmitted to another replica (same
seed: the same output); after it, it ends once with ``model_error``, billing the committed
tokens, and the client sees exactly what the log holds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from coda.durable.mirror import feed
from coda.errors import ErrorCode
from coda.finish import FinishReason, Terminal, Usage
from coda.lifecycle import State
from coda.stream import EventType, StreamEvent

if TYPE_CHECKING:
    from coda.durable.redis_log import RedisStreamLog
    from coda.scaleout.remote_handle import RemoteHandle

log = logging.getLogger("coda.scaleout")


async def settle(h: RemoteHandle, dlog: RedisStreamLog | None, model_name: str,
                 got_delta: bool, exc: BaseException, can_retry: bool) -> bool:
    """After a failed replica call: True if the request is to be resubmitted, else it is
    ended (its copy closed) on return. Without a log: resubmit iff no delta reached the
    ingress. With one (``dlog``, the ingress's RedisStreamLog), the log decides (seed 004),
    :func:`settle_from_log`; while Redis cannot be reached the decision waits (up to
    ``lease_ttl`` × 3, then it ends locally)."""
    if h.stream.closed:
        return False
    if dlog is None:
        if got_delta or not can_retry:
            fail(h, exc)
            return False
        return True
    deadline = time.monotonic() + 3 * dlog.lease_ttl_ms / 1000
    while True:
        try:
            return await asyncio.to_thread(settle_from_log, h, dlog, model_name, exc,
                                           can_retry)
        except Exception:  # NOTE: redis.RedisError; coda.durable is imported lazily
            log.exception("stream log unreachable while settling a replica failure",
                          extra={"request_id": h.request_id})
            if time.monotonic() > deadline:
                fail(h, exc)
                return False
            await asyncio.sleep(0.5)


def settle_from_log(h: RemoteHandle, dlog: RedisStreamLog, model_name: str,
                    exc: BaseException, can_retry: bool) -> bool:
    """Take the request back from the failed replica (compare-and-set on the fencing
    token it holds, so a replica that is only slow is fenced out). No durable delta and
    another replica left → True (resubmit). Otherwise write the one ``model_error``
    terminal billing the durable deltas — unless the log already has a terminal or a peer
    took it over — and feed the copy from the log up to that terminal (the client sees
    exactly the log)."""
    from coda.durable.orphans import failed_terminal

    rid = h.request_id
    meta = dlog.meta(rid)
    code, last = -1, -1
    # NOTE: a front end that adopted it (this one's lease lapsed, coda.scaleout.adopt) is its
    # ingress now: follow the log, never take it back
    if meta.get("ingress", dlog.server_id) == dlog.server_id:
        code, last = dlog.take(rid, meta.get("fence", ""))
    if code == 1 and last <= 0 and can_retry:
        return True
    if code == 1:
        evs = dlog.read(rid)
        if not evs:  # NOTE: not even the start event is durable: write it first
            evs = [StreamEvent(rid, 0, EventType.START, model=model_name)]
            dlog.append(evs[0])
        term = failed_terminal(evs, h.prompt_tokens, f"replica lost: {type(exc).__name__}")
        dlog.append(StreamEvent(rid, len(evs), EventType.TERMINAL, terminal=term))
    while not h.stream.closed:
        evs = dlog.wait(rid, h.stream.last_seq, 1.0)
        if not evs and not dlog.exists(rid):  # NOTE: expired: nothing left to follow
            fail(h, exc)
        feed(h.stream, evs)
    return False


def fail(h: RemoteHandle, exc: BaseException) -> None:
    """End the request's copy once: ``model_error``, billing the deltas it holds."""
    s = h.stream
    if s.closed:
        return
    if s.last_seq < 0:
        s.start("")
    evs = s.events_after(-1)
    committed = sum(len(e.tokens) for e in evs if e.type is EventType.DELTA)
    s.close(Terminal(State.FAILED, FinishReason.MODEL_ERROR,
                     Usage(prompt_tokens=h.prompt_tokens, selected_tokens=committed,
                           processed_output_tokens=committed, returned_tokens=committed,
                           returned_bytes=sum(len(e.data) for e in evs)),
                     ErrorCode.MODEL_ERROR, f"replica lost: {type(exc).__name__}"))
