"""Per-app server state: settings, the engine, the store of recent requests (for replay and
``GET /v1/responses/{id}``; the records and their stores in :mod:`coda.server.records`),
metrics tracking, and the submit path (issue 4; SPEC P3, P4, C1).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import tokenizers

from coda.engine.protocol import Engine, EngineHandle, ModelSelecting
from coda.engine.types import EngineConfig, GenerationRequest
from coda.errors import CodaError, ErrorCode
from coda.finish import CancelCause
from coda.models.source import model_key
from coda.models.tokenizer_bundle import TokenizerBundle
from coda.reader import follow
from coda.reasoning import ReasoningSpec, marker_ids, reasoning_spec
from coda.server.admission import PromptBound
from coda.server.http_errors import ApiError, api_error_from
from coda.server.metrics import ServerMetrics
from coda.server.records import DisconnectPolicy, Record, RecordStore, ResponseStore
from coda.stream_backpressure import BackpressureConfig

log = logging.getLogger("coda.server")

@dataclass(frozen=True)
class ServerSettings:
    """HTTP-layer knobs, fixed at app creation.

    ``keepalive_s``: quiet seconds before an SSE keepalive comment. ``max_stored_requests``:
    how many recent requests stay replayable (oldest evicted first). ``on_disconnect``: the
    default P4 policy of foreground requests. ``backpressure``: the default P6 policy.
    ``write_timeout_s``: the longest one SSE write may block on a client that stopped reading;
    past it the client is treated as disconnected (P4, issue 14).
    ``max_body_bytes``: larger request bodies get 413 before they are parsed.
    ``max_waiting``: engine requests allowed to wait for a batch slot (those past the slots
    free); past it a request gets 429 with ``Retry-After: retry_after_s`` (None: unbounded).
    """

    keepalive_s: float = 5.0
    max_stored_requests: int = 1024
    on_disconnect: DisconnectPolicy = "cancel"
    backpressure: BackpressureConfig | None = None
    max_n: int = 16
    graceful_shutdown_s: float = 10.0
    write_timeout_s: float = 30.0
    max_body_bytes: int = 16 * 1024 * 1024
    max_waiting: int | None = 1024
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be >= 1")
        if self.max_waiting is not None and self.max_waiting < 1:
            # NOTE: 0 lets nothing wait: a busy server would refuse every request
            raise ValueError("max_waiting must be >= 1 (or None)")
        if not self.keepalive_s > 0:
            raise ValueError("keepalive_s must be > 0")
        if not self.write_timeout_s > 0:
            raise ValueError("write_timeout_s must be > 0")
        if self.max_stored_requests < 1:
            raise ValueError("max_stored_requests must be >= 1")


def split_reasoning(tokenizer: tokenizers.Tokenizer, markers: bool, ids: Sequence[int], *, budget: int | None,
                    budget_field: str) -> ReasoningSpec | None:
    """:func:`coda.reasoning.reasoning_spec`, entered only where it has something to do: a
    budget to check, or a model with markers (``markers``: it has them), with or without a
    grammar (it constrains the answer only). Otherwise its answer is known without it: no
    split, and nothing to refuse (issue 22)."""
    if budget is None and not markers:
        return None  # NOTE: reasoning_spec's own answer here: no markers
    return reasoning_spec(tokenizer, ids, budget=budget, budget_field=budget_field)


class ServerState:
    """What one app serves with: its engine and its store, both fixed at construction."""

    def __init__(self, engine: Engine, settings: ServerSettings, api_key: str | None,
                 store: ResponseStore | None = None) -> None:
        self.engine = engine
        self.settings = settings
        self.api_key = api_key
        self.store: ResponseStore = (store if store is not None
                                     else RecordStore(settings.max_stored_requests))
        self.metrics = ServerMetrics(engine)
        self.shutting_down = False
        self.manage_engine = True
        self._tasks: set[asyncio.Task[None]] = set()
        cfg = getattr(engine, "config", None)
        self.engine_config: EngineConfig = cfg if isinstance(cfg, EngineConfig) else EngineConfig()
        self.prompt_bound = PromptBound.of(engine.tokenizer)
        self._bounds: dict[int, PromptBound] = {id(engine.tokenizer): self.prompt_bound}
        self._markers: dict[int, bool] = {}

    def reasoning_markers(self) -> bool:
        """Whether the (routed) model's vocabulary has the reasoning markers
        (:func:`coda.reasoning.marker_ids`), asked once per tokenizer: a fact of the model, so
        a request on a model without them never enters :mod:`coda.reasoning` (issue 22)."""
        tokenizer = self.engine.tokenizer
        known = self._markers.get(id(tokenizer))
        if known is None:
            known = self._markers[id(tokenizer)] = marker_ids(tokenizer) is not None
        return known

    def reasoning(self, ids: Sequence[int], *, budget: int | None, budget_field: str
                  ) -> ReasoningSpec | None:
        """The request's reasoning split (:func:`split_reasoning` with the routed model's
        markers): every protocol's one way into :mod:`coda.reasoning` (issue 22, issue 23)."""
        return split_reasoning(self.engine.tokenizer, self.reasoning_markers(), ids,
                               budget=budget, budget_field=budget_field)

    def encode(self, text: str, *, add_special_tokens: bool, field: str = "prompt",
               truncate: bool = False) -> list[int]:
        """Tokenize a prompt (call it off the event loop, on a worker thread: ``asyncio.to_thread``);
        a prompt whose byte length alone exceeds the context is refused untokenized, or with
        ``truncate`` cut to the context's first tokens (embeddings)."""
        # NOTE: no lone surrogate reaches here: the admission middleware refuses any body
        # holding one (coda.server.admission.unencodable)
        chat = self.engine.chat  # NOTE: several models: the routed model's
        tokenizer = chat.tokenizer
        bound = self._bounds.get(id(tokenizer))
        if bound is None:
            bound = self._bounds[id(tokenizer)] = PromptBound.of(tokenizer)
        limit = self.engine.context_length
        if not truncate:
            bound.check(text, limit, field)
            return self._ids(chat, text, add_special_tokens)
        if bound.certain:
            # NOTE: `limit` tokens span at most limit × the longest token's bytes; twice that
            # keeps the cut far from the tokens kept, so they are the whole text's
            cut = text.encode("utf-8", "surrogatepass")[:2 * limit * bound.max_token_bytes]
            text = cut.decode("utf-8", "ignore")
        return self._ids(chat, text, add_special_tokens)[:limit]

    @staticmethod
    def _ids(chat: TokenizerBundle, text: str, add_special_tokens: bool) -> list[int]:
        """With special tokens: a raw prompt's, its BOS once (:meth:`TokenizerBundle.encode_prompt`)."""
        if add_special_tokens:
            return chat.encode_prompt(text)
        return list(chat.tokenizer.encode(text, add_special_tokens=False).ids)

    def check_model(self, name: str) -> None:
        engine = self.engine
        if isinstance(engine, ModelSelecting):  # NOTE: several models: route by name
            if not engine.select_model(name):
                raise ApiError(404, f"The model '{name}' does not exist; this server serves "
                                    f"{', '.join(repr(n) for n in engine.served_names())}",
                               param="model", code="model_not_found")
            return
        if model_key(name) not in self.engine.model_aliases:
            raise ApiError(404, f"The model '{name}' does not exist; this server serves "
                                f"'{self.engine.model_name}'", param="model",
                           code="model_not_found")

    def submit_all(self, requests: Sequence[GenerationRequest],
                   rename: Mapping[str, str], prompt_of: Sequence[int] = ()
                   ) -> list[EngineHandle]:
        """Submit every request or none (a failure cancels those already queued); an error
        names the failing request's prompt by ``prompt_of`` (a batch's prompt index)."""
        self.admit(len(requests))
        self.metrics.listen()  # NOTE: before submitting: a request may end before it is tracked
        handles: list[EngineHandle] = []
        try:
            for req in requests:
                handles.append(self.engine.submit(req))
        except CodaError as exc:
            for h in handles:
                h.cancel(CancelCause.CLIENT)
            raise api_error_from(exc, rename, prompt_of[len(handles)] if prompt_of
                                 else None) from None
        except (ImportError, ValueError, TypeError) as exc:
            # NOTE: a grammar (or early-stop policy) the engine cannot compile is bad input,
            # not a server fault; anything else is re-raised.
            for h in handles:
                h.cancel(CancelCause.CLIENT)
            req = requests[len(handles)]
            if req.grammar is None and req.early_stop is None:
                raise
            # NOTE: the protocol's own name for the grammar's field (Ollama: ``format``)
            field = rename.get("response_format", "response_format") \
                if req.grammar is not None else "early_stop"
            raise ApiError(400, f"{field}: {exc}", param=field, code="invalid_request") from None
        for h in handles:
            self.metrics.track(h)
            log.info("request submitted", extra={"request_id": h.request_id})
        return handles

    def admit(self, incoming: int, what: str = "generations (prompts x n)",
              takes_slot: bool = True) -> None:
        """The admission rule for ``incoming`` new engine requests (docs/api.md, "Overload"):
        503 while shutting down; a bounded waiting queue: a request that would leave more than
        ``max_waiting`` waiting gets 429 + Retry-After, one larger than the server could ever
        hold (its batch slots, ``max_num_seqs``, and ``max_waiting`` waiting) a 400 naming
        ``what`` it asks for. Every engine request a route submits passes here first (a
        prompt-scoring one too, coda.server.echo; an embedding call, coda.server.embeddings,
        which holds no batch slot: ``takes_slot`` False, only the bound)."""
        if self.shutting_down:
            raise ApiError(503, "the server is shutting down", code=ErrorCode.ENGINE_SHUTDOWN.value)
        bound = self.settings.max_waiting
        if bound is None:
            return
        # NOTE: scaled out, one replica's slots: never more than the server holds
        slots = self.engine.config.max_num_seqs if takes_slot else 0
        if incoming > slots + bound:  # NOTE: bound >= 1, so only a batch (prompts x n) gets here
            # NOTE: a batch (prompts x n) larger than an idle server holds can never be
            # admitted: a 429 would send the client into retries that all fail the same way
            # (the SDKs retry 429), and its "N requests are waiting" would name a queue that
            # is empty. Within it, it is the 429 below while the server is busy
            held = f"{slots} running (--max-num-seqs) and {bound}" if slots else f"{bound}"
            raise ApiError(400, f"this request asks for {incoming} {what}, more than the "
                                f"{slots + bound} this server can ever hold ({held} waiting, "
                                "--max-waiting); send fewer at a time", code="invalid_request")
        # NOTE: only what no free batch slot takes waits: a burst on an idle server of
        # max_num_seqs + max_waiting requests is all accepted, though no step admitted any yet
        # (an embedding takes no slot: it waits whatever they are)
        queued = (self.engine.num_queued(incoming) if takes_slot
                  else self.engine.num_queued() + incoming)
        if queued > bound:
            raise ApiError(429, f"server overloaded: {self.engine.num_queued()} requests are "
                                f"waiting for a batch slot (bound {bound}); "
                                "retry later", code="overloaded",
                           headers={"retry-after": str(self.settings.retry_after_s)})

    def cancel_all(self, cause: CancelCause = CancelCause.SHUTDOWN) -> int:
        """Cancel every stored request still running; returns how many were."""
        running = [r for r in self.store.records() if not r.done]
        for record in running:
            record.cancel(cause)
        return len(running)

    def keep_draining(self, handle: EngineHandle) -> None:
        """Read (and acknowledge) a background request's log with nobody attached, so its
        bounded buffer (P6) never overflows for lack of a reader; ends at the terminal."""

        async def drain() -> None:
            # NOTE: an observer, never the owner: an in-process handle's ``events`` cancels
            # the request when left early (a drain cancelled at shutdown must not)
            async for _ in follow(handle.stream):
                pass

        task = asyncio.get_running_loop().create_task(drain())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def forget_when_done(self, record: Record) -> None:
        """Drop ``record`` from the store once every handle has its terminal (Responses
        ``store: false``): after the stream ends nothing of it is kept or retrievable."""

        async def forget() -> None:
            for h in record.handles:
                async for _ in follow(h.stream):  # NOTE: an observer (see keep_draining)
                    pass
            self.store.remove(record.id)

        task = asyncio.get_running_loop().create_task(forget())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain_tasks(self, timeout: float | None = None) -> None:
        """Wait for the background tasks (stream watchers, forgetters); after ``timeout``
        seconds cancel the ones left (a detached request still running on a replica: its
        stream log, not this process, carries it on)."""
        if not self._tasks:
            return
        _, pending = await asyncio.wait(list(self._tasks), timeout=timeout)
        for task in pending:
            task.cancel()
        if pending:
            log.info("shutdown left detached requests running",
                     extra={"tasks": len(pending)})
            await asyncio.gather(*pending, return_exceptions=True)

    @property
    def num_tasks(self) -> int:
        return len(self._tasks)

    def disconnect_handler(self, record: Record, policy: DisconnectPolicy) -> Callable[[], None]:
        """P4: what a lost client does to ``record`` — cancel (transport_error) or nothing."""
        if policy == "continue" and not record.background:
            self.store.detach(record)

        def on_disconnect() -> None:
            if record.background or policy == "continue":
                log.info("client disconnected; request continues",
                         extra={"request_id": record.id})
                return
            if not record.done:
                log.info("client disconnected; cancelling", extra={"request_id": record.id})
            record.cancel(CancelCause.DISCONNECT)

        return on_disconnect
