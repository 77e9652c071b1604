"""The official ``openai`` / ``anthropic`` clients as stream readers for the conformance fuzz
(issue 20 item 4; SPEC P1): a transport that hands them a response body in chosen network
reads (replayed bytes or the live server's), and their typed events as an
:class:`~tests.stream_conformance.Observed`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import httpx2

from tests.stream_conformance import Observed, Tally


def rechunked(source: Iterable[bytes], sizes: list[int]) -> Iterator[bytes]:
    """``source``'s bytes re-split into reads of ``sizes`` bytes (cycled)."""
    sizes = [max(1, s) for s in sizes] or [1]
    buf, i = b"", 0
    for block in source:
        buf += block
        while len(buf) >= sizes[i % len(sizes)]:
            n = sizes[i % len(sizes)]
            yield buf[:n]
            buf, i = buf[n:], i + 1
    if buf:
        yield buf


class _Chunked(httpx2.SyncByteStream):
    def __init__(self, source: Iterable[bytes], sizes: list[int],
                 owner: httpx2.Response | None = None) -> None:
        self.source, self.sizes, self.owner = source, sizes, owner

    def __iter__(self) -> Iterator[bytes]:
        return rechunked(self.source, self.sizes)

    def close(self) -> None:
        if self.owner is not None:
            self.owner.close()


class RechunkTransport(httpx2.BaseTransport):
    """The official clients' transport (both SDKs are on ``httpx2``): replays ``raw`` (when
    given) or forwards to the live server, and hands the response body to the client in
    reads of ``sizes`` bytes."""

    def __init__(self, sizes: list[int], raw: bytes | None = None) -> None:
        self.sizes, self.raw = sizes, raw
        self.inner = httpx2.HTTPTransport()

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        if self.raw is not None:
            return httpx2.Response(200, headers={"content-type": "text/event-stream"},
                                   stream=_Chunked([self.raw], self.sizes))
        resp = self.inner.handle_request(request)
        assert isinstance(resp.stream, httpx2.SyncByteStream)
        return httpx2.Response(resp.status_code, headers=resp.headers,
                               stream=_Chunked(resp.stream, self.sizes, owner=resp))


def sdk_observe(protocol: str, body: dict[str, Any], transport: RechunkTransport,
                base_url: str = "http://127.0.0.1:1") -> Observed:
    """The stream of the streamed request ``body`` as the official client parses and types
    it."""
    import anthropic
    import openai

    obs, http = Observed(), httpx2.Client(transport=transport, timeout=120)
    rest = {k: v for k, v in body.items()
            if k not in ("model", "messages", "prompt", "input", "max_tokens", "stream")}
    try:
        if protocol == "messages":
            ac = anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0,
                                     http_client=http)
            try:
                for ev in ac.messages.create(model=body["model"], messages=body["messages"],
                                             max_tokens=body["max_tokens"], stream=True,
                                             extra_body=rest):
                    observe_sdk_event(protocol, obs, ev.model_dump(mode="json",
                                                                   exclude_none=True))
            except anthropic.APIStatusError as exc:
                obs.error, obs.finish = "api_error", "failed"
                del exc
            return obs
        oc = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0,
                           http_client=http)
        kw: dict[str, Any] = {"model": body["model"], "stream": True, "extra_body": rest}
        if protocol == "chat":
            stream: Any = oc.chat.completions.create(messages=body["messages"],
                                                     max_tokens=body["max_tokens"], **kw)
        elif protocol == "completions":
            stream = oc.completions.create(prompt=body["prompt"], max_tokens=body["max_tokens"],
                                           **kw)
        else:
            stream = oc.responses.create(input=body["input"], **kw)
        try:
            for ev in stream:
                observe_sdk_event(protocol, obs, ev.model_dump(mode="json", exclude_none=True))
        except openai.APIError as exc:
            obs.error, obs.finish = getattr(exc, "code", None) or "error", "failed"
        return obs
    finally:
        http.close()


def observe_sdk_event(protocol: str, obs: Observed, obj: dict[str, Any]) -> None:
    from tests import stream_conformance as sc

    handler = {"chat": sc.chat_event, "completions": sc.chat_event,
               "responses": sc.responses_event, "messages": sc.messages_event}[protocol]
    handler(obs, obj)


def sdk_agrees(label: str, sdk: Observed, parsed: Observed, tally: Tally) -> None:
    """The official client saw what the conforming parser saw (its errors carry no ``coda``,
    so text, calls, finish and usage are compared)."""
    tally.counts["sdk_streams"] += 1
    # NOTE: an SDK hands Anthropic's tool input back as an object: compare arguments as JSON
    for what, a, b in (("text", sdk.text, parsed.text),
                       ("calls", _as_json(sdk.calls), _as_json(parsed.calls)),
                       ("finish", sdk.finish, parsed.finish),
                       ("usage", sdk.usage, parsed.usage if parsed.error is None else None)):
        tally.check("equal", a == b, f"{label}: SDK {what} {a!r} != parser {b!r}")


def _as_json(calls: Any) -> Any:
    import json

    try:
        return [(name, json.loads(args)) for name, args in calls]
    except (TypeError, ValueError):
        return calls
