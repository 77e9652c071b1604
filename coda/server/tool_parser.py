"""Tool calls out of the output text, by the call's own structure (issue 13 item 1, issue 20 D3;
SPEC S1, K2).

A call is ``<tool_call>`` + whitespace + one JSON object + whitespace + ``</tool_call>``; the
grammar (:func:`coda.server.tool_grammar.grammar_for`) writes exactly ``<tool_call>\\n{"name": "NAME",
"arguments": ARGS}\\n</tool_call>``. Where the call *ends* is decided by the JSON object, never
by searching the text for the close tag: :class:`_ObjectScanner` follows the JSON structure
character by character (nesting depth, inside a string, after a backslash) as text arrives, so
the end is the ``}`` that closes the object at depth 0. A string argument that contains
``</tool_call>``, quotes, backslashes or braces therefore never ends a call early. The closed
object is then decoded member by member with the standard library's JSON decoder
(:func:`_members`), which also yields the exact source span of ``arguments``: a call's
``arguments`` are the bytes the model generated (K2: moved, not rewritten).

Outside calls the opening tag is searched in the text (the grammar allows it only as the start
of a call, ``auto``); a suffix that could still become the tag is held back, like a stop-string
prefix (S2), so the tag never leaks as text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_WS = " \t\n\r"
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    """A complete call: its 0-based position in the answer, name and arguments (JSON text, as
    generated)."""

    index: int
    name: str
    arguments: str

    def call_id(self, request_id: str, choice: int = 0) -> str:
        # NOTE: a pure function of the request, choice and position, so replays repeat it (P3);
        # choice 0 keeps the one-choice form, later choices (`n` > 1) name theirs
        where = f"{choice}_{self.index}" if choice else str(self.index)
        return f"call_{request_id[-16:]}_{where}"


Item = str | ToolCall


class _ObjectScanner:
    """Where a JSON object that starts a text ends, found incrementally (linear in the text).

    ``push`` reads the next characters; :attr:`end` becomes the index just past the ``}``
    that closes the object, or :attr:`bad` becomes True when the text cannot start an object
    (a character other than whitespace before ``{``). Valid JSON is assumed after the ``{``
    (the grammar guarantees it); :func:`_members` checks it when the object is closed."""

    def __init__(self) -> None:
        self.pos = 0
        self.depth = 0
        self.in_str = False
        self.esc = False
        self.end: int | None = None
        self.bad = False

    def push(self, text: str) -> None:
        i = self.pos
        n = len(text)
        while i < n and self.end is None and not self.bad:
            c = text[i]
            i += 1
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
            elif self.depth == 0:
                if c == "{":
                    self.depth = 1
                elif c not in _WS:
                    self.bad = True
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = i
        self.pos = i


def _members(text: str) -> list[tuple[str, Any, int, int]] | None:
    """The members of the JSON object ``text`` (surrounding whitespace allowed) as (key, value,
    start, end of the value's source), or None if ``text`` is not exactly one object."""
    scan = json.decoder.scanstring  # type: ignore[attr-defined]
    s = text.strip(_WS)
    off = len(text) - len(text.lstrip(_WS))
    if not s.startswith("{"):
        return None
    out: list[tuple[str, Any, int, int]] = []
    i = 1
    try:
        i = _skip(s, i)
        if s[i] == "}":
            return out if i + 1 == len(s) else None
        while True:
            if s[i] != '"':
                return None
            key, i = scan(s, i + 1)
            i = _skip(s, i)
            if s[i] != ":":
                return None
            start = _skip(s, i + 1)
            value, i = _DECODER.raw_decode(s, start)
            out.append((key, value, off + start, off + i))
            i = _skip(s, i)
            if s[i] == "}":
                return out if i + 1 == len(s) else None
            if s[i] != ",":
                return None
            i = _skip(s, i + 1)
    except (ValueError, IndexError):
        return None


def _skip(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def parse_call(body: str, index: int) -> ToolCall | None:
    """The call whose JSON object is ``body`` (``{"name": ..., "arguments": ...}``), or None."""
    members = _members(body)
    if members is None:
        return None
    by_key = {k: (v, a, b) for k, v, a, b in members}
    name = by_key.get("name", (None, 0, 0))[0]
    if not isinstance(name, str) or len(by_key) != len(members):
        return None
    if "arguments" not in by_key:
        return ToolCall(index, name, "{}")
    value, a, b = by_key["arguments"]
    if isinstance(value, str):  # NOTE: some models emit the arguments as a JSON string
        try:
            json.loads(value)
        except ValueError:
            return None
        return ToolCall(index, name, value)
    return ToolCall(index, name, body[a:b])


def _tag_prefix_len(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of the open tag."""
    for n in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1):
        if OPEN_TAG.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """Incremental text → text pieces and complete :class:`ToolCall` s (see module doc)."""

    def __init__(self) -> None:
        self._buf = ""          # held text (a possible tag prefix) or an open call's body
        self._scan: _ObjectScanner | None = None  # set while inside a call
        self._after_call = False  # the newline that separates parallel calls may follow
        self.calls = 0
        self.removed_bytes = 0  # K2: bytes of calls moved out of the text stream

    def feed(self, text: str) -> list[Item]:
        out: list[Item] = []
        self._buf += text
        while True:
            if self._scan is not None:
                if not self._in_call(out):
                    return out
                continue
            if self._after_call and self._buf:
                # NOTE: the newline between parallel calls belongs to the call syntax
                self._after_call = False
                if self._buf.startswith("\n"):
                    self._buf = self._buf[1:]
                    self.removed_bytes += 1
            start = self._buf.find(OPEN_TAG)
            if start >= 0:
                if start:
                    out.append(self._buf[:start])
                self._buf = self._buf[start + len(OPEN_TAG):]
                self._scan = _ObjectScanner()
                continue
            keep = _tag_prefix_len(self._buf)
            cut = len(self._buf) - keep
            if cut:
                out.append(self._buf[:cut])
                self._buf = self._buf[cut:]
            return out

    def _in_call(self, out: list[Item]) -> bool:
        """Advance the open call; True when it was resolved (a call, or text after all)."""
        scan = self._scan
        assert scan is not None
        scan.push(self._buf)
        if scan.bad:
            return self._not_a_call(out, scan.pos - 1)
        if scan.end is None:
            return False
        rest = self._buf[scan.end:]
        gap = len(rest) - len(rest.lstrip(_WS))
        tail = rest[gap:]
        if not tail.startswith(CLOSE_TAG):
            if CLOSE_TAG.startswith(tail):
                return False  # NOTE: whitespace and part of the close tag so far: wait
            return self._not_a_call(out, scan.end)
        call = parse_call(self._buf[:scan.end], self.calls)
        if call is None:
            return self._not_a_call(out, scan.end)
        used = scan.end + gap + len(CLOSE_TAG)
        self.removed_bytes += len((OPEN_TAG + self._buf[:used]).encode())
        self._buf = self._buf[used:]
        self._scan = None
        self.calls += 1
        self._after_call = True
        out.append(call)
        return True

    def _not_a_call(self, out: list[Item], upto: int) -> bool:
        # NOTE: never under the grammar; without it, what looked like a call stays text
        out.append(OPEN_TAG + self._buf[:upto])
        self._buf = self._buf[upto:]
        self._scan = None
        return True

    def finish(self) -> list[Item]:
        """The end of the output: held text, or an unclosed call (e.g. cut by max_tokens),
        is returned as text so that nothing the model wrote is lost."""
        rest = (OPEN_TAG if self._scan is not None else "") + self._buf
        self._buf, self._scan = "", None
        return [rest] if rest else []


def split(text: str) -> tuple[str, list[ToolCall], int]:
    """A whole output: (text outside calls, calls, bytes removed)."""
    p = ToolCallParser()
    items = p.feed(text) + p.finish()
    return ("".join(i for i in items if isinstance(i, str)),
            [i for i in items if isinstance(i, ToolCall)], p.removed_bytes)


def texts(items: Iterable[Item]) -> str:
    return "".join(i for i in items if isinstance(i, str))


def primed(texts_before: Iterable[str]) -> ToolCallParser:
    """A parser in the state it had after ``texts_before`` (a resumed stream, P3)."""
    p = ToolCallParser()
    for t in texts_before:
        p.feed(t)
    return p
