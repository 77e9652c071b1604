"""Stream events as bytes and back (the stream log's and the replica feed's wire form; SPEC
P1, P3, L4, L6).

A :class:`~coda.stream.StreamEvent` is plain data (see :mod:`coda.engine.protocol`); this is
its one serialised form, lossless for everything a renderer reads: delta bytes (byte-exact),
token ids, pieces and logprobs, and the whole terminal (state, reason, usage, error, stop,
timings, trailing tokens and how many of them are text, early-stop decision). ``ts`` is the
producer's clock and is not carried (a reader's clock is its own).

Two versions:

* **v2 (written)** — MessagePack (the ``msgpack`` library: a C packer, binary-safe, so a delta
  is raw bytes, not base64; ~1 µs an event against ~10 µs for v1's JSON). An event is one
  MessagePack array ``[seq, kind, data, tokens, model, snapshot, terminal]`` with trailing
  empty fields dropped; a token is ``[id, piece]`` or, with logprobs or the special flag,
  ``[id, piece, logprob, top, top_pieces, special]``. The request id is not in the event: the
  stream log's key and the feed's batch header carry it once. Several events are the plain
  concatenation of their arrays (a MessagePack stream), so a run can be cut at an event
  boundary by byte offset (what the log's append script does with a partly duplicated run).
  The terminal is the v1 JSON object as a string (one per request; its cost does not matter).
* **v1 (read only)** — one JSON object per event (``encode_event``/``decode_event``), what
  logs written before v2 hold; readers still decode it.
"""

from __future__ import annotations

import base64
import json
import struct
import threading
from typing import Any

import msgpack

from coda.errors import ErrorCode
from coda.finish import FinishReason, Terminal, Usage
from coda.lifecycle import State
from coda.reasoning import ReasoningSplit
from coda.stops import StopHit
from coda.stream import EventType, StreamEvent, TokenInfo


def _tokens(tokens: tuple[TokenInfo, ...]) -> list[list[Any]]:
    return [[t.token_id, t.logprob, [list(p) for p in t.top_logprobs], t.piece.hex(),
             [p.hex() for p in t.top_pieces], t.special] for t in tokens]


def _untokens(raw: list[list[Any]]) -> tuple[TokenInfo, ...]:
    out = []
    for row in raw:
        i, lp, top = row[:3]
        # NOTE: rows written before pieces were carried have three fields
        piece, top_pieces, special = row[3:6] if len(row) >= 6 else ("", [], False)
        out.append(TokenInfo(int(i), lp, tuple((int(a), float(b)) for a, b in top),
                             piece=bytes.fromhex(piece),
                             top_pieces=tuple(bytes.fromhex(p) for p in top_pieces),
                             special=bool(special)))
    return tuple(out)


def _terminal(t: Terminal) -> dict[str, Any]:
    stop = None
    if t.stop is not None:
        stop = {"kind": t.stop.kind, "index": t.stop.index, "start": t.stop.start,
                "end": t.stop.end,
                "stop": t.stop.stop if isinstance(t.stop.stop, str) else list(t.stop.stop)}
    return {"state": t.state.value, "finish_reason": t.finish_reason.value,
            "usage": t.usage.to_dict(),
            "error_code": t.error_code.value if t.error_code is not None else None,
            "error_message": t.error_message, "stop": stop, "timings": dict(t.timings()),
            "trailing_tokens": _tokens(t.trailing_tokens),
            "early_stop": dict(t.early_stop) if t.early_stop is not None else None,
            "dropped_tail": base64.b64encode(t.dropped_tail).decode("ascii"),
            "versions": [t.finish_reason_version, t.stop_rule_version],
            "model_snapshot": t.model_snapshot,
            "reasoning": _split(t.reasoning),
            "speculative": dict(t.speculative) if t.speculative is not None else None,
            "prompt_logprobs": _tokens(t.prompt_logprobs),
            "trailing_shown": t.trailing_shown,
            "prediction": dict(t.prediction) if t.prediction is not None else None}


def _split(r: ReasoningSplit | None) -> dict[str, Any] | None:
    if r is None:
        return None
    return {"opener": r.opener.hex(), "bytes": r.reasoning_bytes, "closer": r.closer.hex(),
            "forced": r.forced, "tokens": r.reasoning_tokens}


def _unsplit(d: dict[str, Any] | None) -> ReasoningSplit | None:
    if d is None:
        return None
    return ReasoningSplit(bytes.fromhex(d["opener"]), int(d["bytes"]), bytes.fromhex(d["closer"]),
                          bool(d["forced"]), int(d["tokens"]))


def _unterminal(d: dict[str, Any]) -> Terminal:
    stop = None
    if d["stop"] is not None:
        s = d["stop"]
        value = s["stop"] if isinstance(s["stop"], str) else tuple(int(i) for i in s["stop"])
        stop = StopHit(s["kind"], s["index"], value, s["start"], s["end"])
    return Terminal(State(d["state"]), FinishReason(d["finish_reason"]), Usage(**d["usage"]),
                    ErrorCode(d["error_code"]) if d["error_code"] is not None else None,
                    d["error_message"], stop, **d["timings"],
                    trailing_tokens=_untokens(d["trailing_tokens"]), early_stop=d["early_stop"],
                    dropped_tail=base64.b64decode(d.get("dropped_tail", "")),
                    finish_reason_version=int(d["versions"][0]),
                    stop_rule_version=str(d["versions"][1]),
                    model_snapshot=d.get("model_snapshot"), reasoning=_unsplit(d.get("reasoning")),
                    speculative=d.get("speculative"),
                    prompt_logprobs=_untokens(d.get("prompt_logprobs", [])),
                    trailing_shown=int(d.get("trailing_shown", 0)),
                    prediction=d.get("prediction"))


def encode_event(ev: StreamEvent) -> bytes:
    body: dict[str, Any] = {"r": ev.request_id, "s": ev.seq, "t": ev.type.value}
    if ev.data:
        body["d"] = base64.b64encode(ev.data).decode("ascii")
    if ev.tokens:
        body["k"] = _tokens(ev.tokens)
    if ev.model is not None:
        body["m"] = ev.model
    if ev.model_snapshot is not None:
        body["i"] = ev.model_snapshot
    if ev.terminal is not None:
        body["x"] = _terminal(ev.terminal)
    if ev.cached_prompt_tokens is not None:
        body["c"] = ev.cached_prompt_tokens
    if ev.reasoning:
        body["z"] = 1
    return json.dumps(body, separators=(",", ":")).encode()


def decode_event(raw: bytes | str) -> StreamEvent:
    body = json.loads(raw)
    return StreamEvent(body["r"], int(body["s"]), EventType(body["t"]),
                       base64.b64decode(body["d"]) if "d" in body else b"",
                       _untokens(body["k"]) if "k" in body else (), body.get("m"),
                       body.get("i"), _unterminal(body["x"]) if "x" in body else None,
                       cached_prompt_tokens=body.get("c"), reasoning=bool(body.get("z")))


# -- v2: MessagePack ---------------------------------------------------------------------------
_local = threading.local()
_KIND = {EventType.START: 0, EventType.DELTA: 1, EventType.TERMINAL: 2}
_TYPES = (EventType.START, EventType.DELTA, EventType.TERMINAL)


def _tokens_v2(tokens: tuple[TokenInfo, ...]) -> list[Any]:
    return [[t.token_id, t.piece] if t.logprob is None and not t.top_logprobs
            and not t.top_pieces and not t.special
            else [t.token_id, t.piece, t.logprob, t.top_logprobs, t.top_pieces, t.special]
            for t in tokens]


def _row(ev: StreamEvent) -> list[Any]:
    if (ev.type is EventType.DELTA and ev.model is None and ev.model_snapshot is None
            and ev.terminal is None and ev.cached_prompt_tokens is None
            and not ev.reasoning):  # NOTE: common case
        return ([ev.seq, 1, ev.data, _tokens_v2(ev.tokens)] if ev.tokens
                else [ev.seq, 1, ev.data or None])
    row = [ev.seq, _KIND[ev.type], ev.data or None,
           _tokens_v2(ev.tokens) if ev.tokens else None, ev.model, ev.model_snapshot,
           json.dumps(_terminal(ev.terminal), separators=(",", ":"))
           if ev.terminal is not None else None, ev.cached_prompt_tokens,
           True if ev.reasoning else None]  # NOTE: issue 23: a reasoning delta
    while row[-1] is None:  # NOTE: seq and kind are never None
        row.pop()
    return row


def _event(rid: str, row: tuple[Any, ...], merge_key: int | None = None) -> StreamEvent:
    n = len(row)
    toks: tuple[TokenInfo, ...] = ()
    if n > 3 and row[3]:
        # NOTE: unpacked with use_list=False, so top_logprobs / top_pieces are tuples already
        toks = tuple(TokenInfo(t[0], piece=t[1]) if len(t) == 2
                     else TokenInfo(t[0], t[2], t[3], t[1], t[4], t[5]) for t in row[3])
    return StreamEvent(rid, row[0], _TYPES[row[1]], (n > 2 and row[2]) or b"", toks,
                       row[4] if n > 4 else None, row[5] if n > 5 else None,
                       _unterminal(json.loads(row[6])) if n > 6 and row[6] else None,
                       cached_prompt_tokens=row[7] if n > 7 else None,
                       reasoning=bool(n > 8 and row[8]), merge_key=merge_key)


def pack_event(ev: StreamEvent) -> bytes:
    """One event in v2 (without its request id); concatenations form a run."""
    out: bytes = msgpack.packb(_row(ev))
    return out


def pack_run(events: list[StreamEvent]) -> tuple[bytes, bytes]:
    """A run of events in v2 (their concatenation) and the byte offsets of events 1..n-1 in
    it as little-endian uint32s (where the log's append script may cut a duplicated prefix)."""
    pack = _packer().pack
    if len(events) == 1:
        return pack(_row(events[0])), b""
    blobs = [pack(_row(ev)) for ev in events]
    offsets, pos = [], 0
    for blob in blobs[:-1]:
        pos += len(blob)
        offsets.append(pos)
    return b"".join(blobs), struct.pack(f"<{len(offsets)}I", *offsets)


def _packer() -> msgpack.Packer:
    # NOTE: a Packer is not thread-safe; one per thread, reused (building one costs ~1 µs)
    p: msgpack.Packer | None = getattr(_local, "packer", None)
    if p is None:
        p = _local.packer = msgpack.Packer()
    return p


def unpack_events(request_id: str, blob: bytes) -> list[StreamEvent]:
    """The events of a concatenation of :func:`pack_event` results, in order."""
    unpacker = msgpack.Unpacker(use_list=False, raw=False)
    unpacker.feed(blob)
    return [_event(request_id, row) for row in unpacker]


def encode_batch(items: list[tuple[str, list[StreamEvent]]]) -> bytes:
    """Events of several requests in one v2 blob (the replica feed's item): per request
    ``[rid, rows]``, or ``[rid, rows, keys]`` when its events carry merge keys (a replica
    writing the log forwards its durable copies: each event's run key, one per row, so the
    ingress merges n > 1 choices in the log's order, P3)."""
    out: bytes = msgpack.packb([_batch_item(rid, evs) for rid, evs in items])
    return out


def _batch_item(rid: str, evs: list[StreamEvent]) -> tuple[Any, ...]:
    rows, keys = [_row(ev) for ev in evs], [ev.merge_key for ev in evs]
    return (rid, rows, keys) if any(k is not None for k in keys) else (rid, rows)


def decode_batch(blob: bytes) -> list[tuple[str, list[StreamEvent]]]:
    out = []
    for item in msgpack.unpackb(blob, use_list=False, raw=False):
        rid, rows = item[0], item[1]
        keys = item[2] if len(item) > 2 else (None,) * len(rows)
        out.append((rid, [_event(rid, row, key) for row, key in zip(rows, keys, strict=True)]))
    return out
