"""One streaming HTTP connection, watched while it is written to (issue 14 item 1; SPEC P4,
L5, L7).

A client can leave in two ways the server must notice: it closes the socket (the ASGI server
reports ``http.disconnect``), or it stops reading, so the next write blocks on a full socket
buffer. :class:`Connection` turns both into one signal, :class:`ClientGone`, raised by
:meth:`Connection.write` and delivered to whoever registered with :meth:`Connection.on_gone`:

- the disconnect is watched *concurrently* with every write, so a write blocked on a stalled
  client is abandoned the moment the client closes;
- one write may block at most ``write_timeout_s``; past it the client is declared stalled
  (``ClientGone(stalled=True)``) and treated exactly like a disconnect;
- the response's last write, once sent, completes the exchange: the ``http.disconnect`` the
  ASGI server reports right after it is the exchange's end, never a lost client (no
  :class:`ClientGone` for a stream that ended normally);
- nothing here relies on cancelling a task: ``asyncio.wait_for`` on Python 3.11 can swallow a
  cancellation that races a completed wait, which is how a pump once outlived its client.

The caller then applies the request's declared disconnect policy (P4) once, at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from starlette.types import Receive, Send


class ClientGone(Exception):
    """The client closed the connection, or stalled a write past the bound."""

    def __init__(self, *, stalled: bool = False) -> None:
        super().__init__("client stalled" if stalled else "client disconnected")
        self.stalled = stalled


class Connection:
    """Writes to one ASGI connection while watching it; see the module docstring."""

    def __init__(self, receive: Receive, send: Send, *, write_timeout_s: float) -> None:
        self._receive = receive
        self._send = send
        self._write_timeout_s = write_timeout_s
        self._gone = asyncio.Event()
        self.stalled = False
        self.send_s = 0.0  # NOTE: seconds spent inside writes (SPEC P5 "network send")
        self._callbacks: list[Callable[[], None]] = []

    @property
    def gone(self) -> bool:
        return self._gone.is_set()

    def on_gone(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the event loop) when the client is gone; at once if it is."""
        if self.gone:
            callback()
        else:
            self._callbacks.append(callback)

    def _mark_gone(self, *, stalled: bool = False) -> None:
        if self.gone:
            return
        self.stalled = stalled
        self._gone.set()
        for cb in self._callbacks:
            cb()

    async def watch(self) -> None:
        """Read the ASGI receive channel until the disconnect; run as a task beside writes."""
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self._mark_gone()
                return

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        await self._guarded({"type": "http.response.start", "status": status,
                             "headers": headers})

    async def write(self, body: bytes, *, more_body: bool = True) -> None:
        """Send ``body``; raises :class:`ClientGone` if the client leaves or stalls first."""
        # NOTE: perf_counter, not loop.time(): uvloop's clock is the loop iteration's cached
        # millisecond, so a write finishing within it measured 0.0 (P5 read a send as none)
        t0 = time.perf_counter()
        try:
            await self._guarded({"type": "http.response.body", "body": body,
                                 "more_body": more_body})
        finally:
            self.send_s += time.perf_counter() - t0

    async def _guarded(self, message: dict[str, object]) -> None:
        if self.gone:
            raise ClientGone(stalled=self.stalled)
        sending = asyncio.ensure_future(self._send(message))  # type: ignore[arg-type,unused-ignore]
        gone = asyncio.ensure_future(self._gone.wait())
        try:
            done, _ = await asyncio.wait({sending, gone}, timeout=self._write_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not sending.done():
                sending.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(sending, gone, return_exceptions=True)
        if sending in done and sending.exception() is None and (
                not self.gone or message.get("more_body") is False):
            # NOTE: the response's last message, sent, completes the exchange: the ASGI server
            # then answers receive() with http.disconnect (uvicorn, httpx), which the watch may
            # report before this resumes; that is the exchange's end, not a client leaving
            return
        if sending in done and isinstance(sending.exception(), OSError):
            self._mark_gone()
        elif not done:
            # NOTE: the write blocked for the whole bound: the client stopped reading.
            self._mark_gone(stalled=True)
        elif sending in done and sending.exception() is not None and not self.gone:
            raise sending.exception()  # type: ignore[misc]
        raise ClientGone(stalled=self.stalled)
