"""The Coda HTTP server: app factory, its middlewares (auth, HEAD, the grammar warm-up) and
the uvicorn runner with graceful shutdown (issue 4; SPEC P3, P4, L2); the operational
endpoints and stream resume are :mod:`coda.server.operational_routes`.

Graceful shutdown: on SIGTERM (or the end of the lifespan) the engine is shut down first, which
ends every in-flight request with its single terminal event (cancelled, cause shutdown); open
SSE streams therefore deliver their final event before the connections close.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from coda.engine.protocol import Engine
from coda.server import (
    anthropic_routes,
    chat_store_routes,
    embeddings,
    ollama_info,
    ollama_manage,
    ollama_routes,
    openai_routes,
    operational_routes,
    playground_routes,
    responses_manage,
    responses_routes,
)
from coda.server.admission import BodyLimitMiddleware
from coda.server.http_errors import (
    RequestIdMiddleware,
    error_response,
    install_handlers,
    protocol_of,
    scope_protocol,
)
from coda.server.logs import configure_logging
from coda.server.state import ServerSettings, ServerState

if TYPE_CHECKING:
    from coda.server.durable import ServerDurable

log = logging.getLogger("coda.server")

# NOTE: how long the server is idle (nothing in flight) before the grammar build may start;
# longer from the lifespan's start, as uvicorn starts accepting only after it
WARMUP_IDLE_S = 0.5
WARMUP_START_IDLE_S = 2.0
_OPEN_PATHS = frozenset({"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect"})
# NOTE: GET routes that can stream (a resume attaches a reader): no HEAD on them
_STREAMING_GETS = ("/v1/streams/", "/v1/responses/")


class ApiKeyMiddleware:
    """``Authorization: Bearer KEY`` or ``x-api-key: KEY``; else 401 in the protocol's shape."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS or _open_page(scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        bearer = headers.get(b"authorization", b"")
        given = bearer[7:] if bearer[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        if not hmac.compare_digest(given, self.key):
            resp = error_response(scope_protocol(scope), 401, "Invalid or missing API key",
                                  code="invalid_api_key")
            await resp(scope, receive, send)
            return
        await self.app(scope, receive, send)


class OllamaJsonBodyMiddleware:
    """Ollama reads every ``/api/`` body as JSON whatever its ``Content-Type``, and its
    README's ``curl http://localhost:11434/api/generate -d '{...}'`` sends
    ``application/x-www-form-urlencoded``; FastAPI parses a body as JSON only under a JSON
    type (or none), so such a body was a 400 there. On the Ollama routes the header is JSON."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["method"] in ("POST", "DELETE")
                and protocol_of(scope["path"]) == "ollama"):
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


class HeadMiddleware:
    """HEAD as a GET without the body (RFC 9110 9.3.2): FastAPI routes answer no HEAD (a
    405), yet Ollama's CLI checks its server with ``HEAD /`` before each command, and uptime
    probes and proxies send HEAD. The routes that can stream are left out (their HEAD stays
    a 405): a HEAD must not attach a reader to a stream."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["method"] != "HEAD"
                or scope["path"].startswith(_STREAMING_GETS)):
            await self.app(scope, receive, send)
            return
        # NOTE: uvicorn knows the request is a HEAD and sends the GET's headers, no body
        await self.app({**scope, "method": "GET"}, receive, send)


class GrammarWarmupMiddleware:
    """Issue 19 item 2: the engine's grammar tokenizer build holds the GIL for a while
    (:class:`coda.engine.grammar_tokenizer.GrammarWarmup`), so the server defers it at its start and
    releases it once it has been idle for ``idle_s`` (nothing in flight, nothing new): after
    the first answers, never under them — ``/health`` at the start does not wait for it. A
    grammar request that comes first starts it itself. An engine without one: nothing to do."""

    def __init__(self, app: ASGIApp, engine: Engine, idle_s: float | None = None) -> None:
        self.app, self.engine = app, engine
        self.idle_s = WARMUP_IDLE_S if idle_s is None else idle_s
        self.in_flight, self.done = 0, False
        self._timer: asyncio.TimerHandle | None = None

    def _warmup(self) -> Any:
        return None if self.done else getattr(self.engine, "grammar_warmup", None)

    def _arm(self, idle_s: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(idle_s, self._release)

    def _release(self) -> None:
        warm = self._warmup()
        if self.in_flight == 0 and warm is not None:
            warm.release()
            self.done = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            async def started(message: Any) -> None:
                warm = self._warmup()
                if message["type"] == "lifespan.startup.complete" and warm is not None:
                    warm.defer()  # NOTE: the engine is started: from now on released here
                    self._arm(max(self.idle_s, WARMUP_START_IDLE_S))
                await send(message)

            await self.app(scope, receive, started)
            return
        if self.done or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.in_flight += 1
        if self._timer is not None:
            self._timer.cancel()
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0 and not self.done:
                self._arm(self.idle_s)


def _open_page(path: str) -> bool:
    # NOTE: the playground's static files hold no data; the page sends the key itself
    return path in playground_routes.OPEN_PATHS or path.startswith(playground_routes.OPEN_PREFIX)


def create_app(engine: Engine, *, api_key: str | None = None,
               settings: ServerSettings | None = None, manage_engine: bool = True,
               durable: ServerDurable | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``. With ``manage_engine`` the lifespan starts the
    engine and shuts it down at the end (every in-flight request gets its terminal event).
    ``durable`` (issue 12, issue 22 step 3): serve ``engine`` behind the Redis stream log (a
    :class:`~coda.durable.engine.DurableEngine`) with a store of records kept there too, chosen
    here once; the routes see an engine and a store either way."""
    settings = settings or ServerSettings()
    served: Engine = engine
    store = None
    if durable is not None:
        served, store = durable.build(engine, manage_engine=manage_engine,
                                      capacity=settings.max_stored_requests)
    state = ServerState(served, settings, api_key, store)
    # NOTE: the durable wrapper starts and stops itself (its lease) even over a shared engine
    state.manage_engine = manage_engine or durable is not None
    register = getattr(engine, "register_metrics", None)
    if register is not None:  # NOTE: several models: loads and unloads (coda.server.model_router)
        register(state.metrics.registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if state.manage_engine:
            await asyncio.to_thread(served.start)
        try:
            yield
        finally:
            state.shutting_down = True
            if state.manage_engine:
                await asyncio.to_thread(served.shutdown)
            # NOTE: bounded only with a stream log: there, detached requests run on elsewhere
            await state.drain_tasks(timeout=5.0 if durable is not None else None)

    app = FastAPI(title="Coda", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-, Anthropic- and Ollama-compatible API; see docs/api.md.")
    app.state.coda = state
    install_handlers(app)
    app.include_router(openai_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(responses_manage.router)  # NOTE: delete, input_items
    app.include_router(chat_store_routes.router)  # NOTE: stored chat completions
    app.include_router(anthropic_routes.router)
    app.include_router(ollama_routes.router)
    app.include_router(ollama_info.router)
    app.include_router(ollama_manage.router)  # NOTE: pull, delete, copy, create, push
    app.include_router(embeddings.router)
    app.include_router(playground_routes.router)
    operational_routes.register(app)
    app.add_middleware(GrammarWarmupMiddleware, engine=engine)  # NOTE: innermost
    app.add_middleware(OllamaJsonBodyMiddleware)
    app.add_middleware(HeadMiddleware)
    # NOTE: added before the key check, so the key check runs first (outermost)
    app.add_middleware(BodyLimitMiddleware, max_bytes=state.settings.max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    # NOTE: outermost: a 401 or 413 above carries the request id header too (P1)
    app.add_middleware(RequestIdMiddleware)
    return app


class CodaServer(uvicorn.Server):
    """uvicorn, but every in-flight request ends with its terminal event before connections
    are drained: the engine is shut down (an app that owns it) or the app's own requests are
    cancelled with cause shutdown (an app sharing an engine). Open streams thus send their
    final event and close instead of being cut at the graceful-shutdown timeout."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        app = config.app
        self._state: ServerState | None = getattr(getattr(app, "state", None), "coda", None)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if sockets is not None and self.started:
            # NOTE: uvicorn says "Uvicorn running on ..." only for sockets it bound itself;
            # ``coda serve`` binds first (coda.server.listen), and users look for that line
            self._log_started_message(sockets)

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        """A graceful stop on SIGINT/SIGTERM returns (``coda serve`` exits 0): uvicorn would
        raise the signal again once shut down, so that the process died of it (exit -15 for
        SIGTERM, 130 for SIGINT) after a clean shutdown. A second SIGINT during the shutdown
        (uvicorn's force exit: open connections are not waited for) is still raised again:
        exit 130, the forced end said as one."""
        with super().capture_signals():
            yield
            if not self.force_exit:  # NOTE: emptied before uvicorn's context re-raises them
                self._captured_signals.clear()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        st = self._state
        if st is not None:
            st.shutting_down = True
            if st.manage_engine:
                await asyncio.to_thread(st.engine.shutdown)
            else:
                st.cancel_all()
        await super().shutdown(sockets)


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000, *,
          api_key: str | None = None, settings: ServerSettings | None = None,
          log_level: str = "info", json_logs: bool = True,
          durable: ServerDurable | None = None, sock: socket.socket | None = None) -> None:
    """Run the server until SIGINT/SIGTERM (blocking), then return once it has shut down
    gracefully (:meth:`CodaServer.capture_signals`); on ``sock`` where given (bound by
    :func:`coda.server.listen.bind_listener` before the model loaded), else on host:port."""
    configure_logging(log_level, json_lines=json_logs)
    settings = settings or ServerSettings()
    app = create_app(engine, api_key=api_key, settings=settings, durable=durable)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                            timeout_graceful_shutdown=int(settings.graceful_shutdown_s),
                            access_log=False, log_config=None)
    # NOTE: the port bound (``--port 0``: the one the system chose; it logged 0)
    bound = sock.getsockname()[1] if sock is not None else port
    log.info("serving", extra={"model": engine.model_name, "host": host, "port": bound})
    CodaServer(config).run(sockets=[sock] if sock is not None else None)
