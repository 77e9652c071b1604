"""What a client sees of one request, per protocol, and the streaming invariants (issue 20
item 4; SPEC S3, K2, K3, P1, P3).

:func:`observe_stream` turns parsed SSE events of Chat Completions, Completions, Responses or
Anthropic Messages into an :class:`Observed`; :func:`observe_body` does the same for the
non-streamed JSON body (200, or the 500 of a FAILED request). :class:`Tally` runs the four
invariants of the issue and counts every check and every violation:

* ``stop_leak``: no stop string occurs in any streamed prefix of the text (S3);
* ``utf8``: every text and argument delta is valid UTF-8 on its own, and where the delta is
  stamped (``stream_verify``) its bytes are exactly the output's bytes at its offset (K2, K3);
* ``tool_prefix``: every partial tool-call argument string is a prefix of the final one;
* ``equal``: streamed == non-streamed (text, tool calls, finish reason, usage, ``coda``) (P1).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tests.sse_parse import SSEEvent

PROTOCOLS = ("chat", "completions", "responses", "messages")
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
         "responses": "/v1/responses", "messages": "/v1/messages"}


@dataclass
class Observed:
    """One request as the client sees it. ``calls`` are ``(name, arguments)`` in order;
    ``arg_deltas`` the argument pieces per call, in the order they arrived."""

    text_deltas: list[str] = field(default_factory=list)
    stamps: list[dict[str, Any] | None] = field(default_factory=list)
    arg_deltas: dict[str, list[str]] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)
    finish: str | None = None
    usage: tuple[int, int] | None = None
    coda: dict[str, Any] | None = None
    error: str | None = None
    # Anthropic (issue 20 D9): (input_tokens, cache_read_input_tokens) as message_start / the final
    # usage split them (``usage`` adds them: the prompt's size, whatever the cache held)
    start_split: tuple[int, int] | None = None
    final_split: tuple[int, int] | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_deltas)

    @property
    def calls(self) -> list[tuple[str, str]]:
        return [(self.names.get(k, ""), "".join(v)) for k, v in self.arg_deltas.items()]


def _coda_key(coda: dict[str, Any] | None) -> tuple[Any, ...] | None:
    if coda is None:
        return None
    u = coda.get("usage") or {}
    # NOTE: cached / processed prompt tokens depend on what the prefix cache held: not compared
    return (coda.get("finish_reason"), coda.get("state"), coda.get("matched_stop"),
            u.get("prompt_tokens"), u.get("selected_tokens"), u.get("returned_tokens"),
            u.get("returned_bytes"))


def _split(u: dict[str, Any]) -> tuple[int, int]:
    return u.get("input_tokens", 0), u.get("cache_read_input_tokens") or 0


def _anthropic_usage(u: dict[str, Any]) -> tuple[int, int]:
    return (u.get("input_tokens", 0) + (u.get("cache_read_input_tokens") or 0),
            u.get("output_tokens", 0))


# ---------------------------------------------------------------------------- streamed
def observe_stream(protocol: str, events: list[SSEEvent]) -> Observed:
    obs = Observed()
    for ev in events:
        if ev.data == "[DONE]":
            continue
        obj = json.loads(ev.data)
        {"chat": chat_event, "completions": chat_event, "responses": responses_event,
         "messages": messages_event}[protocol](obs, obj)
    return obs


def chat_event(obs: Observed, obj: dict[str, Any]) -> None:
    if "error" in obj:
        obs.error, obs.finish = obj["error"].get("code"), "failed"
        obs.coda = obj.get("coda")
        return
    for ch in obj.get("choices", []):
        delta = ch.get("delta", ch)   # NOTE: completions chunks carry "text" on the choice
        piece = delta.get("content") if "delta" in ch else ch.get("text")
        if piece:
            obs.text_deltas.append(piece)
            obs.stamps.append(ch.get("coda") if "delta" in ch else obj.get("coda"))
        for d in delta.get("tool_calls") or []:
            key = str(d["index"])
            fn = d.get("function") or {}
            obs.names[key] = obs.names.get(key, "") + (fn.get("name") or "")
            obs.arg_deltas.setdefault(key, []).append(fn.get("arguments") or "")
        if ch.get("finish_reason"):
            obs.finish = ch["finish_reason"]
    if obj.get("coda") and "finish_reason" in obj["coda"]:
        obs.coda = obj["coda"]
    if obj.get("usage"):
        obs.usage = (obj["usage"]["prompt_tokens"], obj["usage"]["completion_tokens"])


def _responses_final(obs: Observed, resp: dict[str, Any]) -> None:
    reason = (resp.get("incomplete_details") or {}).get("reason")
    obs.finish = resp["status"] + (f":{reason}" if reason else "")
    if resp.get("usage"):
        obs.usage = (resp["usage"]["input_tokens"], resp["usage"]["output_tokens"])
    obs.coda = resp.get("coda")
    if resp.get("error"):
        obs.error = resp["error"].get("code")


def responses_event(obs: Observed, obj: dict[str, Any]) -> None:
    kind = obj["type"]
    if kind == "response.output_text.delta":
        obs.text_deltas.append(obj["delta"])
        obs.stamps.append(obj.get("coda"))
    elif kind == "response.output_item.added" and obj["item"]["type"] == "function_call":
        obs.names[obj["item"]["id"]] = obj["item"]["name"]
        obs.arg_deltas.setdefault(obj["item"]["id"], [])
    elif kind == "response.function_call_arguments.delta":
        obs.arg_deltas.setdefault(obj["item_id"], []).append(obj["delta"])
    elif kind in ("response.completed", "response.incomplete", "response.failed"):
        _responses_final(obs, obj["response"])


def messages_event(obs: Observed, obj: dict[str, Any]) -> None:
    kind = obj["type"]
    if kind == "message_start":
        obs.start_split = _split(obj["message"]["usage"])
    elif kind == "content_block_start" and obj["content_block"]["type"] == "tool_use":
        obs.names[str(obj["index"])] = obj["content_block"]["name"]
        obs.arg_deltas.setdefault(str(obj["index"]), [])
    elif kind == "content_block_delta":
        d = obj["delta"]
        if d["type"] == "text_delta":
            obs.text_deltas.append(d["text"])
            obs.stamps.append(obj.get("coda"))
        elif d["type"] == "input_json_delta":
            obs.arg_deltas.setdefault(str(obj["index"]), []).append(d["partial_json"])
    elif kind == "message_delta":
        seq = obj["delta"].get("stop_sequence")
        obs.finish = obj["delta"]["stop_reason"] + (f":{seq}" if seq else "")
        obs.usage = _anthropic_usage(obj["usage"])
        obs.final_split = _split(obj["usage"])
        obs.coda = obj.get("coda")
    elif kind == "error":
        obs.error, obs.finish = obj["error"]["type"], "failed"
        obs.coda = obj.get("coda")


# ---------------------------------------------------------------------------- non-streamed
def observe_body(protocol: str, status: int, body: dict[str, Any]) -> Observed:
    obs = Observed()
    failed = status >= 500
    if protocol in ("chat", "completions"):
        ch = body["choices"][0]
        piece = ch["message"].get("content") if protocol == "chat" else ch.get("text")
        obs.text_deltas = [piece] if piece else []
        for i, tc in enumerate((ch.get("message") or {}).get("tool_calls") or []):
            obs.names[str(i)] = tc["function"]["name"]
            obs.arg_deltas[str(i)] = [tc["function"]["arguments"]]
        obs.finish = "failed" if failed else ch["finish_reason"]
        obs.coda = ch.get("coda") or body.get("coda")
        if body.get("usage"):
            obs.usage = (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"])
        if failed:
            obs.error = body["error"].get("code")
    elif protocol == "responses":
        for item in body.get("output", []):
            if item["type"] == "message":
                text = "".join(c.get("text", "") for c in item["content"])
                obs.text_deltas += [text] if text else []
            elif item["type"] == "function_call":
                obs.names[item["id"]] = item["name"]
                obs.arg_deltas[item["id"]] = [item["arguments"]]
        _responses_final(obs, body)
    else:
        for i, block in enumerate(body.get("content", [])):
            if block["type"] == "text" and block["text"]:
                obs.text_deltas.append(block["text"])
            elif block["type"] == "tool_use":
                obs.names[str(i)] = block["name"]
                obs.arg_deltas[str(i)] = [json.dumps(block["input"], ensure_ascii=False)]
        if failed:
            obs.error, obs.finish = body["error"]["type"], "failed"
        else:
            seq = body.get("stop_sequence")
            obs.finish = body["stop_reason"] + (f":{seq}" if seq else "")
            obs.usage = _anthropic_usage(body["usage"])
        obs.coda = body.get("coda")
    return obs


# ---------------------------------------------------------------------------- invariants
INVARIANTS = ("stop_leak", "utf8", "tool_prefix", "equal")


@dataclass
class Tally:
    """Counts of checks and violations per invariant (plus free-form counters)."""

    checks: Counter[str] = field(default_factory=Counter)
    counts: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)

    def check(self, invariant: str, ok: bool, what: str) -> bool:
        self.checks[invariant] += 1
        if not ok:
            self.violations.append(f"{invariant}: {what}")
        return ok

    def stream(self, label: str, obs: Observed, stops: list[str], reference: Observed,
               *, engine_offsets: bool) -> None:
        """The three per-delta invariants on ``obs`` (``reference``: the non-streamed
        request, whose final arguments the partial ones must prefix). ``engine_offsets``:
        the stamps' offsets count every returned byte (False where tool-call bytes were moved
        out of the text, K2)."""
        prefix = ""
        for piece in obs.text_deltas:
            prefix += piece
            for stop in stops:
                self.check("stop_leak", stop not in prefix, f"{label}: {stop!r} in {prefix!r}")
        done = b""
        for piece, stamp in zip(obs.text_deltas, obs.stamps, strict=True):
            try:
                raw = piece.encode("utf-8")
            except UnicodeEncodeError:
                self.check("utf8", False, f"{label}: delta {piece!r} is not UTF-8")
                continue
            ok = True
            if stamp is not None:
                ok = stamp["length"] == len(raw)
                if engine_offsets:
                    ok = ok and stamp["offset"] == len(done) and \
                        stamp["digest"] == hashlib.sha256(done + raw).hexdigest()
            done += raw
            self.check("utf8", ok, f"{label}: delta {piece!r} stamp {stamp}")
        finals = [a for _, a in reference.calls]
        for i, pieces in enumerate(obs.arg_deltas.values()):
            # NOTE: a call the reference lacks is the ``equal`` check's to report
            final = finals[i] if i < len(finals) else "".join(pieces)
            partial = ""
            for piece in pieces:
                partial += piece
                self.check("utf8", _is_utf8(piece), f"{label}: argument delta {piece!r}")
                ok = final.startswith(partial) or _json_prefix(partial, final)
                self.check("tool_prefix", ok, f"{label}: {partial!r} not a prefix of {final!r}")

    def equal(self, label: str, streamed: Observed, whole: Observed) -> None:
        """P1: the streamed request is the non-streamed one."""
        pairs = {"text": (streamed.text, whole.text),
                 "tool_calls": (_calls_key(streamed), _calls_key(whole)),
                 "finish": (streamed.finish, whole.finish),
                 "usage": (streamed.usage, whole.usage),
                 "coda": (_coda_key(streamed.coda), _coda_key(whole.coda))}
        for what, (a, b) in pairs.items():
            self.check("equal", a == b, f"{label}: {what} streamed {a!r} != non-streamed {b!r}")

    def report(self) -> str:
        """The counts, then the violations grouped by shape (one example each)."""
        lines = [f"{k}: {v}" for k, v in sorted(self.counts.items())]
        lines += [f"checks[{k}]: {self.checks[k]}" for k in INVARIANTS]
        lines.append(f"violations: {len(self.violations)}")
        shapes: dict[str, list[str]] = {}
        for v in self.violations:
            key = re.sub(r"/(rechunk|sdk|cut@\d+|live-cut@\d+)", "", v)
            key = re.sub(r"\d+", "N", key.split(" streamed ")[0].split(" != ")[0])[:110]
            shapes.setdefault(key, []).append(v)
        for key, group in shapes.items():
            lines.append(f"  {len(group)} x {key}\n      e.g. {group[0][:400]}")
        return "\n".join(lines)


def _is_utf8(piece: str) -> bool:
    try:
        piece.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _json_prefix(partial: str, final: str) -> bool:
    """Anthropic's non-streamed ``input`` is an object: the streamed pieces must then form a
    prefix of *some* rendering of it: here, the whole concatenation must parse to it."""
    try:
        return bool(json.loads(final) == json.loads(partial))
    except ValueError:
        return False


def _calls_key(obs: Observed) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for name, args in obs.calls:
        try:
            out.append((name, json.loads(args)))
        except ValueError:
            out.append((name, args))
    return out
