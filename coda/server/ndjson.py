"""Newline-delimited JSON framing for the one streaming pump (:class:`~coda.server.sse.
SSEResponse`; SPEC P2, P4, P6): a renderer deriving from :class:`NDJSONRenderer` makes
:class:`JSONLine` frames, and the pump writes them as ``application/x-ndjson`` with no
keepalive line (every line must parse as JSON; a quiet stream is watched for disconnects by
the connection, not by writes). Ollama's ``/api/chat`` and ``/api/generate`` stream this way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from coda.server.sse import Frame, Renderer


@dataclass(frozen=True)
class JSONLine(Frame):
    """One JSON object on one line (``event`` and ``id`` are not part of NDJSON)."""

    def encode(self) -> bytes:
        return (json.dumps(self.data, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


class NDJSONRenderer(Renderer):
    """A renderer whose frames are JSON lines (no ids: the stream is not resumable by id)."""

    position_ids = False
    media_type = "application/x-ndjson"
    keepalive = None
