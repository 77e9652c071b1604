"""Stream events as JSON bytes and back (the stream log's wire form; SPEC P1, P3, L4, L6).

A :class:`~coda.stream.StreamEvent` is plain data (see :mod:`coda.engine.protocol`); this is
its one serialised form, lossless for everything a renderer reads: delta bytes (base64, so a
delta is byte-exact), token ids and logprobs, and the whole terminal (state, reason, usage,
error, stop, timings, trailing tokens, early-stop decision). ``ts`` is the producer's clock and
is not carried (a reader's clock is its own).
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict
from typing import Any

from coda.errors import ErrorCode
from coda.finish import FinishReason, Usage
from coda.lifecycle import State
from coda.stops import StopHit
from coda.stream import EventType, StreamEvent, Terminal, Timings, TokenInfo


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
            "error_message": t.error_message, "stop": stop, "timings": asdict(t.timings),
            "trailing_tokens": _tokens(t.trailing_tokens),
            "early_stop": dict(t.early_stop) if t.early_stop is not None else None,
            "dropped_tail": base64.b64encode(t.dropped_tail).decode("ascii"),
            "versions": [t.finish_reason_version, t.stop_rule_version],
            "model_snapshot": t.model_snapshot}


def _unterminal(d: dict[str, Any]) -> Terminal:
    stop = None
    if d["stop"] is not None:
        s = d["stop"]
        value = s["stop"] if isinstance(s["stop"], str) else tuple(int(i) for i in s["stop"])
        stop = StopHit(s["kind"], s["index"], value, s["start"], s["end"])
    return Terminal(State(d["state"]), FinishReason(d["finish_reason"]), Usage(**d["usage"]),
                    ErrorCode(d["error_code"]) if d["error_code"] is not None else None,
                    d["error_message"], stop, Timings(**d["timings"]),
                    _untokens(d["trailing_tokens"]), d["early_stop"],
                    base64.b64decode(d.get("dropped_tail", "")),
                    int(d["versions"][0]), str(d["versions"][1]), d.get("model_snapshot"))


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
    return json.dumps(body, separators=(",", ":")).encode()


def decode_event(raw: bytes | str) -> StreamEvent:
    body = json.loads(raw)
    return StreamEvent(body["r"], int(body["s"]), EventType(body["t"]),
                       base64.b64decode(body["d"]) if "d" in body else b"",
                       _untokens(body["k"]) if "k" in body else (), body.get("m"),
                       body.get("i"), _unterminal(body["x"]) if "x" in body else None)
