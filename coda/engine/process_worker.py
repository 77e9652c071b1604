"""The child side of a model worker process (issue 23 item 1; SPEC P1–P3, P6, C1, L2).

One process per served model, started by :class:`coda.engine.process_engine.WorkerProcess`
as ``python -m coda.engine.process_worker FD`` (a clean interpreter: no inherited threads or
locks, nothing of the server's main module), FD one end of a socket pair. It loads the
model into an in-process :class:`~coda.engine.async_engine.AsyncEngine` and then serves its
parent over one duplex pipe. Every message is a tuple of plain data (pickled by
:mod:`multiprocessing`):

parent → worker: ``("init", model, EngineConfig, kv_available, log_setup)`` first, then
``("submit", GenerationRequest, reply)`` · ``("cancel", request_id, cause)`` ·
``("ack", request_id, seq)`` · ``("call", call_id, method, args)`` · ``("cancel_call",
call_id)`` (an ``embed`` call whose caller left: its engine drops it at the next chunk
boundary, no reply; :mod:`coda.engine.process_embeds`) · ``("shutdown",)``

worker → parent: ``("loaded", info)`` or ``("load_failed", message)`` first, then
``("events", [(request_id, [StreamEvent, ...]), ...], [(request_id, Usage), ...])`` (the
second list: billing reports, :mod:`coda.engine.process_sender`) · ``("accepted", request_id)`` (when
asked) · ``("rejected", request_id, kind, code, message, field)`` · ``("reply", call_id,
value)``.

Exactness across the boundary: the engine's own :class:`~coda.stream.RequestStream` stays
the one producer; a sender thread forwards each stream's events in seq order, each seq once
(:class:`~coda.engine.process_sender.WorkerSender`), and the parent appends them with
``RequestStream.extend`` (gaps refused).
Backpressure credit (P6) is returned only when the parent's reader acknowledges (``ack``), so
a slow client pauses or overflows the request here exactly as it would in process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

from coda.engine.process_sender import WorkerSender
from coda.engine.types import EngineConfig
from coda.finish import CancelCause
from coda.stream import RequestStream


def worker_main(conn: Connection, model: str | None, config: EngineConfig,
                kv_available: int | None, log_setup: Callable[[], None] | None = None) -> None:
    """Entry point of the worker process (see the module docstring). ``kv_available``: the
    bytes the KV-cache rule may take a share of (the model's part of ``--memory-budget``),
    in place of the machine's free memory. ``log_setup``: how the server configures its
    logs (a picklable callable, so the worker's lines look like the server's)."""
    send_lock = threading.Lock()

    def send(msg: tuple[Any, ...]) -> None:
        with send_lock:
            conn.send(msg)

    if log_setup is not None:
        log_setup()
    try:
        if kv_available is not None:
            from coda.engine import kv_budget

            # NOTE: this process serves one model: the cache rule's "memory available after
            # the weights" is the model's share of the server's budget, not the machine's
            share: int = kv_available
            kv_budget.available_memory_bytes = lambda: share
            # NOTE: the share is already net of the weights: the fraction rule applies to it
            # (not the single-model memory budget, which would subtract the weights again)
            config = replace(config, kv_cache_memory_fraction=(
                config.kv_cache_memory_fraction or kv_budget.DEFAULT_KV_MEMORY_FRACTION))
        from coda.engine.async_engine import AsyncEngine

        engine = AsyncEngine.from_model_dir(model, config)
        engine.start()
    except BaseException as exc:  # NOTE: a failed load ends this process, never the server
        send(("load_failed", f"{type(exc).__name__}: {exc}"))
        conn.close()
        return
    send(("loaded", _info(engine)))
    sender = WorkerSender(send)
    try:
        _serve(conn, engine, sender, send)
    finally:
        engine.shutdown()
        sender.stop()
        conn.close()


def _info(engine: Any) -> dict[str, Any]:
    return {"model_name": engine.model_name, "context_length": engine.context_length,
            "identity": engine.identity, "kv_cache_bytes": int(engine.runner.kv.nbytes),
            "summary": engine.load_summary(), "describe": engine.describe(),
            "model_info": engine.model_info()}


def _serve(conn: Connection, engine: Any, sender: WorkerSender, send: Any) -> None:
    from coda.errors import CodaError

    streams: dict[str, RequestStream] = {}
    embeds: dict[int, Future[list[float]]] = {}  # NOTE: embed calls not answered yet
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # NOTE: the parent is gone: end everything here
            return
        kind = msg[0]
        if kind == "submit":
            req, reply = msg[1], msg[2]
            try:
                handle = engine.submit(req)
            except CodaError as exc:
                send(("rejected", req.request_id, "coda", exc.code.value, exc.message,
                      exc.field))
                continue
            except (ValueError, TypeError, ImportError) as exc:  # NOTE: a bad grammar etc.
                send(("rejected", req.request_id, "value", "invalid_request", str(exc), None))
                continue
            streams[handle.request_id] = handle.stream
            sender.forward(handle.stream, handle._run.live_usage)
            if reply:
                send(("accepted", req.request_id))
            for rid in [r for r, s in streams.items() if s.closed and not s.live]:
                del streams[rid]
        elif kind == "cancel":
            engine.cancel(msg[1], CancelCause(msg[2]))
        elif kind == "ack":
            stream = streams.get(msg[1])
            if stream is not None:
                stream.ack(msg[2])
                if stream.closed:
                    del streams[msg[1]]
        elif kind == "call":
            _, call_id, method, args = msg
            if method == "embed":
                _embed(engine, call_id, args[0], send, embeds)
            else:
                send(("reply", call_id, _call(engine, method, args)))
        elif kind == "cancel_call":
            fut = embeds.pop(msg[1], None)
            if fut is not None:
                fut.cancel()  # NOTE: the engine thread drops it at its next chunk boundary
        elif kind == "shutdown":
            return


def _embed(engine: Any, call_id: int, token_ids: list[int], send: Any,
           embeds: dict[int, Future[list[float]]]) -> None:
    """Queue an embedding (its future kept in ``embeds`` until it ends, for ``cancel_call``);
    it is answered (``("ok", vector)`` or the refusal as
    :func:`~coda.engine.process_errors.rebuild_error` reads it) once the engine thread ran it,
    while this loop keeps serving the model's requests; a cancelled one is not answered."""
    from coda.errors import CodaError

    def refusal(exc: BaseException) -> tuple[Any, ...]:
        if isinstance(exc, CodaError):
            return ("coda", exc.code.value, exc.message, exc.field)
        return ("value", "invalid_request", str(exc), None)

    def reply(fut: Future[list[float]]) -> None:
        embeds.pop(call_id, None)
        if fut.cancelled():
            return  # NOTE: its caller left; the parent has forgotten the call
        exc = fut.exception()
        send(("reply", call_id, ("ok", fut.result()) if exc is None else refusal(exc)))

    try:
        fut = engine.embed_future(token_ids)
    except Exception as exc:
        send(("reply", call_id, refusal(exc)))
        return
    embeds[call_id] = fut
    fut.add_done_callback(reply)


def _call(engine: Any, method: str, args: tuple[Any, ...]) -> Any:
    if method == "stats":
        return engine.stats()
    if method == "trace_rows":
        rows = getattr(engine.trace, "rows", None)
        found = rows(args[0]) if rows is not None else None
        return None if found is None else [e.to_dict() for e in found[0]]
    raise ValueError(f"unknown worker call {method!r}")


def main(argv: list[str]) -> None:
    conn = Connection(int(argv[1]))
    try:
        kind, model, config, kv_available, log_setup = conn.recv()
    except (EOFError, OSError):
        return
    assert kind == "init"
    worker_main(conn, model, config, kv_available, log_setup)


if __name__ == "__main__":
    import sys

    main(sys.argv)
